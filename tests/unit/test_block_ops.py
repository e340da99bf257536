"""The per-element forms given with the call (h3_core.models.block_ops, branch_ops): the plain ops are the
reference, the fused ops (as written, on the plain path) give the same numbers method by method, the options pick
them, and the model files never ask which form they run in."""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from fused_eager import MODE
from tiny_dit import CFG

from h3_core.errors import H3InputError
from h3_core.models.block_ops import PLAIN_OPS, BlockOps, FusedBlockOps, block_ops_for
from h3_core.models.branch_ops import BranchOps, FusedBranchOps, branch_ops_for
from h3_core.models.dit import row_runs
from h3_core.models.fp8_linear import Fp8Linear
from h3_core.models.linear_branch import LinearBranch
from h3_core.models.options import PLAIN, RunOptions
from h3_core.triton_forms import plain_path

ROOT = Path(__file__).resolve().parents[2]
ROWS = torch.tensor([0, 0, 0, 2, 2, 1, 1, 1, 1, 5, 5])


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def norm(width, seed):
    module = nn.RMSNorm(width, eps=1e-6, dtype=torch.float64)
    module.weight.data = rnd(width, seed=seed)
    return module


def test_the_options_pick_the_ops_of_their_mode():
    assert PLAIN.block_ops is PLAIN_OPS and type(PLAIN.branch_ops) is BranchOps
    fused = RunOptions(blocks_fused="compiled", branches_fused="compiled")
    assert isinstance(fused.block_ops, FusedBlockOps) and fused.block_ops.mode == "compiled"
    assert isinstance(fused.branch_ops, FusedBranchOps) and fused.branch_ops.mode == "compiled"
    assert block_ops_for("compiled") is block_ops_for("compiled")  # one object per mode
    assert branch_ops_for(None).mode is None
    with pytest.raises(H3InputError, match=r"blocks_fused: got 'fast'; allowed: \(None, 'compiled'\)"):
        RunOptions(blocks_fused="fast").block_ops
    with pytest.raises(H3InputError, match="branches_fused: got 'fast'"):
        RunOptions(branches_fused="fast").branch_ops


def test_fused_block_ops_equal_the_plain_ones_method_by_method():
    plain, fused = BlockOps(), FusedBlockOps(MODE)
    runs = row_runs(ROWS)
    x, y = rnd(11, 8, seed=1), rnd(11, 8, seed=2)
    shift, scale, gate = rnd(6, 8, seed=3), rnd(6, 8, seed=4), rnd(6, 8, seed=5)
    n1 = norm(8, 6)
    angles = rnd(11, 12, seed=7)
    rope = (angles.cos(), angles.sin())
    heads, head_gate = rnd(11, 3, 16, seed=8), rnd(11, 3, seed=9)
    gate_up = rnd(11, 16, seed=10)
    with plain_path():
        p_rows, f_rows = plain.table_rows(runs, "cpu"), fused.table_rows(runs, "cpu")
        assert p_rows == runs and torch.equal(f_rows, ROWS)
        pairs = [
            (plain.norm_modulate(x, n1, shift, scale, p_rows), fused.norm_modulate(x, n1, shift, scale, f_rows)),
            (plain.gated_residual_(x, y.clone(), gate, p_rows), fused.gated_residual_(x, y.clone(), gate, f_rows)),
            (plain.qk_norm_rope(heads, norm(16, 11), rope), fused.qk_norm_rope(heads, norm(16, 11), rope)),
            (plain.qk_norm_rope(heads, norm(16, 11), None), fused.qk_norm_rope(heads, norm(16, 11), None)),
            (plain.swiglu(gate_up.clone(), False), fused.swiglu(gate_up.clone(), False)),
            (
                plain.gate_heads_input(heads.clone(), head_gate, False),
                fused.gate_heads_input(heads.clone(), head_gate, False),
            ),
        ]
        px, ph = plain.residual_norm(x, y.clone(), gate, p_rows, n1, shift, scale, False)
        fx, fh = fused.residual_norm(x, y.clone(), gate, f_rows, n1, shift, scale, False)
        pairs += [(px, fx), (ph, fh)]
    for i, (want, got) in enumerate(pairs):
        assert got.shape == want.shape, i
        assert (got - want).abs().max() <= 1e-12 * want.abs().max(), i


def test_only_the_fused_ops_gate_an_fp8_out_projs_input_while_quantising():
    fp8, plain_linear = Fp8Linear(16, 16), nn.Linear(16, 16)
    assert not BlockOps().gates_while_quantizing(fp8, "cpu")
    assert FusedBlockOps(MODE).gates_while_quantizing(fp8, "cpu")
    assert not FusedBlockOps(MODE).gates_while_quantizing(plain_linear, "cpu")


