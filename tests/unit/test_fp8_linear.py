"""fp8 linear layers (h3_core.models.fp8_linear) on CPU: the quantiser against an independent e4m3 rounding, the
layer against the same arithmetic in fp64, fp8-scaled checkpoints taken as they are, and a tiny DiT swapped.

Error bounds of e4m3 (3 mantissa bits, exponent bias 7, largest value 448, smallest normal 2^-6, subnormal
step 2^-9), for a value v = w / s in units of its channel's scale s:
  * normal range |v| ≥ 2^-6: round to nearest leaves |v̂ − v| ≤ half an ulp = 2^(e−4) ≤ 2^-4 · |v|;
  * subnormal range: |v̂ − v| ≤ half the step = 2^-10;
  so |ŵ − w| ≤ 2^-4 · |w| + 2^-10 · s per element. Relative to the channel's largest magnitude (448 s), the
  worst case is the top binade [256, 448), ulp 32: |ŵ − w| ≤ 16 s = amax / 28 (< 2^-4 · amax).
The row's largest magnitude itself lands exactly on the code ±448, so it comes back as 448 · s = amax up to
the fp32 rounding of s and of the product (≤ 2^-23 relative).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from h3_core.errors import H3InputError
from h3_core.formats.files import CheckpointFiles
from h3_core.formats.fp8_scaled import fp8_scaled_view
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import (
    E4M3_MAX,
    FP8_LAYERS,
    Fp8Linear,
    fp8_linear_reference,
    quantize_linears,
    quantize_rows,
    scaled_mm_supports,
)
from h3_core.models.precision import keeps_fp32

TINY = dict(
    hidden=48,
    layers=2,
    heads=2,
    head_dim=32,
    ffn=64,
    refiner_layers=2,
    text_dim=40,
    freq_dim=16,
    time_hidden=24,
    time_embed=20,
    rope_freqs=4,
)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3fn grid, saturating at ±448, computed in fp64 from the format's
    definition (independent of torch's float8 cast)."""
    v = v.double()
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6))).clamp_min(-6)
    ulp = 2.0 ** (exponent - 3)
    return (torch.round(v / ulp) * ulp).clamp(-E4M3_MAX, E4M3_MAX)


def independent_row_quantisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 codes and the fp32 scale of each row, by the definition: scale = amax / 448 and x / scale in fp32
    (the quotient is rounded to fp32 before e4m3, as the layer does: rounding the exact quotient instead can
    differ where fp32 lands it on an e4m3 tie)."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return round_e4m3(x.float() / scale), scale


def wide_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows whose magnitudes span many binades (and both e4m3 subnormals and the top binade after scaling)."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.randn(rows, cols, generator=g)
    return mantissa * torch.exp2(torch.randint(-12, 4, (rows, cols), generator=g).float())


def fp64_output(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """``(x_q · s_a) @ (w_q · s_w)ᵀ + bias`` in fp64, with the activations quantised independently."""
    codes, scale = independent_row_quantisation(x.reshape(-1, x.shape[-1]))
    weight = layer.weight.double() * layer.weight_scale.double()[:, None]
    y = (codes * scale.double()) @ weight.t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], -1)


