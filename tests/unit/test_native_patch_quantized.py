"""VDN-H3 as a patch on the host's native H3 model whose block linears (``qkv_proj``, ``out_proj``, ``fc1``, ``fc2``)
are quantised, in fp32 on the CPU, each format at its own tolerance (``tests/native_quantized.py`` builds the
layers and says how the host holds them):

  * ``scaled_fp8`` and ``comfy_quant``: e4m3 weights with a per-tensor scale in the test host's own ``comfy.ops``
    layers (ComfyUI 0.3.75, its two fp8 manual-cast forms), cast up to fp32 at each call;
  * ``int8_convrot``: comfy-kitchen ``TensorWiseINT8Layout`` ConvRot weights (per-row scales) in a host
    ``MixedPrecisionOps.Linear``, run by comfy-kitchen's int8 matmul (its eager backend on the CPU).

For each format and request (T2VA, FL2VA with a first and a last keyframe, Ref2VA with image, video and audio
references): the patched native model equals the pack's own VDN-H3 DiT holding the same quantised layers (or, for
int8, the same ``QuantizedTensor`` in the pack's own kind of layer); it lies within what the format rounds of the
pack's DiT holding the weights those layers stand for; it runs every quantised layer once per evaluation, through
the layer, never reading a layer's ``weight`` itself; and the quantised weights differ measurably from the
originals (a patch reading an unquantised copy would fail the first check).
"""

import pytest
import tiny_dit
import torch
import torch.nn.functional as F
from native_quantized import (
    Request,
    block_layer_names,
    fp32_models,
    host_fp8,
    kitchen_int8,
    layer_inputs,
    relative,
)
from test_native_patch import CFG, SHIFTS, TEXT, WINDOW, fl2va_request, latents, patched_options, ref2va_request

from h3_core.models.native_hybrid import NativeAttentionSource
from h3_core.pipeline.packing import pack_sequence

FORMATS = ("scaled_fp8", "comfy_quant", "int8_convrot")
NAMES = block_layer_names(CFG.layers)
# The patched native model against the pack's DiT on the same layers: both run the same layers on the same
# activations and differ only by fp32 rounding where their arithmetic is ordered differently (the native's
# split-half norm and rotation from its table, its row-segment modulation): measured 1.6e-7 to 2.7e-7 of the
# largest velocity (the fp32 form of test_native_patch's 1e-12 in fp64), bounded with 40x to spare.
TIGHT = 1e-5
# int8 ConvRot rounds each matmul's input: every row, rotated by 4x4 Hadamard blocks, to 127 steps of its largest
# magnitude, an error of at most half a step (1/254 of the row's largest value) per element; the weights' own
# rounding is in the dequantised reference too, so only the activations' rounding separates the two. One layer's
# output then errs by about 1/254 of its scale at most; eight such layers in sequence, with attention and the
# SwiGLU between them, stay within 2e-2 (5x one layer's bound; measured 1.4e-3 to 2.3e-3). And not below 1e-4
# (ten times TIGHT): the int8 kernel ran, not a dequantised matmul, which would agree to fp32 rounding.
INT8_BOUNDS = (1e-4, 2e-2)
# A patch reading an unquantised copy of the weights would agree with the unquantised model to TIGHT; the
# quantised models differ from it by more than ten times that (measured 7.5e-3 to 1.1e-2 for fp8, 1.8e-3 to
# 2.9e-3 for int8).
MEASURABLE = 10 * TIGHT


def to32(t):
    return t.float()


def t2va():
    video, audio, text = (to32(t) for t in latents(12, 2, 4, 7))
    return Request(video, audio, text, 0.6, pack_sequence(torch.ones(TEXT, dtype=torch.long), 12, 2, 4, 7), {})


def fp32(value):
    """A request's tensors (in dicts and lists) in fp32."""
    if isinstance(value, dict):
        return {k: fp32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fp32(v) for v in value]
    return to32(value) if isinstance(value, torch.Tensor) else value


def fl2va():
    """A first and a last keyframe (the last with its sound): ``test_native_patch``'s first-last FL2VA, in fp32."""
    video, audio, text, payload, packed = fl2va_request((0, 44))
    return Request(to32(video), to32(audio), to32(text), 0.7, packed, fp32(payload))


def ref2va():
    """Image, video-with-sound and sound references: ``test_native_patch``'s Ref2VA, in fp32."""
    video, audio, text, payload, packed = ref2va_request()
    return Request(to32(video), to32(audio), to32(text), 0.5, packed, fp32(payload))


REQUESTS = {"t2va": t2va, "fl2va": fl2va, "ref2va": ref2va}


@pytest.fixture(scope="module")
def base():
    """The tiny VDN-H3 DiT in fp32, the native model and the branch weights holding its (unquantised) weights."""
    return fp32_models(tiny_dit.model(hybrid=True), CFG)


@pytest.fixture(scope="module", params=FORMATS)
def quantised(request, base):
    pack = base[0]
    if request.param == "int8_convrot":
        return request.param, kitchen_int8(pack, CFG)
    return request.param, host_fp8(pack, CFG, request.param)


