"""``pipeline.release_clip``: the released clip's packed sequence (VDN-H3's release geometry, T = 104,266 rows) and
one evaluation's activations on it, the figure the sampler's own ``working_bytes`` gives for that clip."""

import torch

from h3_core.memory.policy import working_bytes
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.release_clip import release_activations, release_clip


def test_the_released_clip_has_the_release_rows():
    packed = release_clip()
    assert packed.positions.shape[0] == 104_266
    assert packed.layout.num_frames == 102 and packed.layout.tokens_per_frame == 48 * 84 // 4


def test_its_activations_are_what_the_sampler_plans_for_that_clip():
    for hybrid in (True, False):
        cfg = DiTConfig(hybrid=hybrid)
        with torch.device("meta"):
            model = H3DiT(cfg).to(torch.bfloat16)
        expected = working_bytes(model, release_clip(), fused="compiled")
        assert release_activations(cfg, torch.bfloat16, "dtype") == expected
        assert 2**30 < expected < 64 * 2**30
    assert release_activations(DiTConfig(hybrid=True), torch.bfloat16, "dtype") != release_activations(
        DiTConfig(hybrid=False), torch.bfloat16, "dtype"
    )
