"""fp8 linear layers (h3_core.models.fp8_linear) on a CUDA GPU (skipped without one): the row-wise ``torch._scaled_mm``
path against the dequantising reference, the shapes and dtypes that must fall back, and a reduced DiT, one
step, against bf16. The ``_scaled_mm`` checks also need compute capability 8.9 or newer.

Tolerance of the fast path against the reference (``exact accumulation``, ``fast_accum=False``): both quantise
the activations with the same code on the same device, so they multiply identical e4m3 codes and fp32 scales;
products of two e4m3 values are exact in fp32. They differ only in how the K products are summed (the kernel
in its own order and, on Hopper, with partial sums of limited precision promoted to fp32 at intervals; the
reference in fp32) and in where the scales are applied, and each result is rounded once to bf16. So per
element |fast − ref| ≤ one bf16 ulp (2^-7 · |ref|, when the two fp32 values straddle a rounding boundary) plus
the summation error, bounded as ``ACCUMULATION · (|x_q·s_a| @ |w_q·s_w|ᵀ)``. ``fast_accum=True`` (the published
setting) drops the promotion; its error grows with K (relative RMS 2.5e-3 at K = 5376 and 3.6e-3 at K = 14336 on
an H200 with torch 2.11, against 6.7e-4 with promotion, i.e. bf16 rounding alone), so it is bounded against the
error that fp8 quantisation itself makes (3.7e-2 relative RMS against the bf16 layer): at most a quarter of it.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from quantized_rows import assert_codes_within_a_step

from h3_core.models.fp8_linear import (
    Fp8Linear,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_linears,
    quantize_rows,
    scaled_mm_supports,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
HAS_FP8_MATMUL = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not HAS_FP8_MATMUL, reason="fp8 matmuls need compute capability 8.9 or newer")

# Summation error allowance, as a fraction of Σ|terms| (see the module docstring): 2^-13, half the relative
# precision of the ~14-bit partial sums Hopper's fp8 tensor cores keep between fp32 promotions.
ACCUMULATION = 2.0**-13
# fast_accum=True: the largest share of the quantisation error its summation error may add.
FAST_ACCUM_SHARE = 0.25


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    """The reference's fp32 matmul must not run in TF32 (10-bit mantissa), or it would be the less exact side."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def quantised_layer(in_features, out_features, bias=False, dtype=torch.bfloat16, seed=0) -> Fp8Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias, device=DEV, dtype=dtype)
    return Fp8Linear.from_linear(linear, dtype, fast_accum=False)


