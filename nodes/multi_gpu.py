"""H3 Multi-GPU: the DiT sampled across several GPUs of this machine (Ulysses sequence parallelism, VDN-H3's
branch split), with one worker process per extra GPU (``nodes.ranks``)."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..h3_core.errors import H3InputError
from . import _host
from .checks import verdict
from .io_types import H3Model, H3VideoVAE
from .ranks import RANKS_KEY, RanksChoice, rank_devices

MAX_GPUS = 8


def check_ranks(gpus, softmax_ranks) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 2 <= gpus <= MAX_GPUS:
        raise H3InputError(f"gpus: got {gpus!r}; allowed: 2 to {MAX_GPUS}")
    if isinstance(softmax_ranks, bool) or not isinstance(softmax_ranks, int) or not 0 <= softmax_ranks < gpus:
        raise H3InputError(
            f"softmax_ranks: got {softmax_ranks!r} with {gpus} GPUs; allowed: 0 (every GPU runs both parts of its "
            f"heads) or 1 to {gpus - 1} (those GPUs run the window softmax, the others VDN-H3's linear branch)"
        )


class H3MultiGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3MultiGPU",
            display_name="H3 Multi-GPU (experimental)",
            category=_host.CATEGORY,
            description="Experimental: no run on several GPUs has been recorded yet (its tests run the ranks on the "
            "CPU). Samples with the DiT across several GPUs: the sampler starts one worker process per extra "
            "GPU (each loads its own copy of the DiT), and every model evaluation splits the sequence's rows "
            "among them (Ulysses). The result is the one-GPU result. A cancel or an error closes the workers, "
            "as does unloading the model; the next run starts them again. Without CUDA the ranks run on the CPU.",
            inputs=[
                H3Model.Input("model"),
                io.Int.Input("gpus", default=2, min=2, max=MAX_GPUS, tooltip="GPUs to sample on, this one first"),
                io.Int.Input(
                    "softmax_ranks",
                    default=0,
                    min=0,
                    max=MAX_GPUS - 1,
                    tooltip="VDN-H3 only: 0 gives every GPU the window softmax and the linear branch of its share of "
                    "the heads; n gives the first n GPUs the softmax of all heads and the others the linear branch "
                    "(6 of 8 as published)",
                ),
                H3VideoVAE.Input(
                    "video_vae",
                    optional=True,
                    tooltip="decode across the same GPUs too: connect the video VAE here and the decoder to the "
                    "video_vae output (each window's tiles are shared among them)",
                ),
            ],
            outputs=[H3Model.Output(display_name="model"), H3VideoVAE.Output(display_name="video_vae")],
        )

    @classmethod
    def validate_inputs(cls, gpus=None, softmax_ranks=None):
        return verdict(lambda: gpus is None or softmax_ranks is None or check_ranks(gpus, softmax_ranks))

    @classmethod
    def execute(cls, model, gpus, softmax_ranks, video_vae=None):
        check_ranks(gpus, softmax_ranks)
        heads = model.model.cfg.heads
        if gpus > heads or max(softmax_ranks, gpus - softmax_ranks) > heads:
            raise H3InputError(
                f"gpus: got {gpus} (softmax_ranks {softmax_ranks}) for a DiT of {heads} attention heads; each GPU "
                f"needs at least one head of its part; allowed: up to {heads} GPUs in each part"
            )
        if softmax_ranks and not model.model.cfg.hybrid:
            raise H3InputError(
                f"softmax_ranks: got {softmax_ranks}, but this DiT is MiniMax H3 with dense attention (no linear "
                "branch to split off); set it to 0 or load a linear branch"
            )
        devices = rank_devices(gpus, model.load_device)
        choice = RanksChoice(gpus, softmax_ranks)
        ranked = model.clone()
        ranked.attachments[RANKS_KEY] = choice
        decoder = None
        if video_vae is not None:
            decoder = video_vae.clone()
            decoder.attachments[RANKS_KEY] = choice
        _host.say(
            f"the DiT samples on {gpus} ranks: {', '.join(devices)}"
            + ("; the video decodes across them" if decoder is not None else "")
        )
        return io.NodeOutput(ranked, decoder)
