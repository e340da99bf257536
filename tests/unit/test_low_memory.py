"""The exact lower-memory paths (h3_core.models.low_memory) equal the plain path, dense and hybrid."""

import pytest
import torch
from qkv_through_layer import qkv_from_weight_rows, qkv_through_layer
from runs_given import by_module, runs_given
from tiny_dit import fp32_case, model, request

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.models.hybrid import HybridContext
from h3_core.models.low_memory import LowMemory, head_slices
from h3_core.models.options import RunOptions
from h3_core.models.run_options import check_run_options


def test_head_slices_cover_every_head_once():
    for heads in range(1, 9):
        for groups in range(1, heads + 1):
            slices = head_slices(heads, groups)
            assert len(slices) == groups
            assert [h for s in slices for h in range(s.start, s.stop)] == list(range(heads))


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize(
    "options",
    [
        LowMemory(ffn_chunk_rows=7),
        LowMemory(head_groups=2),
        LowMemory(head_groups=3),
        LowMemory(ffn_chunk_rows=50, head_groups=2),
        LowMemory(branch_frames=3),
        LowMemory(ffn_chunk_rows=7, head_groups=2, branch_frames=4),
    ],
)
def test_low_memory_paths_equal_the_plain_forward(hybrid, options):
    m = model(hybrid)
    packed, args = request()
    # A narrow window, so the hybrid model's linear branch runs on the inner frames.
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4)) if hybrid else None
    with torch.no_grad():
        plain = m(*args, hybrid=ctx)
        low = m(*args, hybrid=ctx, run=RunOptions().with_low_memory(options))
        again = m(*args, hybrid=ctx, run=RunOptions().with_low_memory(LowMemory()))
    for a, b in zip(low, plain):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    for a, b in zip(again, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hybrid", [False, True])
def test_low_memory_runs_on_fp8_linears(hybrid):
    m, args, ctx = fp32_case(hybrid)
    with torch.no_grad():
        plain = m(*args, hybrid=ctx)
        low = m(*args, hybrid=ctx, run=RunOptions().with_low_memory(LowMemory(ffn_chunk_rows=7, head_groups=2)))
    # Rows of q/k/v and FFN chunks quantise as before; each head group's share of out_proj quantises its own
    # activations per row, so the two agree to fp8's precision, not exactly.
    for a, b in zip(low, plain):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.995


@pytest.mark.parametrize("hybrid", [False, True])
def test_head_groups_share_one_quantisation_of_the_projection_input(hybrid, monkeypatch):
    from h3_core.models.dit import Attention
    from h3_core.models.fp8_linear import QuantizedRows

    m, args, ctx = fp32_case(hybrid)
    run = RunOptions().with_low_memory(LowMemory(head_groups=3))
    made = []
    shared = Attention.projection_input
    monkeypatch.setattr(Attention, "projection_input", lambda self, x: made.append(shared(self, x)) or made[-1])
    with torch.no_grad():
        once = m(*args, hybrid=ctx, run=run)
        assert made and all(isinstance(q, QuantizedRows) for q in made)
        monkeypatch.setattr(Attention, "projection_input", lambda self, x: x)  # each slice quantises x itself
        each = m(*args, hybrid=ctx, run=run)
    for a, b in zip(once, each):
        assert torch.equal(a, b)


def test_every_block_takes_the_options():
    from h3_core.models.dit import Attention, SwiGLU
    from h3_core.models.linear_branch import LinearBranch

    m = model(True)
    packed, args = request()
    ctx = HybridContext(packed.layout, WindowSpec(1, 3, "both"), "ref", (0, 4))
    run = RunOptions().with_low_memory(LowMemory(ffn_chunk_rows=128, head_groups=3, branch_frames=5))
    with (
        torch.no_grad(),
        runs_given([mod for mod in m.modules() if isinstance(mod, (Attention, SwiGLU, LinearBranch))]) as seen,
    ):
        m(*args, hybrid=ctx, run=run)
    attentions, ffns, branches = (
        {mod: runs for mod, runs in by_module(seen).items() if isinstance(mod, kind)}
        for kind in (Attention, SwiGLU, LinearBranch)
    )
    # every block's and every refiner block's attention and FFN, and every block's linear branch (once a head
    # group), ran with them
    blocks = len(m.blocks) + len(m.token_refiner.blocks)
    assert len(attentions) == len(ffns) == blocks and len(branches) == len(m.blocks)
    assert all(len(runs) == 1 for runs in [*attentions.values(), *ffns.values()])
    assert all(len(runs) == 3 for runs in branches.values())
    assert all(r.ffn_chunk_rows == 128 and r.head_groups == 3 for runs in attentions.values() for r in runs)
    assert all(r.ffn_chunk_rows == 128 and r.head_groups == 3 for runs in ffns.values() for r in runs)
    assert all(r.branch_frames == 5 for runs in branches.values() for r in runs)


def test_bad_options():
    m = model(False)
    with pytest.raises(H3InputError, match=r"head_groups must be between 1 and the model's 3 heads, got 4"):
        check_run_options(RunOptions().with_low_memory(LowMemory(head_groups=4)), m)
    with pytest.raises(H3InputError, match=r"head_groups must be between 1 and the model's 3 heads, got 0"):
        check_run_options(RunOptions().with_low_memory(LowMemory(head_groups=0)), m)
    with pytest.raises(H3InputError, match=r"ffn_chunk_rows must be a positive number of rows or None, got 0"):
        check_run_options(RunOptions().with_low_memory(LowMemory(ffn_chunk_rows=0)), m)
    with pytest.raises(H3InputError, match=r"branch_frames must be a positive number of frames or None, got -1"):
        check_run_options(RunOptions().with_low_memory(LowMemory(branch_frames=-1)), m)


def test_modulation_by_runs_is_the_gathered_form_bit_for_bit():
    """The block applies AdaLN rows run by run in place; in bf16 that is exactly the [T, hidden]-gather form."""
    import torch.nn.functional as F

    from h3_core.models.dit import rope_cos_sin, row_runs

    m = model(False).to(torch.bfloat16)
    packed, args = request()
    block = m.blocks[0]
    g = torch.Generator().manual_seed(2)
    T = packed.positions.shape[0]
    x = torch.randn(T, 24, generator=g).to(torch.bfloat16)
    temb = torch.randn(2, 10, generator=g)
    rows = (torch.arange(T) % 2 == 0).long() * 3 + packed.tags  # alternating timesteps: many short runs
    rope = rope_cos_sin(packed.positions, m.rope.inv_freq.float())
    with torch.no_grad():
        got = block(x, temb, rows, rope)
        shift1, scale1, gate1, shift2, scale2, gate2 = (
            t.to(x.dtype).index_select(0, rows) for t in block.adaln_proj(temb)
        )
        h = block.attn(block.norm1(x) * (1 + scale1) + shift1, rope)
        y = x + gate1 * h
        gate, up = block.mlp.fc1(block.norm2(y) * (1 + scale2) + shift2).chunk(2, dim=-1)
        want = y + gate2 * block.mlp.fc2(F.silu(gate) * up)
    assert len(row_runs(rows)) > 10
    assert torch.equal(got, want)


def test_final_layer_in_row_chunks_is_the_whole_rows_result():
    m = model(True)
    packed, args = request()
    with torch.no_grad():
        whole = m(*args)
        chunked = m(*args, run=RunOptions(final_chunk_rows=5))
    for a, b in zip(chunked, whole):  # the heads' GEMMs may sum in another order for fewer rows
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_q_k_v_come_dense_and_equal_the_stacked_projection(hybrid, fp8):
    """q, k and v as three row slices of qkv_proj (dense tensors) give what one call of the layer gives, its
    output viewed as q, k and v, with fp8 linears too (the rows quantised once for all three)."""
    m, args, ctx = fp32_case(hybrid, fp8)
    attn = m.blocks[0].attn
    x = torch.randn(9, attn.qkv_proj.in_features, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dense = attn.project(x, source=attn.projection_input(x))
        stacked = attn.qkv_proj(x).view(9, 3, attn.heads, attn.head_dim).unbind(1)
    assert all(t.is_contiguous() for t in dense) and not stacked[1].is_contiguous()
    for a, b in zip(dense, stacked):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    with torch.no_grad():
        stacked_out = qkv_through_layer(m)(*args, hybrid=ctx)
        dense_out = qkv_from_weight_rows(m)(*args, hybrid=ctx)
    for a, b in zip(dense_out, stacked_out):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
