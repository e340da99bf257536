"""The fused block path (h3_core.models.block_fused) equals the plain block, function by function and through
the whole model, dense and hybrid."""

import pytest
import torch
import torch.nn.functional as F
from fused_eager import fused_written, written
from runs_given import runs_given
from tiny_dit import CFG, fp32_case, model, request

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.models import block_fused
from h3_core.models.block_ops import gated_add_, modulate_, rotate_half
from h3_core.models.dit import row_runs
from h3_core.models.hybrid import HybridContext
from h3_core.models.low_memory import LowMemory
from h3_core.models.run_options import RunOptions, check_run_options


def rnd(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


ROWS = torch.tensor([0, 0, 0, 2, 2, 1, 1, 1, 1, 5, 5])
RUNS = row_runs(ROWS)


def test_row_index_undoes_the_runs():
    assert torch.equal(block_fused.row_index(RUNS, "cpu"), ROWS)


def test_norm_modulate_equals_norm_then_modulate():
    x, weight, shift, scale = rnd(11, 8), rnd(8, seed=1), rnd(6, 8, seed=2), rnd(6, 8, seed=3)
    plain = modulate_(F.rms_norm(x, (8,), weight, 1e-6), shift, scale, RUNS)
    fused = block_fused.norm_modulate(x, weight, shift, scale, ROWS, 1e-6)
    assert (fused - plain).abs().max() <= 1e-12


@pytest.mark.parametrize("rope", [True, False])
def test_qk_norm_rope_equals_norm_then_rotate(rope):
    x, weight = rnd(11, 3, 16, seed=4), rnd(16, seed=5)
    angles = rnd(11, 6, seed=6)
    cos, sin = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()) if rope else (None, None)
    plain = F.rms_norm(x, (16,), weight, 1e-6)
    if rope:
        plain = rotate_half(plain, cos, sin)
    assert (block_fused.qk_norm_rope(x, weight, cos, sin, 1e-6) - plain).abs().max() <= 1e-12


def test_gated_residual_writes_into_the_update():
    x, y, gate = rnd(11, 8, seed=7), rnd(11, 8, seed=8), rnd(6, 8, seed=9)
    plain = gated_add_(y.clone(), gate, x, RUNS)
    out = block_fused.gated_residual_(x, y, gate, ROWS)
    assert out.data_ptr() == y.data_ptr() and (out - plain).abs().max() <= 1e-12


def test_gate_heads_scales_each_head_in_place():
    x, gate = rnd(11, 3, 4, seed=12), rnd(11, 5, seed=13)[:, 1:4]
    want = x * gate[..., None]
    out = block_fused.gate_heads_(x, gate)
    assert out.data_ptr() == x.data_ptr() and (out - want).abs().max() <= 1e-12


def test_swiglu_writes_into_the_gate_half():
    gate_up = rnd(11, 2 * 6, seed=10)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    out = block_fused.swiglu_(gate_up)
    assert out.shape == (11, 6) and out.data_ptr() == gate_up.data_ptr() and out.stride() == (12, 1)
    assert (out - F.silu(gate) * up).abs().max() <= 1e-12


