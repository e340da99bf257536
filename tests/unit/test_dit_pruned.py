"""The pruned ("curve") DiT: a table of time embeddings replaces the time MLP (h3_core.models.dit)."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import load_h3_model
from h3_core.models.adaln_tables import curve_embedding
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.packing import pack_sequence

CFG = DiTConfig(
    hidden=24,
    layers=2,
    heads=2,
    head_dim=16,
    ffn=32,
    text_dim=20,
    freq_dim=8,
    time_hidden=12,
    time_embed=10,
    rope_freqs=2,
)
GRID = 17


def full_model():
    torch.manual_seed(0)
    m = H3DiT(CFG).to(torch.float64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.rope.inv_freq.copy_(1 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)))
    return m


def prune(full):
    """The curve form of ``full`` at full rank: table = g(t_grid)·V and every AdaLN weight W·V for a random
    orthogonal V, so W_reduced · c(t) = W · silu(e(t)) exactly at grid timesteps."""
    cfg = replace(CFG, adaln_curve_grid=GRID)
    V = torch.linalg.qr(torch.randn(CFG.time_embed, CFG.time_embed, dtype=torch.float64))[0]
    state = {k: v for k, v in full.state_dict().items() if not k.startswith("time_embedder.")}
    with torch.no_grad():
        curve = torch.nn.functional.silu(full.time_embedder(torch.linspace(0, 1, GRID, dtype=torch.float64)))
    state["adaln_t_table"] = curve @ V
    for key in [k for k in state if k.endswith("adaln_proj.linear.weight")]:
        state[key] = state[key] @ V
    return cfg, state


def run(model, t):
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 3, 2, 4, 3)
    g = torch.Generator().manual_seed(1)
    T = packed.positions.shape[0]
    index = torch.zeros(T, dtype=torch.long)
    index[packed.audio_index] = 1
    with torch.no_grad():
        return model(
            torch.randn(packed.video_index.numel(), 96, generator=g, dtype=torch.float64),
            torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=torch.float64),
            torch.randn(4, 20, generator=g, dtype=torch.float64),
            torch.tensor(t, dtype=torch.float64),
            index,
            packed.tags,
            packed.positions,
            packed.video_index,
            packed.audio_index,
            packed.text_index,
        )


def test_curve_embedding_interpolates_rows_and_clamps():
    table = torch.arange(10.0).view(5, 2)  # rows at t = 0, .25, .5, .75, 1
    got = curve_embedding(table, torch.tensor([0.0, 0.125, 0.75, 1.0, 1.5, -0.2]))
    want = torch.tensor([[0, 1], [1, 2], [6, 7], [8, 9], [8, 9], [0, 1]], dtype=torch.float32)
    assert torch.equal(got, want)


def test_pruned_model_equals_the_full_one_on_grid_timesteps():
    full = full_model()
    cfg, state = prune(full)
    pruned = H3DiT(cfg).to(torch.float64).eval()
    pruned.load_state_dict(state)
    t = [0.25, 0.8125]  # 4/16 and 13/16: grid points
    for a, b in zip(run(pruned, t), run(full, t)):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_a_pruned_file_is_recognised_and_loaded(tmp_path, prefix):
    full = full_model()
    cfg, state = prune(full)
    path = tmp_path / "pruned.safetensors"
    save_file({prefix + k: v.float().contiguous() for k, v in state.items()}, path)
    model = load_h3_model(path, cfg=CFG, dtype=torch.bfloat16)
    assert model.cfg.adaln_curve_grid == GRID and "pruned" in model.layout
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    for key, value in loaded.items():
        curve_or_island = (
            key == "adaln_t_table"
            or "adaln_proj.linear" in key
            or key.startswith(("video_patch", "audio_patch", "final_layer.video_out", "final_layer.audio_out", "rope"))
        )
        assert value.dtype == (torch.float32 if curve_or_island else torch.bfloat16), key
        assert torch.equal(value.float(), state[key].float().to(value.dtype).float()), key


def test_a_pruned_model_runs_in_bf16_close_to_the_full_one(tmp_path):
    full = full_model()
    cfg, state = prune(full)
    path = tmp_path / "pruned.safetensors"
    save_file({k: v.float().contiguous() for k, v in state.items()}, path)
    model = load_h3_model(path, cfg=CFG, dtype=torch.bfloat16)
    video, audio = run(model, [0.5, 0.25])  # grid timesteps (17-point grid)
    want_video, want_audio = run(full, [0.5, 0.25])
    assert video.dtype == torch.float32 and torch.isfinite(video).all()
    for got, want in ((video, want_video), (audio, want_audio)):
        assert (got.double() - want).norm() <= 0.05 * want.norm()


def test_a_malformed_table_is_refused(tmp_path):
    full = full_model()
    _, state = prune(full)
    state["adaln_t_table"] = torch.zeros(1, CFG.time_embed, dtype=torch.float64)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.float().contiguous() for k, v in state.items()}, path)
    with pytest.raises(
        H3InputError, match=r"bad\.safetensors: adaln_t_table must be \[grid >= 2, width\], got \[1, 10\]"
    ):
        load_h3_model(path, cfg=CFG)
