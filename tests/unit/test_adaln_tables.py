"""AdaLN tables computed ahead with the projections in host memory (h3_core.models.adaln_tables)."""

import pytest
import torch

from h3_core.errors import H3InputError
from h3_core.models.adaln_tables import clear_adaln_tables, keep_adaln_on_host, prepare_adaln_tables
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.generate import generate
from h3_core.pipeline.prompt import from_conditioning
from h3_core.pipeline.request import ClipRequest

CFG = DiTConfig(
    hidden=48,
    layers=2,
    heads=2,
    head_dim=32,
    ffn=64,
    text_dim=5120,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=4,
)


def model(hybrid=False):
    torch.manual_seed(0)
    m = H3DiT(DiTConfig(**{**CFG.__dict__, "hybrid": hybrid})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_run_with_the_projections_on_the_host_is_the_plain_run(hybrid):
    prompt = from_conditioning(torch.randn(1, 6, 5120, generator=torch.Generator().manual_seed(3)))
    run = dict(frames=22, width=64, height=32, steps=3, seed=5)
    plain = model(hybrid)
    with torch.no_grad():
        want = generate(plain, prompt, ClipRequest(**run))
    hosted = model(hybrid)
    assert keep_adaln_on_host(hosted) == 0 and hosted.adaln_on_host  # already in host memory on the CPU
    with torch.no_grad():
        got = generate(hosted, prompt, ClipRequest(**run))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert hosted.adaln_tables == {}  # dropped after the run


def test_unprepared_timesteps_are_refused_and_prepared_ones_are_used():
    m = model()
    keep_adaln_on_host(m)
    timesteps = torch.tensor([0.25, 0.5])
    from h3_core.models.adaln_tables import adaln_tables_for

    with pytest.raises(H3InputError, match=r"no tables were prepared for timesteps \[0.25, 0.5\]"):
        adaln_tables_for(m, timesteps)
    nbytes = prepare_adaln_tables(m, [timesteps, timesteps.clone()], "cpu")
    assert nbytes == 2 * 2 * 6 * 3 * 48 * 4  # blocks × K × parts × modalities × hidden × fp32
    tables = adaln_tables_for(m, timesteps)
    with torch.no_grad():
        want = m.blocks[1].adaln_proj.table(m.time_embedder(timesteps))
    assert torch.equal(tables[1].table, want)
    clear_adaln_tables(m)
    with pytest.raises(H3InputError):
        adaln_tables_for(m, timesteps)


def test_a_model_left_alone_computes_its_tables_in_the_blocks():
    from h3_core.models.adaln_tables import adaln_tables_for

    assert adaln_tables_for(model(), torch.tensor([0.5])) is None
