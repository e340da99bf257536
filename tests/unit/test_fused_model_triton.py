"""The whole fused model on the CPU with every hand-written Triton kernel in its place, run by Triton's CPU
interpreter: the kernels are driven through the model's own path (shapes, strides, head groups, the text
state, the fp8 rows) and the model's output is the plain model's. Every fused function has its kernel, so
nothing reaches ``torch.compile`` (checked: an evaluation on CUDA traces nothing with dynamo)."""

import textwrap

import pytest
from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests/unit")
    import torch
    compiled = []  # what would be handed to torch.compile: nothing, every fused function has its kernel
    torch.compile = lambda fn, **kwargs: compiled.append(fn) or fn

    from h3_core.models import branch_fused
    from h3_core.models.low_memory import LowMemory
    from h3_core.models.run_options import RunOptions
    from tiny_dit import fp32_case

    used = set()
    kernel_for = branch_fused.triton_kernel
    def recorded(name, device):
        kernel = kernel_for(name, device)
        if kernel is not None:
            used.add(name)
        return kernel
    branch_fused.triton_kernel = recorded
    import h3_core.models.fp8_triton as fp8_kernels  # loaded on first use: record the quantisers before that
    import h3_core.models.block_triton as block_kernels
    quantisers = ("quantize_rows_triton", "gate_heads_quantize_triton", "swiglu_quantize_triton")
    def count(module, name, label):
        def counted(*a, _kernel=getattr(module, name), **k):
            used.add(label(a))
            return _kernel(*a, **k)
        setattr(module, name, counted)
    for name in quantisers:
        count(fp8_kernels, name, lambda a, name=name: name)
    # the block's norm: the attention input's, and the FFN's after the residual (y and gate given)
    count(block_kernels, "block_norm_triton", lambda a: "residual + norm" if len(a) > 6 else "norm")

    fp8, groups = {fp8}, {groups}
    m, args, ctx = fp32_case(True, fp8)
    run = RunOptions().with_low_memory(LowMemory(head_groups=groups))
    with torch.no_grad():
        plain = m(*args, hybrid=ctx, run=run)
        fused = m(*args, hybrid=ctx, run=run.fused("compiled"))
    kernels = {{"qk_norm_rope", "conv_features", "readout", "scan", "gather", "small_inverse", "norm_modulate",
               "norm", "residual + norm", "gated_residual_", "shifted_gram", "spatial_conv"}}
    # an fp8 fc2 takes its input quantised as SiLU·up is formed, a bf16 one has it written in place; an fp8
    # out_proj takes the softmax's head gate as its rows are quantised, a bf16 one from the window softmax
    assert used == kernels | (set(quantisers) if fp8 else {{"swiglu_"}}), used
    assert compiled == [], compiled
    for a, b in zip(fused, plain):
        if fp8:  # the interpreter's e4m3 cast is not the GPU's: the codes differ, not the computation
            assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.99
        else:
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), float((a - b).abs().max() / b.abs().max())
    print("OK")
    """
)


@pytest.mark.parametrize("fp8, groups", [(False, 1), (False, 3), (True, 1)])
def test_the_fused_model_runs_its_triton_kernels_and_equals_the_plain_model(fp8, groups):
    assert run_interpreted(CHECK.format(fp8=fp8, groups=groups)).split()[-1] == "OK"
