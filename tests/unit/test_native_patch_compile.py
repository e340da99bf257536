"""The patch's linear branch compiled or plain (``NativeHybridSettings.compile``, the H3 VDN-H3 Patch node's
``compile``): ``"auto"`` runs the branch's fused form where the rows' device compiles, equal to the plain path
within fp64 rounding; a compiled function that fails to compile falls back once, said in one log line, to the plain
path, whose result it then gives bit for bit, and never retries; ``"off"`` never calls ``torch.compile``. The
failures are injected as in ``test_compile_fallback``: a machine without a C compiler."""

import logging

import pytest
import tiny_dit
import torch
from runs_given import runs_given
from test_compile_fallback import CAUSE, broken_toolchain, fresh, said_once, warnings_said  # noqa: F401
from test_native_patch import CFG, WINDOW, latents, native_pair

from h3_core.errors import H3InputError
from h3_core.models import native_hybrid
from h3_core.models.native_hybrid import NativeHybridSettings, NativeVDN


@pytest.fixture(scope="module")
def models():
    return native_pair(tiny_dit.model(hybrid=True))


@pytest.fixture
def compiles_here(fresh, monkeypatch):  # noqa: F811
    """The CPU taken for a device that compiles (as CUDA with Triton is)."""
    monkeypatch.setattr(native_hybrid, "compiled_branch_available", lambda device: True)


def evaluate(native, branch, vdn, seed=1):
    video, audio, text = latents(12, 2, 4, 7, seed=seed)
    options = {"patches_replace": {"dit": {("double_block", i): vdn.block_patch(i) for i in range(CFG.layers)}}}
    with torch.no_grad():
        return native([video, audio], torch.tensor([600.0]), text, options)


def branch_runs(branch):
    """``runs_given`` over ``branch``'s linear branches: each call's ``RunOptions``, in order."""
    return runs_given([block.attn.linear_attention for block in branch.transformer_blocks])


def modes(seen) -> list:
    """The ``branches_fused`` mode of each call ``branch_runs`` saw."""
    return [run.branches_fused for _, run in seen]


def patch(native, branch, compile):
    return NativeVDN(native, branch, NativeHybridSettings(WINDOW, "ref", compile=compile))


def test_auto_runs_the_fused_branch_equal_to_the_plain_path(compiles_here, monkeypatch, models):
    native, branch = models
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)  # compiling works
    with branch_runs(branch) as seen:
        plain = evaluate(native, branch, patch(native, branch, "off"))
    assert compiled == [] and set(modes(seen)) == {None}
    with branch_runs(branch) as seen:
        fused = evaluate(native, branch, patch(native, branch, "auto"))
    assert compiled and set(modes(seen)) == {"compiled"}
    for got, want in zip(fused, plain, strict=True):
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
        assert not torch.equal(got, want)  # the fused form's own order of additions: another path ran


def test_a_failing_compile_falls_back_to_the_plain_path_once(compiles_here, monkeypatch, caplog, models):
    native, branch = models
    toolchain = broken_toolchain(monkeypatch)
    plain = evaluate(native, branch, patch(native, branch, "off"))
    vdn = patch(native, branch, "auto")
    with caplog.at_level(logging.WARNING), branch_runs(branch) as seen:
        first = evaluate(native, branch, vdn)
    # from the fallback on, the branches run plain
    said = modes(seen)
    assert toolchain.calls == 1 and vdn.compiled_form.failed and said[-1] is None
    assert "compiled" not in said[said.index(None) :]
    assert all(torch.equal(a, b) for a, b in zip(first, plain, strict=True))
    assert said_once(
        caplog, f"the compiled VDN-H3 patch failed ({CAUSE}", "); its attention runs the plain path from now on"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = evaluate(native, branch, vdn)
    assert toolchain.calls == 1 and warnings_said(caplog) == []  # no retry, nothing said
    assert all(torch.equal(a, b) for a, b in zip(again, plain, strict=True))
    # another patch (another node's run) compiles afresh
    other = patch(native, branch, "auto")
    with caplog.at_level(logging.WARNING):
        evaluate(native, branch, other)
    assert other.compiled_form.failed and toolchain.calls == 2


def test_off_never_compiles(compiles_here, monkeypatch, models):
    native, branch = models
    toolchain = broken_toolchain(monkeypatch)
    evaluate(native, branch, patch(native, branch, "off"))
    assert toolchain.compiled == [] and toolchain.calls == 0


def test_a_bad_compile_mode_is_named():
    with pytest.raises(H3InputError, match=r"compile: got 'fast'; allowed: \['auto', 'off'\]"):
        NativeHybridSettings(compile="fast")


def test_the_plain_default_off_cuda_sets_no_fused_form(fresh, models):  # noqa: F811
    native, branch = models
    with branch_runs(branch) as seen:
        evaluate(native, branch, patch(native, branch, "auto"), seed=2)
        evaluate(native, branch, patch(native, branch, "auto"))  # the CPU does not compile: the plain ops run
    assert set(modes(seen)) == {None}


def test_a_compile_of_the_host_blocks_leaves_the_hybrid_attention_out(models):
    """A compile node after the patch (the host's TorchCompileModel, block-wise compile nodes) compiles the host's
    block around a graph break: none of the hybrid attention's operations is in its graphs, and the result is the
    uncompiled one."""
    native, branch = models
    vdn = patch(native, branch, "off")
    want = evaluate(native, branch, vdn)
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    blocks = native.blocks
    native.blocks = torch.nn.ModuleList(torch.compile(block, backend=recording_backend) for block in blocks)
    try:
        got = evaluate(native, branch, vdn)
    finally:
        native.blocks = blocks
        torch._dynamo.reset()
    traced = [node.meta.get("stack_trace") or "" for graph in graphs for node in graph.graph.nodes]
    assert graphs and any("native_h3_protocol" in trace for trace in traced)  # the host's block parts compiled
    assert not any("h3_core" in trace for trace in traced)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-12 * w.abs().max()