def run_native(q, branch, request):
    """The patched native model on ``request``, each quantised layer's calls counted afresh."""
    for guard in q.guards.values():
        guard.calls, guard.outside = 0, []
    return request.native_rows(q.native, branch, patched_options)


def test_the_quantised_weights_differ_from_the_originals(quantised, base):
    _, q = quantised
    pack = base[0]
    for name in NAMES:
        original = pack.get_parameter(f"{name}.weight")
        stands_for = q.dequantised.get_parameter(f"{name}.weight")
        error = float((stands_for - original).abs().max() / original.abs().max())
        # e4m3 keeps 3 mantissa bits (up to 1/16 relative), int8 127 steps of each row's largest value
        assert 1e-3 < error < 0.07, (name, error)
        assert torch.equal(q.native_dequantised.get_parameter(f"{name}.weight"), stands_for)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_patched_native_equals_the_packs_dit_holding_the_same_layers(quantised, base, name):
    """(a) Native model + patch against the pack's DiT holding the same quantised layers: each layer called once,
    through its own forward, on the activations the pack gives it; the velocities equal to fp32 rounding."""
    fmt, q = quantised
    _, plain_native, branch = base
    request = REQUESTS[name]()
    with layer_inputs(q.native, NAMES) as native_inputs:
        got = run_native(q, branch, request)
    for layer, guard in q.guards.items():
        assert guard.calls == 1, (layer, guard.calls)  # qkv once (q, k, v sliced from it), out_proj once, fc1, fc2
        assert guard.outside == [], f"{layer}.weight read outside the layer by {guard.outside}"
    # int8 rounds the activations: an element on a rounding boundary may land on either side in the two models (their
    # activations differ by fp32 rounding), one step of int8 moving the velocities by up to 3e-3. So the pack's int8
    # layers compute on the very activations the native's were given, once those are checked to agree to TIGHT; the
    # fp8 layers only cast their weights, which no such rounding follows, and run on the pack's own activations.
    given = native_inputs if fmt == "int8_convrot" else None
    with layer_inputs(q.held, NAMES, given) as pack_inputs:
        want = request.pack_rows(q.held, plain_native, WINDOW, SHIFTS)
    assert pack_inputs.keys() == native_inputs.keys() == set(NAMES)
    for layer in NAMES:
        assert relative((native_inputs[layer],), (pack_inputs[layer],)) <= TIGHT, layer
    error = relative(got, want)
    assert error <= TIGHT, error
    # the quantisation shows: against the unquantised model the same velocities are measurably off
    original = request.pack_rows(base[0], plain_native, WINDOW, SHIFTS)
    assert relative(got, original) > MEASURABLE
    assert relative(want, original) > MEASURABLE


@pytest.mark.parametrize("name", list(REQUESTS))
def test_patched_native_within_the_formats_rounding_of_the_dequantised_weights(quantised, base, name):
    """(b) Native model + patch with the quantised layers against the pack's DiT (and the native model) holding the
    weights those layers stand for, as plain fp32 linears."""
    fmt, q = quantised
    _, plain_native, branch = base
    request = REQUESTS[name]()
    got = run_native(q, branch, request)
    native_dense = request.native_rows(q.native_dequantised, branch, patched_options)
    pack_dense = request.pack_rows(q.dequantised, plain_native, WINDOW, SHIFTS)
    if fmt == "comfy_quant":
        # cast_bias_weight dequantises (codes.to(fp32) · scale, the dequantised weight bit for bit) and F.linear runs
        # on it: nothing else is rounded, so the native model equals its dense form exactly
        assert all(torch.equal(a, b) for a, b in zip(got, native_dense))
        assert relative(got, pack_dense) <= TIGHT
    elif fmt == "scaled_fp8":
        # only a cast; the host multiplies the scale into the input where the weight has more elements (x·s then
        # · codes, against x · (codes·s)): one fp32 rounding per product apart, within TIGHT
        assert relative(got, native_dense) <= TIGHT
        assert relative(got, pack_dense) <= TIGHT
    else:
        low, high = INT8_BOUNDS
        assert low < relative(got, native_dense) < high
        assert low < relative(got, pack_dense) < high


def test_a_patch_taking_a_layers_weight_is_caught_where_its_result_would_agree(base, monkeypatch):
    """The guard's own check: a projection that takes ``qkv_proj.weight`` itself (here the host's fp8
    ``QuantizedTensor``, which ``F.linear`` dequantises, so the velocities agree bit for bit) is recorded, and the
    layer is never called."""
    _, _, branch = base
    q = host_fp8(base[0], CFG, "comfy_quant")
    request = t2va()
    through_layers = run_native(q, branch, request)
    assert all(not guard.outside for guard in q.guards.values())
    monkeypatch.setattr(
        NativeAttentionSource, "projection_input", lambda self, x: F.linear(x, self.native.qkv_proj.weight)
    )
    taking_weights = run_native(q, branch, request)
    assert all(torch.equal(a, b) for a, b in zip(taking_weights, through_layers))
    for name, guard in q.guards.items():
        if name.endswith("qkv_proj"):
            assert guard.calls == 0 and len(guard.outside) == 1 and __file__ in guard.outside[0], guard.outside
        else:
            assert guard.calls == 1 and not guard.outside