def test_the_compiled_functions_equal_the_written_ones():
    x, weight = rnd(11, 8, dtype=torch.float32), rnd(8, seed=1, dtype=torch.float32)
    shift, scale = rnd(6, 8, seed=2, dtype=torch.float32), rnd(6, 8, seed=3, dtype=torch.float32)
    q, qw, angles = (
        rnd(11, 3, 16, seed=4, dtype=torch.float32),
        rnd(16, seed=5, dtype=torch.float32),
        rnd(11, 12, seed=6),
    )
    y = rnd(11, 8, seed=8, dtype=torch.float32)
    cases = (
        ("norm_modulate", (x, weight, shift, scale, ROWS, 1e-6)),
        ("qk_norm_rope", (q, qw, angles.float().cos(), angles.float().sin(), 1e-6)),
    )
    for name, args in cases:
        compiled, as_written = block_fused.run("compiled", name, *args), written(block_fused.run, name, *args)
        assert (compiled - as_written).abs().max() <= 1e-5 * as_written.abs().max(), name
    heads, gate = rnd(11, 3, 4, seed=14, dtype=torch.float32), rnd(11, 5, seed=15, dtype=torch.float32)[:, 1:4]
    expected = written(block_fused.run, "gate_heads_", heads.clone(), gate)
    assert (block_fused.run("compiled", "gate_heads_", heads.clone(), gate) - expected).abs().max() <= 1e-6
    gate_up = rnd(11, 16, seed=11, dtype=torch.float32)
    expected = written(block_fused.run, "swiglu_", gate_up.clone())
    assert (
        block_fused.run("compiled", "swiglu_", gate_up.clone()) - expected
    ).abs().max() <= 1e-5 * expected.abs().max()
    expected = written(block_fused.run, "gated_residual_", x, y.clone(), shift, ROWS)
    assert (block_fused.run("compiled", "gated_residual_", x, y.clone(), shift, ROWS) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("options", [LowMemory(), LowMemory(ffn_chunk_rows=7, head_groups=3)])
def test_a_fused_model_equals_the_plain_model(hybrid, options):
    m = model(hybrid)
    packed, args = request()
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4)) if hybrid else None
    run = RunOptions().with_low_memory(options)
    blocks = list(m.blocks)
    with torch.no_grad():
        plain = m(*args, hybrid=ctx, run=run)
        with (
            fused_written(run) as fused_run,
            runs_given(blocks) as block_runs,
            runs_given([b.mlp for b in blocks]) as mlp_runs,
            runs_given([b.attn.linear_attention for b in blocks if hybrid]) as branch_runs,
        ):
            fused = m(*args, hybrid=ctx, run=fused_run)
        # every block and its FFN ran fused (and, hybrid, every linear branch), with the low-memory choices kept
        assert [b for b, _ in block_runs] == blocks and [f for f, _ in mlp_runs] == [b.mlp for b in blocks]
        assert all(r.blocks_fused == "compiled" and r.low_memory == options for _, r in block_runs + mlp_runs)
        if hybrid:
            assert {b for b, _ in branch_runs} == {b.attn.linear_attention for b in blocks}
            assert all(r.branches_fused == "compiled" and r.low_memory == options for _, r in branch_runs)
        with runs_given(blocks) as block_runs:
            again = m(*args, hybrid=ctx, run=run)
        assert len(block_runs) == CFG.layers and all(r.blocks_fused is None for _, r in block_runs)
    for a, b in zip(fused, plain):
        assert (a - b).abs().max() <= 1e-11 * b.abs().max()
    for a, b in zip(again, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_fused_fp8_model_equals_the_plain_fp8_model(hybrid):
    """With fp8 linears the fused FFN hands fc2 its input already quantised (``swiglu_quantized``)."""
    from h3_core.models.fp8_linear import QuantizedRows

    m, args, ctx = fp32_case(hybrid)
    fc2_inputs = []
    m.blocks[0].mlp.fc2.register_forward_pre_hook(lambda _, inputs: fc2_inputs.append(inputs[0]))
    with torch.no_grad():
        plain = m(*args, hybrid=ctx)
        with fused_written() as fused_run:
            fused = m(*args, hybrid=ctx, run=fused_run)
    assert isinstance(fc2_inputs[-1], QuantizedRows) and not isinstance(fc2_inputs[0], QuantizedRows)
    for a, b in zip(fused, plain):  # fp32 sums rounded once: a code may flip where a product sits on a boundary
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.9999


def test_a_bad_mode_is_named():
    with pytest.raises(H3InputError, match=r"blocks_fused: got 'on'; allowed: \(None, 'compiled'\)"):
        check_run_options(RunOptions().fused("on"), model(False))
