"""The host's samplers and schedulers on the pack's model.

A SAMPLER (``KSamplerSelect``, or any node that makes one) drives the sampler node's run as it drives a native
model: the host's sampler object is handed a guider-shaped wrapper whose calls are the pack's evaluations
(``h3_core.pipeline.sampler.denoise``'s ``solver``, the audio carried on the video schedule as native H3 carries
it), with the host's own flow sampling object where its samplers look for it. ``H3 Scheduler`` makes SIGMAS with the
host's schedulers (simple, beta, ...) from that same object at H3's video shift, as ``BasicScheduler`` makes them
for a native H3 model."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from ..h3_core.pipeline.schedule import AUDIO_SHIFT, VIDEO_SHIFT
from . import _host


def flow_sampling(video_shift: float, audio_shift: float = AUDIO_SHIFT):
    """The host's flow sampling object at ``video_shift``: its ``ModelSamplingAV`` (native H3's) where it has one,
    its discrete flow sampling otherwise; both constant-velocity (``CONST``)."""
    import comfy.model_sampling as ms

    if hasattr(ms, "ModelSamplingAV"):

        class Sampling(ms.ModelSamplingAV, ms.CONST):
            pass

        sampling = Sampling()
        sampling.set_parameters(shift=video_shift, audio_shift=audio_shift)
        return sampling

    class Sampling(ms.ModelSamplingDiscreteFlow, ms.CONST):
        pass

    sampling = Sampling()
    sampling.set_parameters(shift=video_shift)
    return sampling


class _Guided:
    """What a host sampler calls as it calls the host's guider: ``(x, σ) → clean estimate``, with the sampling object
    at ``.inner_model.model_sampling`` and ``.model_patcher.get_model_object("model_sampling")``, where the host's
    samplers read it; ``.cfg`` (1: H3 runs without guidance) and ``.model_patcher.model``, which 0.38's
    ``KSAMPLER.sample`` names in its first step's log line (comfy/samplers.py 311c0140)."""

    cfg = 1.0

    def __init__(self, denoised, sampling):
        self.denoised, self.model_sampling = denoised, sampling
        self.inner_model = self
        self.model_patcher = self
        self.model = self

    def get_model_object(self, name):
        if name != "model_sampling":
            raise KeyError(name)
        return self.model_sampling

    def __call__(self, x, sigma, model_options=None, seed=None, **_):
        return self.denoised(x, sigma)


def sampler_name(sampler) -> str:
    """The host sampler's function name (``sample_euler``), or its class's."""
    function = getattr(sampler, "sampler_function", None)
    return getattr(function, "__name__", None) or type(sampler).__name__


def host_solver(sampler, video_shift: float, audio_shift: float, seed: int):
    """``sampler`` (the host's SAMPLER) as ``denoise``'s ``solver``; one that needs classifier-free guidance is an
    error naming it (H3 runs without guidance)."""
    name = sampler_name(sampler)
    if "cfg_pp" in name:
        raise H3InputError(
            f"sampler: {name} needs classifier-free guidance, which H3 does not run (one evaluation per step); "
            "choose its plain form (e.g. euler, res_multistep)"
        )
    if not callable(getattr(sampler, "sample", None)):
        raise H3InputError(f"sampler: got {type(sampler).__name__}, not one of the host's samplers (KSamplerSelect)")
    sampling = flow_sampling(video_shift, audio_shift)

    def solve(denoised, x, sigmas, on_step):
        def callback(i, clean, _x, total):
            on_step(i + 1, total, clean)

        # the state is already at sigmas[0]: the host's noise scaling, σ·noise + (1 − σ)·latent, gives it back
        return sampler.sample(
            _Guided(denoised, sampling), sigmas, {"seed": seed}, callback, x, latent_image=x, disable_pbar=True
        )

    return solve


class H3Scheduler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import comfy.samplers

        return io.Schema(
            node_id="H3Scheduler",
            display_name="H3 Scheduler",
            category=_host.CATEGORY,
            description="SIGMAS for the H3 Sampler from the host's schedulers (simple, beta, ...) at H3's video flow "
            "shift, as BasicScheduler makes them for ComfyUI's own H3 model; turbo LoRAs name theirs (e.g. "
            "simple or beta at 4 or 8 steps).",
            inputs=[
                io.Combo.Input("scheduler", options=list(comfy.samplers.SCHEDULER_NAMES), default="simple"),
                io.Int.Input("steps", default=8, min=1, max=200),
                io.Float.Input("video_shift", default=VIDEO_SHIFT, min=0.1, max=100.0, step=0.1),
            ],
            outputs=[io.Sigmas.Output()],
        )

    @classmethod
    def execute(cls, scheduler, steps, video_shift):
        import comfy.samplers

        return io.NodeOutput(comfy.samplers.calculate_sigmas(flow_sampling(video_shift), scheduler, steps).cpu())