def abs_product(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    codes, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return (codes.float().abs() * scale) @ layer.dequantized_weight().abs().t()


def reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    return fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias, layer.compute_dtype)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@needs_fp8
@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [(1, 64, 32), (77, 256, 384), (333, 1024, 512), (4096, 5376, 21504), (2048, 14336, 5376)],
    ids=["one-row", "odd-rows", "rows-333", "qkv-size", "fc2-size"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_scaled_mm_equals_the_reference(rows, in_features, out_features, bias):
    layer = quantised_layer(in_features, out_features, bias)
    x = torch.randn(rows, in_features, device=DEV, dtype=torch.bfloat16)
    assert scaled_mm_supports(x, layer.weight, torch.bfloat16) == (True, "")
    got = layer(x)
    want = reference(layer, x)
    bound = 2.0**-7 * want.float().abs() + ACCUMULATION * abs_product(layer, x)
    assert ((got.float() - want.float()).abs() <= bound).all()


@needs_fp8
def test_fp16_output_when_the_build_has_it():
    layer = quantised_layer(256, 128, bias=True, dtype=torch.float16)
    x = torch.randn(50, 256, device=DEV, dtype=torch.float16)
    usable, why = scaled_mm_supports(x, layer.weight, torch.float16)
    if not usable:
        pytest.skip(why)
    got, want = layer(x), reference(layer, x)
    assert got.dtype == torch.float16
    # fp16 keeps 11 significant bits: one ulp is 2^-10 relative.
    bound = 2.0**-10 * want.float().abs() + ACCUMULATION * abs_product(layer, x)
    assert ((got.float() - want.float()).abs() <= bound).all()


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@needs_fp8
@pytest.mark.parametrize("in_features,out_features", [(5376, 7168), (14336, 5376)], ids=["K5376", "K14336"])
def test_fast_accumulation_error_is_small_beside_the_quantisation_error(in_features, out_features):
    torch.manual_seed(1)
    linear = nn.Linear(in_features, out_features, bias=False, device=DEV, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear, torch.bfloat16)
    x = torch.randn(2048, in_features, device=DEV, dtype=torch.bfloat16)
    want = reference(layer, x)
    got = fp8_linear_scaled_mm(x, layer.weight, layer.weight_scale, None, torch.bfloat16, fast_accum=True)
    with torch.no_grad():
        quantisation_error = relative_rms(want, linear(x))
    assert relative_rms(got, want) <= FAST_ACCUM_SHARE * quantisation_error


def test_cuda_quantiser_equals_the_cpu_one():
    """The division written straight into e4m3 rounds as the fp32 quotient cast afterwards, and a weight gets
    the same codes and scales whichever device quantised it."""
    torch.manual_seed(4)
    x = torch.randn(300, 1000, dtype=torch.bfloat16) * torch.exp2(torch.randint(-8, 8, (300, 1)).float()).bfloat16()
    codes, scale = quantize_rows(x.to(DEV))
    cpu_codes, cpu_scale = quantize_rows(x)
    two_step = (x.to(DEV).float() / scale).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), two_step.view(torch.uint8))
    assert torch.equal(scale.cpu(), cpu_scale)
    assert torch.equal(codes.cpu().view(torch.uint8), cpu_codes.view(torch.uint8))
    linear = nn.Linear(1000, 300, bias=False)
    on_cpu, on_gpu = Fp8Linear.from_linear(linear).to(DEV), Fp8Linear.from_linear(linear.to(DEV))
    assert torch.equal(on_cpu.weight.view(torch.uint8), on_gpu.weight.view(torch.uint8))
    assert torch.equal(on_cpu.weight_scale, on_gpu.weight_scale)