def test_fused_branch_ops_equal_the_plain_ones():
    heads, d, frames, grid = CFG.heads, CFG.head_dim, 3, (2, 2)
    S = grid[0] * grid[1]
    branch = LinearBranch(CFG.hidden, heads, d).double()
    for p in branch.parameters():
        p.data = rnd(*p.shape, seed=p.numel()) * 0.3
    conv = branch.short_conv
    weights = (conv.k_sp.weight, conv.k_tm.weight, conv.v_sp.weight, conv.v_tm.weight)
    shape = (frames, S, heads, d)
    q_raw, k_raw, v_raw = (rnd(frames * S, heads, d, seed=20 + i) for i in range(3))
    beta = torch.sigmoid(rnd(frames, S, heads, seed=30))
    with plain_path():
        p_shifted, p_B = BranchOps().statistics(k_raw, v_raw, shape, grid, weights, beta, None)
        f_shifted, f_B = FusedBranchOps(MODE).statistics(k_raw, v_raw, shape, grid, weights, beta, None)
        for want, got in ((p_shifted, f_shifted), (p_B, f_B)):
            assert (got - want).abs().max() <= 1e-12 * want.abs().max()
        state = rnd(frames, heads, d, d, seed=40)
        logits = rnd(frames * S, heads * d, seed=41)
        want = BranchOps().readout(q_raw, state, branch.norm.weight, lambda: logits, shape, q_raw.dtype)
        got = FusedBranchOps(MODE).readout(q_raw, state, branch.norm.weight, lambda: logits, shape, q_raw.dtype)
    assert got.shape == want.shape == (frames * S, heads * d)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_the_model_files_never_ask_which_form_they_run_in():
    """The blocks, the attention, the FFN, the hybrid attention and the linear branch reach the fused forms only
    through the ops given with the call, and the attention reaches the hybrid and sequence-parallel forms through the
    context given with it: none reads the fused modes, and no block, attention or FFN asks a context's kind."""
    for name in ("dit.py", "hybrid.py", "linear_branch.py"):
        tree = ast.parse((ROOT / "h3_core" / "models" / name).read_text())
        read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert not read & {"blocks_fused", "branches_fused"}, name
    tree = ast.parse((ROOT / "h3_core" / "models" / "dit.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for name in ("Attention", "HybridAttention", "SwiGLU", "Block"):
        asked = {
            ast.unparse(node.args[1])
            for node in ast.walk(classes[name])
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
        }
        assert not asked & {"SequenceShards", "HybridContext"}, name


def test_the_ffn_and_the_evaluation_take_their_row_forms_from_outside():
    """The FFN's row chunks are the run's ``ffn_rows`` and a rank's rows of the sequence its context's (``local_rows``,
    ``velocities``): neither ``SwiGLU.forward`` nor ``H3DiT.forward`` asks which form it runs in."""
    tree = ast.parse((ROOT / "h3_core" / "models" / "dit.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for owner in ("SwiGLU", "H3DiT"):
        (forward,) = (node for node in classes[owner].body if getattr(node, "name", None) == "forward")
        body = forward.body[1:] if ast.get_docstring(forward) else forward.body  # the code, not its description
        read = {
            node.id if isinstance(node, ast.Name) else node.attr
            for statement in body
            for node in ast.walk(statement)
            if isinstance(node, (ast.Name, ast.Attribute))
        }
        assert not read & {"isinstance", "ffn_chunk_rows", "SequenceShards", "HybridContext"}, owner


def test_the_ffn_in_row_chunks_is_the_whole_rows_result():
    """Chunk by chunk the FFN gives exactly its rows' function of each chunk; against all rows at once only the
    GEMMs' order of summation may differ (a CPU BLAS sums fewer rows another way)."""
    from h3_core.models.dit import SwiGLU
    from h3_core.models.low_memory import WHOLE_ROWS, RowChunks

    torch.manual_seed(3)
    mlp = SwiGLU(CFG).double()
    x = rnd(11, CFG.hidden, seed=4)
    assert PLAIN.ffn_rows is WHOLE_ROWS and RunOptions(ffn_chunk_rows=4).ffn_rows == RowChunks(4)
    with torch.no_grad():
        whole = mlp(x)
        assert torch.equal(whole, mlp._rows(x, PLAIN_OPS))
        for rows in (1, 3, 4, 11, 50):
            chunked = mlp(x, RunOptions(ffn_chunk_rows=rows))
            each = torch.cat([mlp._rows(part, PLAIN_OPS) for part in x.split(rows)])
            assert torch.equal(chunked, each), rows
            assert (chunked - whole).abs().max() <= 1e-12 * whole.abs().max(), rows
    seen = []
    RowChunks(4).apply(lambda part: seen.append(part.shape[0]) or part, x, CFG.hidden)
    assert seen == [4, 4, 3]


def test_one_process_runs_every_row_and_shards_must_cover_the_sequence():
    from h3_core.models.hybrid import HybridContext
    from h3_core.models.whole_sequence import WHOLE_SEQUENCE
    from h3_core.parallel import SequenceShards

    kinds = (torch.tensor([0, 1]), torch.tensor([2, 3, 4]), torch.tensor([5]))
    mine, picks = WHOLE_SEQUENCE.local_rows(6, kinds)
    assert mine == slice(0, 6) and all(places is index for (places, _), index in zip(picks, kinds))
    assert all(torch.equal(index[which], index) for (_, which), index in zip(picks, kinds))
    heads = lambda t, video, audio: (t, video, audio)  # noqa: E731
    assert WHOLE_SEQUENCE.velocities(heads, "t", kinds[1:], picks[1:]) == ("t", kinds[1], kinds[2])
    assert issubclass(HybridContext, type(WHOLE_SEQUENCE))
    shards = SequenceShards(rows=((0, 3), (3, 5)), heads=(slice(0, 1), slice(1, 2)))
    with pytest.raises(H3InputError, match=r"the sequence shards cover 5 rows; the sequence has 6"):
        shards.local_rows(6, kinds)