def abs_product(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """|x| @ |W|ᵀ in fp64: the scale of the rounding errors an fp32 dot product can make."""
    return x.reshape(-1, x.shape[-1]).double().abs() @ layer.dequantized_weight().double().abs().t()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_rows_is_round_to_nearest_even_on_the_e4m3_grid(dtype):
    x = wide_rows(37, 53, seed=0).to(dtype)
    codes, scale = quantize_rows(x)
    want_codes, want_scale = independent_row_quantisation(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.is_contiguous() and scale.shape == (37, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.double(), want_codes)


def test_quantize_rows_saturates_where_fp32_rounds_the_scale_down():
    """Rows whose fp32 scale amax / 448 is rounded down put their largest element a hair above 448: it must
    come out as the code ±448, never NaN (e4m3fn has no infinity)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4000, 8, generator=g) * torch.exp2(torch.randint(-20, 20, (4000, 1), generator=g).float())
    codes, scale = quantize_rows(x)
    above = (x.double().abs().amax(dim=1) / scale[:, 0].double()) > E4M3_MAX
    assert above.sum() > 100  # the case is exercised
    assert not codes.float().isnan().any()
    assert torch.equal(codes.float().abs().amax(dim=1), torch.full((4000,), E4M3_MAX))


def test_quantize_rows_reads_strided_inputs():
    x = wide_rows(12, 40, seed=2)
    codes, scale = quantize_rows(x.t())  # [40, 12], column-major
    want, want_scale = quantize_rows(x.t().contiguous())
    assert torch.equal(codes.float(), want.float()) and torch.equal(scale, want_scale)


def test_weight_round_trip_stays_within_the_e4m3_bounds():
    linear = nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight.copy_(wide_rows(40, 96, seed=3))
    layer = Fp8Linear.from_linear(linear, torch.float32)
    w = linear.weight.double()
    amax = w.abs().amax(dim=1, keepdim=True)
    s = layer.weight_scale.double()[:, None]
    error = (layer.dequantized_weight().double() - w).abs()
    slack = 2.0**-22 * w.abs()  # fp32 rounding of s and of codes · s
    assert (error <= 2.0**-4 * w.abs() + 2.0**-10 * s + slack).all()
    assert (error <= amax / 28 + slack).all()
    top = w.abs().argmax(dim=1)
    rows = torch.arange(40)
    assert torch.equal(layer.weight.float()[rows, top].abs(), torch.full((40,), E4M3_MAX))
    assert ((layer.dequantized_weight().double()[rows, top].abs() - amax[:, 0]).abs() <= 2.0**-23 * amax[:, 0]).all()


def test_weight_codes_equal_the_independent_rounding():
    linear = nn.Linear(64, 24)
    layer = Fp8Linear.from_linear(linear)
    codes, scale = independent_row_quantisation(linear.weight.detach())
    assert torch.equal(layer.weight.double(), codes) and torch.equal(layer.weight_scale, scale[:, 0])
    assert layer.bias.dtype == torch.bfloat16 and torch.equal(layer.bias, linear.bias.detach().bfloat16())


@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 96), (1, 96)], ids=["T-in", "B-T-in", "one-row"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_forward_equals_the_quantised_arithmetic_in_fp64(shape, bias):
    torch.manual_seed(4)
    layer = Fp8Linear.from_linear(nn.Linear(96, 40, bias=bias), torch.float32)
    x = torch.randn(shape)
    y = layer(x)
    assert y.shape == (*shape[:-1], 40) and y.dtype == torch.float32
    # An fp32 dot product of K terms errs by at most about K·2^-24 of the sum of |terms|.
    bound = 2 * 96 * 2.0**-24 * abs_product(layer, x).reshape(y.shape) + 1e-7
    assert ((y.double() - fp64_output(layer, x)).abs() <= bound).all()


def test_forward_in_bf16_is_the_fp32_result_rounded_once():
    torch.manual_seed(5)
    layer = Fp8Linear.from_linear(nn.Linear(96, 40), torch.bfloat16)
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    y = layer(x)
    want = fp64_output(layer, x)
    assert y.dtype == torch.bfloat16
    bound = 2.0**-8 * want.abs() + 2 * 96 * 2.0**-24 * abs_product(layer, x) + 1e-6
    assert ((y.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_stays_close_to_the_original_linear(dtype):
    torch.manual_seed(6)
    linear = nn.Linear(256, 192).to(dtype)
    x = torch.randn(64, 256, dtype=dtype)
    with torch.no_grad():
        assert cosine(Fp8Linear.from_linear(linear, dtype)(x), linear(x)) >= 0.995


def test_zero_rows_give_zeros_or_the_bias_and_no_nan():
    torch.manual_seed(7)
    linear = nn.Linear(32, 16)
    x = torch.randn(5, 32)
    x[1] = 0
    x[4] = 0
    with_bias = Fp8Linear.from_linear(linear, torch.float32)(x)
    no_bias = Fp8Linear.from_linear(nn.Linear(32, 16, bias=False), torch.float32)(x)
    assert torch.isfinite(with_bias).all() and torch.isfinite(no_bias).all()
    assert torch.equal(no_bias[[1, 4]], torch.zeros(2, 16))
    assert torch.equal(with_bias[1], linear.bias.detach()) and torch.equal(with_bias[4], linear.bias.detach())
    zero_weight = nn.Linear(32, 16, bias=False)
    nn.init.zeros_(zero_weight.weight)
    assert torch.equal(Fp8Linear.from_linear(zero_weight, torch.float32)(x), torch.zeros(5, 16))


def test_the_cpu_forward_is_the_reference_and_says_why():
    layer = Fp8Linear.from_linear(nn.Linear(32, 16), torch.bfloat16)
    x = torch.randn(3, 32)
    usable, why = scaled_mm_supports(x, layer.weight, torch.bfloat16)
    assert not usable and "cpu" in why
    assert torch.equal(layer(x), fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias, torch.bfloat16))


def test_state_dict_round_trips_through_an_empty_layer():
    source = Fp8Linear.from_linear(nn.Linear(48, 32), torch.float32)
    assert set(source.state_dict()) == {"weight", "weight_scale", "bias"}
    target = Fp8Linear(48, 32, bias=True, compute_dtype=torch.float32)
    target.load_state_dict(source.state_dict())
    x = torch.randn(4, 48)
    assert torch.equal(target(x), source(x))


def write_fp8_scaled(path, weight_fp8, scale, form):
    """One layer ``blocks.0.mlp.fc1`` in ComfyUI's per-layer form or the legacy ``scaled_fp8`` form."""
    if form == "comfy_quant":
        spec = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        tensors = {
            "blocks.0.mlp.fc1.weight": weight_fp8,
            "blocks.0.mlp.fc1.weight_scale": scale,
            "blocks.0.mlp.fc1.comfy_quant": spec,
        }
    else:
        tensors = {
            "blocks.0.mlp.fc1.weight": weight_fp8,
            "blocks.0.mlp.fc1.scale_weight": scale,
            "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
        }
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    "form,per_channel",
    [("comfy_quant", False), ("comfy_quant", True), ("scaled_fp8", False)],
    ids=["comfy-per-tensor", "comfy-per-channel", "legacy-per-tensor"],
)
def test_from_scaled_equals_dequantising_at_load(tmp_path, form, per_channel):
    g = torch.Generator().manual_seed(8)
    weight_fp8 = (torch.randn(24, 64, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(24, generator=g) * 0.01 + 1e-3 if per_channel else torch.tensor(0.0037)
    path = tmp_path / "fp8.safetensors"
    write_fp8_scaled(path, weight_fp8, scale, form)
    files = CheckpointFiles(path)
    dequantised_at_load = fp8_scaled_view(files).get("blocks.0.mlp.fc1.weight")
    scale_key = "blocks.0.mlp.fc1." + ("weight_scale" if form == "comfy_quant" else "scale_weight")
    layer = Fp8Linear.from_scaled(
        files.get("blocks.0.mlp.fc1.weight"), files.get(scale_key), compute_dtype=torch.float32
    )
    assert torch.equal(layer.weight.view(torch.uint8), weight_fp8.view(torch.uint8))  # codes taken as they are
    assert torch.equal(layer.dequantized_weight(), dequantised_at_load)
    x = torch.randn(6, 64, generator=g)
    codes, row_scale = quantize_rows(x)
    want = (codes.float() * row_scale) @ dequantised_at_load.t()
    assert torch.allclose(layer(x), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_from_scaled_keeps_per_channel_scales_of_shape_out_by_one():
    weight_fp8 = torch.randn(8, 16).to(torch.float8_e4m3fn)
    scale = torch.rand(8, 1) + 0.5
    bias = torch.randn(8)
    layer = Fp8Linear.from_scaled(weight_fp8, scale, bias, torch.bfloat16)
    assert torch.equal(layer.weight_scale, scale[:, 0]) and layer.bias.dtype == torch.bfloat16


def tiny_dit(hybrid: bool, dtype=torch.float32) -> H3DiT:
    torch.manual_seed(9)
    return H3DiT(DiTConfig(**TINY, hybrid=hybrid)).to(dtype).eval()


def open_gates(model: H3DiT) -> None:
    """AdaLN tables of shift 0, scale 0 and gate 1: with the default init the gates are small and the blocks
    barely move the residual stream, so an output comparison could not see what quantisation does."""
    with torch.no_grad():
        for block in model.blocks:
            block.adaln_proj.linear.weight.zero_()
            table = block.adaln_proj.linear.bias.view(3, 6, -1)  # modality, (shift, scale, gate) × 2, hidden
            table.zero_()
            table[:, 2] = table[:, 5] = 1


def expected_swaps(model: nn.Module, names=FP8_LAYERS) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in names
    }


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_quantize_linears_swaps_exactly_the_listed_layers(hybrid):
    model = tiny_dit(hybrid)
    before = {name: type(module) for name, module in model.named_modules()}
    want = expected_swaps(model)
    per_block = 5 if hybrid else 4  # qkv_proj, out_proj, fc1, fc2 (+ to_out_linear)
    assert len(want) == 2 * per_block + 2 * 4  # two DiT blocks, two refiner blocks
    assert quantize_linears(model, compute_dtype=torch.float32) == len(want)
    for name, module in model.named_modules():
        if name in want:
            assert isinstance(module, Fp8Linear), name
        elif name in before:
            assert type(module) is before[name], name
    assert not any(keeps_fp32(f"{name}.weight") for name in want)
    assert isinstance(model.video_patch_proj, nn.Linear) and isinstance(model.final_layer.video_out, nn.Linear)
    assert model.video_patch_proj.weight.dtype == torch.float32


def test_quantize_linears_takes_other_names_and_skips_fp32_islands():
    model = tiny_dit(False)
    swapped = quantize_linears(model, names=("condition_proj", "video_out", "proj_in"), compute_dtype=torch.float32)
    # condition_proj is compute-dtype; video_out and time_embedder.proj_in are fp32 islands.
    assert swapped == 1 and isinstance(model.condition_proj, Fp8Linear)
    assert type(model.final_layer.video_out) is nn.Linear and type(model.time_embedder.proj_in) is nn.Linear


def packed_inputs(model: H3DiT, dtype, frames: int = 6):
    from h3_core.pipeline.packing import pack_sequence

    packed = pack_sequence(torch.ones(5, dtype=torch.long), frames, 2, 4, 3)
    g = torch.Generator().manual_seed(10)
    T = packed.positions.shape[0]
    args = dict(
        video_rows=torch.randn(packed.video_index.numel(), 96, generator=g, dtype=dtype),
        audio_rows=torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=dtype),
        text_rows=torch.randn(5, 40, generator=g, dtype=dtype),
        timesteps=torch.tensor([0.4]),
        timestep_index=torch.zeros(T, dtype=torch.long),
        tags=packed.tags,
        positions=packed.positions,
        video_index=packed.video_index,
        audio_index=packed.audio_index,
        text_index=packed.text_index,
    )
    return packed, args


@pytest.mark.parametrize(
    "hybrid,dtype",
    [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)],
    ids=["dense-fp32", "hybrid-fp32", "dense-bf16", "hybrid-bf16"],
)
def test_one_step_forward_stays_close_after_quantising(hybrid, dtype):
    from h3_core.attention import WindowSpec
    from h3_core.models.hybrid import HybridContext

    model = tiny_dit(hybrid, dtype)
    open_gates(model)
    packed, args = packed_inputs(model, dtype)
    # A window of 3 of the 6 frames: the linear branch runs, so to_out_linear is exercised.
    context = HybridContext(packed.layout, WindowSpec(1, 1, "both"), "ref", (0, 5)) if hybrid else None
    quantised, without = copy.deepcopy(model), copy.deepcopy(model)
    assert quantize_linears(quantised, compute_dtype=dtype) > 0
    with torch.no_grad():
        for name in expected_swaps(without):
            without.get_submodule(name).weight.zero_()
        want = model(**args, hybrid=context)
        got = quantised(**args, hybrid=context)
        baseline = without(**args, hybrid=context)
    for got_part, want_part, baseline_part in zip(got, want, baseline):
        assert torch.isfinite(got_part).all()
        assert cosine(got_part, want_part) >= 0.995
        # The quantised layers carry a real share of the output, so the bound above is not met by default.
        assert cosine(baseline_part, want_part) < 0.97


def test_quantising_twice_is_refused():
    model = tiny_dit(False)
    quantize_linears(model, compute_dtype=torch.float32)
    with pytest.raises(H3InputError, match="already holds 16 Fp8Linear layers"):
        quantize_linears(model, compute_dtype=torch.float32)


def test_a_single_name_is_one_name():
    model = tiny_dit(False)
    assert quantize_linears(model, names="fc2", compute_dtype=torch.float32) == 4


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: Fp8Linear.from_scaled(torch.randn(4, 16), torch.tensor(1.0)),
            "float8_e4m3fn tensor, got torch.float32",
        ),
        (lambda: Fp8Linear.from_scaled(torch.randn(4, 16).to(torch.float8_e5m2), torch.tensor(1.0)), "e5m2 weights"),
        (
            lambda: Fp8Linear.from_scaled(torch.randn(16).to(torch.float8_e4m3fn), torch.tensor(1.0)),
            r"matrix \[out, in\]",
        ),
        (
            lambda: Fp8Linear.from_scaled(torch.randn(4, 16).to(torch.float8_e4m3fn), torch.ones(16)),
            r"one per output channel \(\[4\] or \[4, 1\]\).*got shape \[16\]",
        ),
        (
            lambda: Fp8Linear.from_scaled(torch.randn(4, 16).to(torch.float8_e4m3fn), torch.tensor(float("nan"))),
            "scale must be finite",
        ),
        (
            lambda: Fp8Linear.from_scaled(torch.randn(4, 16).to(torch.float8_e4m3fn), torch.tensor(1.0), torch.ones(5)),
            r"bias must have shape \[4\].*got \[5\]",
        ),
        (lambda: Fp8Linear.from_linear(nn.Conv1d(4, 4, 1)), "takes an nn.Linear, got Conv1d"),
        (lambda: Fp8Linear.from_linear(nn.Linear(4, 4), torch.int8), "compute_dtype must be one of"),
        (lambda: Fp8Linear.from_linear(nn.Linear(16, 4))(torch.randn(3, 8)), r"inputs \[\.\.\., 16\], got \[3, 8\]"),
        (lambda: quantize_linears(nn.Linear(4, 4), names=["fc1", 2]), "names must be a list of attribute names"),
    ],
    ids=[
        "not-fp8",
        "e5m2",
        "not-a-matrix",
        "scale-shape",
        "scale-nan",
        "bias-shape",
        "not-linear",
        "compute-dtype",
        "in-features",
        "names",
    ],
)
def test_errors_name_the_input_and_what_is_allowed(call, message):
    with pytest.raises(H3InputError, match=message):
        call()


def test_a_cast_after_quantising_is_an_error_not_garbage():
    layer = Fp8Linear.from_linear(nn.Linear(16, 8), torch.float32)
    layer.to(torch.bfloat16)
    with pytest.raises(H3InputError, match="cast to another dtype after quantisation"):
        layer(torch.randn(2, 16))