@pytest.mark.parametrize(
    "width, dtype, strided",
    [
        (5376, torch.bfloat16, False),
        (14336, torch.bfloat16, True),
        (7168, torch.float32, False),
        (40, torch.float16, True),
    ],
)
def test_the_triton_quantiser_gives_the_reference_codes(width, dtype, strided):
    """One pass per row on CUDA (h3_core.models.fp8_triton) against the eager reference on the same device, bit for
    bit, at the model's widths, for rows of a wider tensor (the FFN's gate half) and with a zero row."""
    from h3_core.models.fp8_linear import fp8_triton, quantize_rows_reference
    from h3_core.triton_forms import triton_form

    if triton_form(fp8_triton, "quantize_rows_triton", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(6)
    full = torch.randn(257, 2 * width if strided else width, generator=g) * torch.logspace(-4, 4, 257)[:, None]
    full[17] = 0
    x = full.to(DEV, dtype)[:, :width]
    codes, scale = quantize_rows(x)
    ref_codes, ref_scale = quantize_rows_reference(x)
    assert codes.is_contiguous() and codes.dtype == torch.float8_e4m3fn and scale.shape == (257, 1)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize("ffn, dtype", [(14336, torch.bfloat16), (14336, torch.float16), (40, torch.bfloat16)])
def test_the_fused_swiglu_quantiser_gives_the_two_step_codes(ffn, dtype):
    """The FFN's SiLU·up and the quantisation of fc2's input in one Triton pass, bit for bit what the product
    written into fc1's output by the compiled SiLU·up and quantised after gives, at the model's width and with a
    zero row."""
    from h3_core.models import block_fused
    from h3_core.models.fp8_linear import fp8_triton, quantize_input
    from h3_core.triton_forms import triton_form

    if triton_form(fp8_triton, "swiglu_quantize_triton", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(7)
    # rows from 1e-3 to 30 in size: products up to ≈ 2·10⁴, inside fp16's range
    gate_up = (torch.randn(300, 2 * ffn, generator=g) * torch.logspace(-3, 1.5, 300)[:, None]).to(DEV, dtype)
    gate_up[11] = 0
    one = block_fused.swiglu_quantized("compiled", gate_up)
    two = quantize_input(block_fused.run("compiled", "swiglu_", gate_up.clone()))
    assert one.codes.shape == (300, ffn) and one.lead == two.lead == (300,)
    if dtype == torch.bfloat16:
        assert torch.equal(one.scale, two.scale)
        assert torch.equal(one.codes.view(torch.uint8), two.codes.view(torch.uint8))
    else:  # SiLU's fp32 roundings differ by an ulp between the two kernels, and fp16's finer steps can turn that
        # into another rounding of the product: a few codes one e4m3 step apart, the scales an fp16 step
        assert_codes_within_a_step(one, two, 2**-10)


@pytest.mark.parametrize(
    "heads, head_dim, dtype", [(56, 128, torch.bfloat16), (56, 128, torch.float16), (3, 24, torch.bfloat16)]
)
def test_the_fused_gate_quantiser_gives_the_two_step_codes(heads, head_dim, dtype):
    """out_proj's input — the window softmax's output times its per-head gate — quantised in one Triton pass,
    bit for bit what the compiled gate written in place and quantised after gives, at the model's width (a
    head group's columns of the gate, a zero row) and at a width whose chunks split heads."""
    from h3_core.models import block_fused
    from h3_core.models.fp8_linear import fp8_triton, quantize_input
    from h3_core.triton_forms import triton_form

    if triton_form(fp8_triton, "gate_heads_quantize_triton", "cuda") is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(8)
    soft = (torch.randn(300, heads, head_dim, generator=g) * torch.logspace(-3, 2, 300)[:, None, None]).to(DEV, dtype)
    gate = torch.rand(300, heads + 2, generator=g).to(DEV, dtype)[:, 1:-1]
    gate[13] = 0
    one = block_fused.gate_heads_input("compiled", soft, gate, True)
    two = quantize_input(block_fused.run("compiled", "gate_heads_", soft.clone(), gate).reshape(300, -1))
    assert one.codes.shape == (300, heads * head_dim) and one.lead == two.lead == (300,)
    assert torch.equal(one.scale, two.scale)
    assert torch.equal(one.codes.view(torch.uint8), two.codes.view(torch.uint8))


@needs_fp8
def test_leading_dimensions_are_rows():
    layer = quantised_layer(512, 256)
    x = torch.randn(3, 100, 512, device=DEV, dtype=torch.bfloat16)
    got = layer(x)
    assert got.shape == (3, 100, 256)
    assert torch.equal(got.reshape(300, 256), layer(x.reshape(300, 512)))


@pytest.mark.parametrize(
    "in_features,out_features,dtype,reason",
    [
        (100, 48, torch.bfloat16, "divisible by 16"),
        (64, 50, torch.bfloat16, "divisible by 16"),
        (64, 48, torch.float32, "return bf16 or fp16"),
    ],
    ids=["in-100", "out-50", "fp32-output"],
)
def test_what_the_kernel_refuses_falls_back_to_the_reference(in_features, out_features, dtype, reason):
    layer = quantised_layer(in_features, out_features, bias=True, dtype=dtype)
    x = torch.randn(37, in_features, device=DEV, dtype=dtype)
    usable, why = scaled_mm_supports(x, layer.weight, dtype)
    assert not usable and (reason in why or not HAS_FP8_MATMUL)
    got = layer(x)
    assert torch.isfinite(got).all() and torch.equal(got, reference(layer, x))


def test_zero_rows_stay_zero():
    layer = quantised_layer(256, 128)
    x = torch.randn(40, 256, device=DEV, dtype=torch.bfloat16)
    x[[0, 17, 39]] = 0
    got = layer(x)
    assert torch.isfinite(got).all() and not got[[0, 17, 39]].any()


REDUCED = dict(
    hidden=1024,
    layers=2,
    heads=8,
    head_dim=128,
    ffn=2816,
    refiner_layers=1,
    text_dim=512,
    freq_dim=256,
    time_hidden=1024,
    time_embed=512,
    rope_freqs=16,
)


def open_gates(model) -> None:
    """AdaLN shift 0, scale 0, gate 1: with default init the gates are small and the blocks barely move the
    residual stream, which would hide what quantisation does."""
    with torch.no_grad():
        for block in model.blocks:
            block.adaln_proj.linear.weight.zero_()
            table = block.adaln_proj.linear.bias.view(3, 6, -1)
            table.zero_()
            table[:, 2] = table[:, 5] = 1


@needs_fp8
@pytest.mark.parametrize("fused", [None, "compiled"], ids=["plain", "fused"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_one_step_of_a_reduced_dit_against_bf16(hybrid, fused):
    """Also with the blocks fused and compiled (the CUDA default): the FFN's product written into fc1's output
    and quantised by the Triton pass from there."""
    from h3_core.attention import WindowSpec
    from h3_core.models.branch_fused import compiled_branch_available
    from h3_core.models.dit import DiTConfig, H3DiT
    from h3_core.models.hybrid import HybridContext
    from h3_core.models.run_options import RunOptions
    from h3_core.pipeline.packing import pack_sequence

    if fused == "compiled" and not compiled_branch_available(DEV):
        pytest.skip("needs Triton")
    torch.manual_seed(2)
    # Built on the CPU and moved: tests/conftest.py's torch.empty wrapper escapes a torch.device(...) context.
    model = H3DiT(DiTConfig(**REDUCED, hybrid=hybrid)).to(device=DEV, dtype=torch.bfloat16).eval()
    open_gates(model)
    packed = pack_sequence(torch.ones(64, dtype=torch.long), 12, 16, 32, 40)
    g = torch.Generator(device=DEV).manual_seed(3)
    T = packed.positions.shape[0]
    args = dict(
        video_rows=torch.randn(packed.video_index.numel(), 96, generator=g, device=DEV),
        audio_rows=torch.randn(packed.audio_index.numel(), 32, generator=g, device=DEV),
        text_rows=torch.randn(64, 512, generator=g, device=DEV),
        timesteps=torch.tensor([0.4], device=DEV),
        timestep_index=torch.zeros(T, dtype=torch.long, device=DEV),
        tags=packed.tags.to(DEV),
        positions=packed.positions.to(DEV),
        video_index=packed.video_index.to(DEV),
        audio_index=packed.audio_index.to(DEV),
        text_index=packed.text_index.to(DEV),
    )
    context = HybridContext(packed.layout, WindowSpec(1, 2, "both"), "ref", (0, 64)) if hybrid else None
    quantised, without = copy.deepcopy(model), copy.deepcopy(model)
    swapped = quantize_linears(quantised)
    assert swapped == 2 * (5 if hybrid else 4) + 4
    run = RunOptions().fused(fused)  # the quantised model's evaluation only
    for module in quantised.modules():
        if isinstance(module, Fp8Linear):  # every swapped layer takes the _scaled_mm path
            row = torch.zeros(1, module.in_features, device=DEV, dtype=torch.bfloat16)
            assert scaled_mm_supports(row, module.weight, torch.bfloat16) == (True, "")
    with torch.no_grad():
        for name, module in without.named_modules():
            if isinstance(quantised.get_submodule(name), Fp8Linear):
                module.weight.zero_()
        want = model(**args, hybrid=context)
        got = quantised(**args, hybrid=context, run=run)
        baseline = without(**args, hybrid=context)
    for got_part, want_part, baseline_part in zip(got, want, baseline):
        assert torch.isfinite(got_part).all()
        assert cosine(got_part, want_part) >= 0.995
        assert cosine(baseline_part, want_part) < 0.97  # the quantised layers carry a real share of the output


@needs_fp8
def test_rows_quantised_once_give_every_slice_what_quantising_it_again_gives():
    from h3_core.models.fp8_linear import quantize_input

    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(512, 3 * 256, bias=False).to(DEV, torch.bfloat16)).to(DEV)
    x = torch.randn(2, 300, 512, device=DEV, dtype=torch.bfloat16)
    once = quantize_input(x)
    for rows in (slice(0, 128), slice(256, 384), slice(640, 768)):
        assert torch.equal(layer.part(once, rows=rows), layer.part(x, rows=rows))
