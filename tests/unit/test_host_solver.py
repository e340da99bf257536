"""The host's samplers drive the pack's evaluations (``nodes.host_sampling.host_solver``) as ComfyUI 0.38's
``KSAMPLER.sample`` calls them: its first step's log line reads the guider's ``model_patcher.model`` and ``cfg``
(comfy/samplers.py at Comfy-Org/ComfyUI 311c0140), which the pack's stand-in for the guider has."""

import torch
from test_host_patches import pack  # noqa: F401  (the pack imported as the host imports it)


def test_a_sampler_that_names_the_model_and_cfg_on_its_first_step_runs(pack):  # noqa: F811
    import comfy.samplers
    from h3_hybrid.nodes.host_sampling import host_solver

    class Sampler038(comfy.samplers.KSAMPLER):
        """0.3.75's KSAMPLER with what 0.38's adds on the first step: the model's class and the cfg, read."""

        def sample(self, model_wrap, sigmas, extra_args, callback, noise, **kwargs):
            named = []

            def first_step(i, denoised, x, total):
                if not named:
                    named.append((model_wrap.model_patcher.model.__class__.__name__, model_wrap.cfg))
                callback(i, denoised, x, total)

            out = super().sample(model_wrap, sigmas, extra_args, first_step, noise, **kwargs)
            assert named and named[0][1] == 1.0
            return out

    sampler = Sampler038(comfy.samplers.ksampler("euler").sampler_function)
    solve = host_solver(sampler, 12.0, 3.0, seed=5)
    target = torch.full((1, 8), 0.25)
    steps = []
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    out = solve(lambda x, sigma: target.expand_as(x), x, torch.tensor([1.0, 0.5, 0.0]), lambda *a: steps.append(a[0]))
    assert steps == [1, 2] and torch.allclose(out, target)  # euler on a constant clean estimate lands on it
