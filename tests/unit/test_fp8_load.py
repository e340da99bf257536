"""load_h3_model(linears="fp8") (h3_core.formats.checkpoints): the big linears loaded as Fp8Linear.

An fp8-scaled file's e4m3 codes and scales go in as they are, re-laid out per layout (ComfyUI per tensor and
per row, the legacy ``scaled_fp8`` form, the official shards' per-head qkv interleave, diffusers' separately
scaled q, k, v and ``[up; gate]`` FFN): checked bit for bit against the file, and the model's forward against
an fp32/bf16 model given ``Fp8Linear.from_scaled`` layers built by hand from the file. LoRAs merge before
quantisation: a merged layer equals quantising ``W + s·BA`` computed here. Dense and VDN-H3 models;
``linears="dtype"`` is unchanged.
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_core.attention import WindowSpec
from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import load_h3_model
from h3_core.formats.dit import diffusers_layout
from h3_core.formats.fp8_scaled import Fp8ScaledView
from h3_core.formats.staged_read import StagedReader
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.models.fp8_linear import Fp8Linear
from h3_core.models.hybrid import HybridContext
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
CURVE_CFG = replace(CFG, adaln_curve_grid=9, time_embed=4)
E4M3 = torch.float8_e4m3fn
FP8_WEIGHT = re.compile(
    r"(token_refiner\.)?blocks\.\d+\.(attn\.(qkv_proj|out_proj|to_out_linear)|mlp\.(fc1|fc2))"
    r"\.weight"
)
BRANCH_PARTS = (".attn.softmax_gate.", ".attn.to_out_linear.", ".attn.linear_attention.")
SIDECAR = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)


# ---- weights and their fp8 form -----------------------------------------------------------------


def random_state(cfg: DiTConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random model's state in native names; the fp8 layers' rows span a factor 16 in magnitude, so per-row
    scales differ from row to row."""
    torch.manual_seed(seed)
    model = H3DiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 100)
    for key in fp8_keys(state):
        state[key] = state[key] * 2.0 ** torch.randint(-2, 3, (state[key].shape[0], 1), generator=g).float()
    return state


def fp8_keys(state) -> list[str]:
    return [k for k in state if FP8_WEIGHT.fullmatch(k)]


def quantise_for_file(w: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What a file writer does: scale amax / 448 per tensor (shape []) or per row ([rows]), codes w / scale."""
    scale = ((w.abs().amax(dim=1) if per_row else w.abs().amax()) / 448).float()
    return (w / (scale[:, None] if per_row else scale)).to(E4M3), scale


def rows_of(scale: torch.Tensor, rows: int) -> torch.Tensor:
    return scale.float().reshape(-1).expand(rows) if scale.numel() == 1 else scale.float().reshape(rows)


def native_fp8(state, per_row: bool, split_qkv: bool = False) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each fp8 layer's weight as stored parts (codes, scale): one part, or with ``split_qkv`` three for a
    qkv_proj (q, k and v scaled separately, as diffusers' to_q / to_k / to_v)."""
    out = {}
    for key in fp8_keys(state):
        w = state[key]
        parts = w.chunk(3) if split_qkv and key.endswith("qkv_proj.weight") else (w,)
        out[key] = [quantise_for_file(p, per_row) for p in parts]
    return out


def expected_codes(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's codes [out, in] and per-row scales [out] a key's parts stand for, in native row order."""
    return (torch.cat([c for c, _ in parts]), torch.cat([rows_of(s, c.shape[0]) for c, s in parts]))


def interleave_rows(t: torch.Tensor, cfg: DiTConfig) -> torch.Tensor:
    """Stacked [q; k; v] rows → the official shards' per-head [q_h; k_h; v_h] (any trailing shape)."""
    return t.reshape(3, cfg.heads, cfg.head_dim, -1).transpose(0, 1).reshape(t.shape).contiguous()


def deinterleave_rows(t: torch.Tensor, cfg: DiTConfig) -> torch.Tensor:
    return t.reshape(cfg.heads, 3, cfg.head_dim, -1).transpose(0, 1).reshape(t.shape).contiguous()


def swap_row_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2)
    return torch.cat([second, first])


# ---- files ----------------------------------------------------------------------------------------


def comfy_file(state, fp8, prefix: str = "", legacy: bool = False, scale_shape=lambda s: s) -> dict:
    """ComfyUI's per-layer form (``weight_scale``, ``input_scale``, ``comfy_quant``) or the legacy one
    (``scale_weight``, ``scale_input``, a ``scaled_fp8`` marker) of the native state."""
    out = {}
    for key, value in state.items():
        if key not in fp8:
            out[prefix + key] = value
            continue
        ((codes, scale),) = fp8[key]
        layer = prefix + key.removesuffix(".weight")
        out[layer + ".weight"] = codes
        if legacy:
            out[layer + ".scale_weight"], out[layer + ".scale_input"] = scale, torch.tensor(1.0)
        else:
            out[layer + ".weight_scale"], out[layer + ".input_scale"] = scale_shape(scale), torch.tensor(1.0)
            out[layer + ".comfy_quant"] = SIDECAR.clone()
    if legacy:
        out["scaled_fp8"] = torch.empty(0, dtype=E4M3)
    return out


def official_file(state, fp8, cfg: DiTConfig) -> dict:
    """ComfyUI's form with every qkv_proj's code rows (and per-row scales) interleaved per head."""
    out = comfy_file(state, fp8)
    for key in fp8:
        if key.endswith("qkv_proj.weight"):
            out[key] = interleave_rows(out[key].view(torch.uint8), cfg).view(E4M3)
            scale_key = key.removesuffix(".weight") + ".weight_scale"
            if out[scale_key].numel() > 1:
                out[scale_key] = interleave_rows(out[scale_key], cfg).reshape(-1)
    return out


def diffusers_file(state, fp8, cfg: DiTConfig) -> dict:
    """diffusers names (from the key map's table); q, k, v as separately scaled to_q / to_k / to_v, the FFN's
    input projection stored [up; gate] with its per-row scales swapped the same way."""
    keymap = diffusers_layout(cfg)
    out = {}
    for key, value in state.items():
        sources, _ = keymap.sources_for(key)
        if key not in fp8:
            if sources:
                out[sources[0]] = value
            continue
        for source, (codes, scale) in zip(sources, fp8[key], strict=True):
            if key.endswith("mlp.fc1.weight"):
                codes = swap_row_halves(codes.view(torch.uint8)).view(E4M3)
                scale = swap_row_halves(scale) if scale.numel() > 1 else scale
            layer = source.removesuffix(".weight")
            out[source], out[layer + ".weight_scale"], out[layer + ".comfy_quant"] = codes, scale, SIDECAR.clone()
    return out


def split_branch(state) -> tuple[dict, dict]:
    """A hybrid model's state as the base DiT's and the linear-branch file's (``transformer_blocks.`` names)."""
    base = {k: v for k, v in state.items() if not any(p in k for p in BRANCH_PARTS)}
    branch = {"transformer_blocks." + k.removeprefix("blocks."): v for k, v in state.items() if k not in base}
    return base, branch


def write(tensors: dict, path: Path, shards: int = 1) -> Path:
    """One file, or a folder of ``shards`` files named as the official release names them."""
    if shards == 1:
        save_file(tensors, str(path))
        return path
    path.mkdir(parents=True)
    keys = sorted(tensors)
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({key: tensors[key] for key in keys[k::shards]}, str(path / name))
    return path


def read_back(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def codes_by_hand(path: Path, layout: str, key: str, cfg: DiTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp8 layer's codes and scale read back from the file with safetensors alone and re-laid out here."""
    tensors = read_back(path)
    if layout in ("comfy", "comfy prefixed", "legacy"):
        prefix = "model.diffusion_model." if layout == "comfy prefixed" else ""
        layer = prefix + key.removesuffix(".weight")
        return tensors[layer + ".weight"], tensors[layer + (".scale_weight" if layout == "legacy" else ".weight_scale")]
    if layout == "official":
        layer = key.removesuffix(".weight")
        codes, scale = tensors[key], tensors[layer + ".weight_scale"]
        if key.endswith("qkv_proj.weight"):
            codes = deinterleave_rows(codes.view(torch.uint8), cfg).view(E4M3)
            scale = scale if scale.numel() == 1 else deinterleave_rows(scale, cfg).reshape(-1)
        return codes, scale
    assert layout == "diffusers"
    sources, _ = diffusers_layout(cfg).sources_for(key)
    codes = [tensors[s] for s in sources]
    scales = [rows_of(tensors[s.removesuffix(".weight") + ".weight_scale"], c.shape[0]) for s, c in zip(sources, codes)]
    codes, scale = torch.cat([c.view(torch.uint8) for c in codes]), torch.cat(scales)
    if key.endswith("mlp.fc1.weight"):
        codes, scale = swap_row_halves(codes), swap_row_halves(scale)
    return codes.view(E4M3), scale


# ---- inputs and comparisons -----------------------------------------------------------------------


def run(model: H3DiT, hybrid: bool, dtype=torch.float32):
    packed = pack_sequence(torch.ones(4, dtype=torch.long), 8, 2, 4, 3)
    g = torch.Generator().manual_seed(6)
    T = packed.positions.shape[0]
    timestep_index = torch.zeros(T, dtype=torch.long)
    timestep_index[packed.audio_index] = 1
    args = (
        torch.randn(packed.video_index.numel(), 96, generator=g, dtype=dtype),
        torch.randn(packed.audio_index.numel(), 32, generator=g, dtype=dtype),
        torch.randn(4, CFG.text_dim, generator=g, dtype=dtype),
        torch.tensor([0.3, 0.8]),
        timestep_index,
        packed.tags,
        packed.positions,
        packed.video_index,
        packed.audio_index,
        packed.text_index,
    )
    # a window of 3 of the 8 frames: the linear branch (and so to_out_linear) runs
    ctx = HybridContext(packed.layout, WindowSpec(1, 0, "both"), "ref", (0, 4)) if hybrid else None
    with torch.no_grad():
        return model(*args, hybrid=ctx)


def fp8_layer_names(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]


def assert_same_model(a, b, hybrid: bool, dtype=torch.float32):
    """Same modules, tensors bit for bit in the same dtypes, and the same forward bit for bit."""
    assert fp8_layer_names(a) == fp8_layer_names(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(
            sa[key].view(torch.uint8) if sa[key].dtype == E4M3 else sa[key],
            sb[key].view(torch.uint8) if sb[key].dtype == E4M3 else sb[key],
        ), key
    for x, y in zip(run(a, hybrid, dtype), run(b, hybrid, dtype)):
        assert torch.isfinite(x).all() and torch.equal(x, y)


def set_layer(model, name: str, layer) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, layer)


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """The fp64 values of e4m3fn codes, decoded from their bits (sign, 4 exponent bits of bias 7, 3 mantissa)."""
    bits = codes.view(torch.uint8).long()
    sign = 1.0 - 2.0 * (bits >> 7).double()
    exponent, mantissa = (bits >> 3) & 15, (bits & 7).double()
    normal = 2.0 ** (exponent.double() - 7) * (1 + mantissa / 8)
    subnormal = 2.0**-6 * mantissa / 8
    return sign * torch.where(exponent > 0, normal, subnormal)


def quantised_here(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation of an fp32 weight from the definition: scale = amax / 448 in fp32, w / scale
    rounded to fp32, then to the nearest e4m3 value, ties to the even code (fp64 values, fp32 scales)."""
    scale = w.abs().amax(dim=1) / 448
    q = (w / scale[:, None]).double()
    grid = e4m3_value(torch.arange(127, dtype=torch.uint8).view(E4M3))  # every finite non-negative value
    upper = torch.searchsorted(grid, q.abs().clamp(max=448)).clamp(max=126)
    lower = (upper - 1).clamp(min=0)
    d_low, d_up = q.abs() - grid[lower], grid[upper] - q.abs()
    pick = torch.where((d_up < d_low) | ((d_up == d_low) & (upper % 2 == 0)), upper, lower)
    return torch.sign(q) * grid[pick], scale


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense():
    return random_state(CFG, 0)


@pytest.fixture(scope="module")
def hybrid():
    return random_state(replace(CFG, hybrid=True), 2)


@pytest.fixture(scope="module")
def written(tmp_path_factory, dense, hybrid):
    """name -> (path, layout read by hand, the fp8 parts written, qkv_interleaved, cfg)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    fp8 = native_fp8(dense, per_row=False)
    out["comfy per tensor"] = (write(comfy_file(dense, fp8), root / "comfy.safetensors"), "comfy", fp8, False, CFG)
    fp8 = native_fp8(dense, per_row=True)
    out["comfy per row, prefixed"] = (
        write(
            comfy_file(dense, fp8, "model.diffusion_model.", scale_shape=lambda s: s.reshape(-1, 1)),
            root / "prefixed.safetensors",
        ),
        "comfy prefixed",
        fp8,
        False,
        CFG,
    )
    fp8 = native_fp8(dense, per_row=False)
    out["legacy scaled_fp8"] = (
        write(comfy_file(dense, fp8, legacy=True), root / "legacy.safetensors"),
        "legacy",
        fp8,
        False,
        CFG,
    )
    fp8 = native_fp8(dense, per_row=True)
    out["official shards"] = (
        write(official_file(dense, fp8, CFG), root / "official", shards=2),
        "official",
        fp8,
        True,
        CFG,
    )
    fp8 = native_fp8(dense, per_row=False, split_qkv=True)
    fp8 = {
        k: (v if not k.endswith("fc1.weight") else [quantise_for_file(dense[k], per_row=True)]) for k, v in fp8.items()
    }
    out["diffusers"] = (
        write(diffusers_file(dense, fp8, CFG), root / "diffusers.safetensors"),
        "diffusers",
        fp8,
        False,
        CFG,
    )
    pruned = random_state(CURVE_CFG, 1)
    fp8 = native_fp8(pruned, per_row=True)
    out["pruned"] = (write(comfy_file(pruned, fp8), root / "pruned.safetensors"), "comfy", fp8, False, CURVE_CFG)
    base, branch = split_branch(hybrid)
    base_fp8, branch_fp8 = native_fp8(base, per_row=True), native_fp8(hybrid, per_row=False)
    branch_fp8 = {
        "transformer_blocks." + k.removeprefix("blocks."): v for k, v in branch_fp8.items() if "to_out_linear" in k
    }
    out["vdn base"] = (write(comfy_file(base, base_fp8), root / "vdn_base.safetensors"), "comfy", base_fp8, False, CFG)
    out["vdn official base"] = (
        write(official_file(base, base_fp8, CFG), root / "vdn_official", shards=2),
        "official",
        base_fp8,
        True,
        CFG,
    )
    out["vdn branch"] = (
        write({**branch, "__window__": torch.tensor([1, 5])}, root / "branch.safetensors"),
        None,
        {},
        False,
        CFG,
    )
    out["vdn fp8 branch"] = (
        write({**comfy_file(branch, branch_fp8), "__window__": torch.tensor([1, 5])}, root / "branch_fp8.safetensors"),
        None,
        branch_fp8,
        False,
        CFG,
    )
    partial = {
        k: v
        for k, v in native_fp8(dense, per_row=False).items()
        if k.startswith("blocks.") and k.endswith(("qkv_proj.weight", "fc1.weight", "fc2.weight"))
    }
    out["partial"] = (write(comfy_file(dense, partial), root / "partial.safetensors"), "comfy", partial, False, CFG)
    out["bf16"] = (write({k: v.bfloat16() for k, v in dense.items()}, root / "bf16.safetensors"), None, {}, False, CFG)
    return out


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """A ComfyUI LoRA on block 0's fused qkv and block 1's fc2, and a peft adapter on block 0's to_q and
    ff.net.0.proj (diffusers names): block 0's qkv gets both, in the order given."""
    root = tmp_path_factory.mktemp("fp8_loras")
    g = torch.Generator().manual_seed(11)
    inner = CFG.heads * CFG.head_dim

    def pair(rows, cols, rank=3):
        return torch.randn(rank, cols, generator=g), torch.randn(rows, rank, generator=g) * 0.1

    comfy = {
        "blocks.0.attn.qkv_proj": (*pair(3 * inner, CFG.hidden), 1.5),
        "blocks.1.mlp.fc2": (*pair(CFG.hidden, CFG.ffn), 6.0),
    }
    tensors = {}
    for module, (A, B, alpha) in comfy.items():
        tensors[f"diffusion_model.{module}.lora_down.weight"] = A
        tensors[f"diffusion_model.{module}.lora_up.weight"] = B
        tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(root / "style.safetensors"))
    peft = {
        "transformer_blocks.0.attn.to_q": pair(inner, CFG.hidden),
        "transformer_blocks.0.ff.net.0.proj": pair(2 * CFG.ffn, CFG.hidden),
    }
    folder = root / "adapter"
    folder.mkdir()
    tensors = {
        f"base_model.model.{m}.lora_{x}.weight": t for m, (A, B) in peft.items() for x, t in (("A", A), ("B", B))
    }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 3, "lora_alpha": 6}))
    return {"comfy": root / "style.safetensors", "comfy modules": comfy, "peft": folder, "peft modules": peft}


# ---- codes as they are ----------------------------------------------------------------------------

DENSE = ["comfy per tensor", "comfy per row, prefixed", "legacy scaled_fp8", "official shards", "diffusers", "pruned"]


@pytest.mark.parametrize("name", DENSE)
def test_codes_and_scales_are_the_files_bit_for_bit(written, name):
    path, _, fp8, interleaved, cfg = written[name]
    model = load_h3_model(path, dtype=torch.float32, cfg=CFG, linears="fp8")
    assert model.linears == "fp8 (codes from the file)"
    assert set(model.fp8_layers) == {k.removesuffix(".weight") for k in fp8} == set(fp8_layer_names(model))
    assert set(model.fp8_layers.values()) == {"codes from the file"}
    # the dequantising view's weights, as linears="dtype" reads them in fp32
    dequantised = load_h3_model(path, dtype=torch.float32, cfg=cfg, qkv_interleaved=interleaved).state_dict()
    for key, parts in fp8.items():
        layer = model.get_submodule(key.removesuffix(".weight"))
        codes, scale = expected_codes(parts)
        assert layer.weight.dtype == E4M3 and torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8)), key
        assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale), key
        assert torch.equal(layer.dequantized_weight(), dequantised[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [n for n in DENSE if n != "pruned"])  # a pruned model does not run in bf16 yet
def test_forward_equals_from_scaled_layers_built_by_hand(written, name, dtype):
    path, layout, fp8, interleaved, cfg = written[name]
    model = load_h3_model(path, dtype=dtype, cfg=CFG, linears="fp8")
    by_hand = load_h3_model(path, dtype=dtype, cfg=cfg, qkv_interleaved=interleaved)
    for key in fp8:
        codes, scale = codes_by_hand(path, layout, key, cfg)
        set_layer(by_hand, key.removesuffix(".weight"), Fp8Linear.from_scaled(codes, scale, compute_dtype=dtype))
    assert_same_model(model, by_hand, hybrid=False, dtype=dtype)


def test_codes_are_never_dequantised_on_the_way_in(written, monkeypatch):
    """No fp8 tensor of the file goes through the dequantising read: no fp32 copy of those weights is made."""
    reads, dequantised = [], []
    original = Fp8ScaledView.get

    def recording_get(self, key):
        (dequantised if key in self._scales else reads).append(key)
        return original(self, key)

    monkeypatch.setattr(Fp8ScaledView, "get", recording_get)
    for name in ("comfy per tensor", "legacy scaled_fp8", "official shards", "diffusers"):
        reads.clear()
        load_h3_model(written[name][0], dtype=torch.bfloat16, cfg=CFG, linears="fp8")
        assert reads and dequantised == [], name


def test_layers_not_fp8_in_the_file_are_quantised_at_load(written, dense):
    path, _, partial, *_ = written["partial"]
    model = load_h3_model(path, dtype=torch.float32, cfg=CFG, linears="fp8")
    names = fp8_layer_names(model)
    from_file = {k.removesuffix(".weight") for k in partial}
    assert len(names) == 2 * 4 + 2 * 4 and from_file < set(names)
    assert (
        model.linears == f"fp8 (codes from the file: {len(from_file)} layers; quantised at load: "
        f"{len(names) - len(from_file)} layers)"
    )
    for name in names:
        layer = model.get_submodule(name)
        if name in from_file:
            assert model.fp8_layers[name] == "codes from the file"
            continue
        how = model.fp8_layers[name]
        assert how.startswith("quantised at load (") and "not fp8 in the file" in how, name
        values, scale = quantised_here(dense[name + ".weight"])
        assert torch.equal(layer.weight.double(), values) and torch.equal(layer.weight_scale, scale), name


def test_a_plain_file_is_quantised_at_load(written, dense):
    model = load_h3_model(written["bf16"][0], dtype=torch.bfloat16, cfg=CFG, linears="fp8")
    assert model.linears == "fp8 (quantised at load)" and len(model.fp8_layers) == 16
    for name in fp8_layer_names(model):
        values, scale = quantised_here(dense[name + ".weight"].bfloat16().float())
        layer = model.get_submodule(name)
        assert layer.compute_dtype == torch.bfloat16
        assert torch.equal(layer.weight.double(), values) and torch.equal(layer.weight_scale, scale), name
    plain = load_h3_model(written["bf16"][0], dtype=torch.bfloat16, cfg=CFG).state_dict()
    assert all(
        torch.equal(value, plain[key])
        for key, value in model.state_dict().items()
        if not key.endswith(("weight_scale",)) and value.dtype != E4M3
    )


def test_e5m2_layers_are_dequantised_and_requantised(written, dense, tmp_path):
    path, _, fp8, *_ = written["comfy per tensor"]
    tensors = read_back(path)
    w = dense["blocks.0.mlp.fc2.weight"]
    scale = (w.abs().amax() / 57344).float()  # e5m2's largest value
    tensors["blocks.0.mlp.fc2.weight"] = (w / scale).to(torch.float8_e5m2)
    tensors["blocks.0.mlp.fc2.weight_scale"] = scale
    tensors["blocks.0.mlp.fc2.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e5m2"}'), dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "e5m2.safetensors"))
    model = load_h3_model(tmp_path / "e5m2.safetensors", dtype=torch.float32, cfg=CFG, linears="fp8")
    assert model.fp8_layers["blocks.0.mlp.fc2"] == (
        "quantised at load ('blocks.0.mlp.fc2.weight' is stored as torch.float8_e5m2, Fp8Linear holds e4m3 codes)"
    )
    values, row_scale = quantised_here(tensors["blocks.0.mlp.fc2.weight"].float() * scale)
    layer = model.blocks[0].mlp.fc2
    assert torch.equal(layer.weight.double(), values) and torch.equal(layer.weight_scale, row_scale)
    assert model.linears == "fp8 (codes from the file: 15 layers; quantised at load: 1 layer)"


def test_layer_codes_takes_row_layouts_and_refuses_anything_else(written):
    """Directly on a file's view: a rule that re-orders whole rows keeps the codes (exactly); one that moves
    columns, or does arithmetic, gives a reason, so the loader requantises that layer."""
    from h3_core.formats.files import CheckpointFiles
    from h3_core.formats.fp8_scaled import LayerCodes, fp8_scaled_view, layer_codes

    path, _, fp8, *_ = written["comfy per row, prefixed"]
    view = fp8_scaled_view(CheckpointFiles(path))
    key = "model.diffusion_model.blocks.0.mlp.fc2.weight"
    codes, scale = expected_codes(fp8["blocks.0.mlp.fc2.weight"])
    shape = tuple(codes.shape)
    found = layer_codes(view, (key,), lambda parts: parts[0].flip(0), shape)
    assert isinstance(found, LayerCodes)
    assert torch.equal(found.codes.view(torch.uint8), codes.view(torch.uint8).flip(0))
    assert torch.equal(found.scale, scale.flip(0))
    assert torch.equal(found.codes.float() * found.scale[:, None], view.get(key).flip(0))
    for rule in (lambda parts: parts[0].flip(1), lambda parts: parts[0] * 2, lambda parts: parts[0].t().contiguous()):
        assert layer_codes(view, (key,), rule, shape) == "the layout's rule for it is not a re-layout of rows"
    assert (
        layer_codes(view, ("model.diffusion_model.condition_proj.weight",), None, shape)
        == "'model.diffusion_model.condition_proj.weight' is not fp8 in the file"
    )
    assert (
        layer_codes(CheckpointFiles(written["bf16"][0]), ("blocks.0.mlp.fc2.weight",), None, shape)
        == "not fp8 in the file"
    )


# ---- LoRAs merge before quantisation --------------------------------------------------------------


def test_loras_merge_in_fp32_before_quantising(written, loras):
    path, _, fp8, *_ = written["comfy per tensor"]
    chosen = [(loras["comfy"], -0.7), (loras["peft"], 1.3)]
    model = load_h3_model(path, loras=chosen, dtype=torch.bfloat16, cfg=CFG, linears="fp8")
    assert [(m.lora.path.name, m.weights) for m in model.merged_loras] == [
        ("style.safetensors", 2),
        ("adapter_model.safetensors", 2),
    ]
    touched = {"blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2", "blocks.0.mlp.fc1"}
    assert {n for n, how in model.fp8_layers.items() if how != "codes from the file"} == touched
    assert all(model.fp8_layers[n] == "quantised at load (LoRA merged)" for n in touched)
    assert model.linears == "fp8 (codes from the file: 13 layers; quantised at load: 3 layers)"
    # W (the file's dequantised weight, fp32) + each update in fp32, in the order given, then quantised
    want = {}
    for name in touched:
        codes, scale = expected_codes(fp8[name + ".weight"])
        want[name] = codes.float() * scale[:, None]
    (A, B, alpha) = loras["comfy modules"]["blocks.0.attn.qkv_proj"]
    want["blocks.0.attn.qkv_proj"] = want["blocks.0.attn.qkv_proj"] + (B @ A) * (-0.7 * alpha / 3)
    (A, B, alpha) = loras["comfy modules"]["blocks.1.mlp.fc2"]
    want["blocks.1.mlp.fc2"] = want["blocks.1.mlp.fc2"] + (B @ A) * (-0.7 * alpha / 3)
    A, B = loras["peft modules"]["transformer_blocks.0.attn.to_q"]
    q_rows = slice(0, CFG.heads * CFG.head_dim)
    want["blocks.0.attn.qkv_proj"][q_rows] = want["blocks.0.attn.qkv_proj"][q_rows] + (B @ A) * (1.3 * 6 / 3)
    A, B = loras["peft modules"]["transformer_blocks.0.ff.net.0.proj"]  # diffusers [up; gate] rows → [gate; up]
    want["blocks.0.mlp.fc1"] = want["blocks.0.mlp.fc1"] + (swap_row_halves(B) @ A) * (1.3 * 6 / 3)
    for name in touched:
        layer = model.get_submodule(name)
        values, scale = quantised_here(want[name])
        assert torch.equal(layer.weight.double(), values) and torch.equal(layer.weight_scale, scale), name
    # the untouched layers keep the file's codes
    for key, parts in fp8.items():
        if key.removesuffix(".weight") not in touched:
            codes, scale = expected_codes(parts)
            layer = model.get_submodule(key.removesuffix(".weight"))
            assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(layer.weight_scale, scale)


def test_loras_on_other_weights_merge_as_with_linears_dtype(written, loras, tmp_path):
    """A LoRA on a weight that stays in dtype (condition_proj) merges as the dtype path merges it."""
    path = written["comfy per tensor"][0]
    g = torch.Generator().manual_seed(12)
    A, B = torch.randn(2, CFG.text_dim, generator=g), torch.randn(CFG.hidden, 2, generator=g)
    lora = tmp_path / "cond.safetensors"
    save_file(
        {"diffusion_model.condition_proj.lora_down.weight": A, "diffusion_model.condition_proj.lora_up.weight": B},
        str(lora),
    )
    chosen = [(lora, 0.5), (loras["comfy"], 1.0)]
    fp8 = load_h3_model(path, loras=chosen, dtype=torch.bfloat16, cfg=CFG, linears="fp8").state_dict()
    plain = load_h3_model(path, loras=chosen, dtype=torch.bfloat16, cfg=CFG).state_dict()
    assert torch.equal(fp8["condition_proj.weight"], plain["condition_proj.weight"])
    unmerged = load_h3_model(path, cfg=CFG).state_dict()["condition_proj.weight"]
    assert not torch.equal(plain["condition_proj.weight"], unmerged)


def test_a_bad_lora_is_refused_before_any_weight_is_read(written, tmp_path, monkeypatch):
    lora = tmp_path / "wrong.safetensors"
    save_file(
        {
            "diffusion_model.blocks.0.mlp.fc2.lora_down.weight": torch.zeros(2, 7),
            "diffusion_model.blocks.0.mlp.fc2.lora_up.weight": torch.zeros(CFG.hidden, 2),
        },
        str(lora),
    )
    reads = []
    original = Fp8ScaledView.stored
    monkeypatch.setattr(Fp8ScaledView, "stored", lambda self, key: reads.append(key) or original(self, key))
    with pytest.raises(H3InputError, match=r"loras\[0\] .*the update of 'blocks\.0\.mlp\.fc2' is \(24, 2\) @ \(2, 7\)"):
        load_h3_model(written["comfy per tensor"][0], loras=[(lora, 1.0)], cfg=CFG, linears="fp8")
    assert reads == []


# ---- VDN-H3 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("base_name", ["vdn base", "vdn official base"])
@pytest.mark.parametrize("branch_name", ["vdn branch", "vdn fp8 branch"])
def test_vdn_with_a_branch_file_equals_layers_built_by_hand(written, hybrid, base_name, branch_name):
    base, layout, base_fp8, interleaved, _ = written[base_name]
    branch, _, branch_fp8, *_ = written[branch_name]
    model = load_h3_model(base, branch=branch, dtype=torch.float32, cfg=CFG, linears="fp8")
    assert model.cfg.hybrid and model.layout == ("official" if interleaved else "ComfyUI") + " + VDN-H3 v2"
    by_hand = load_h3_model(base, branch=branch, dtype=torch.float32, cfg=CFG, qkv_interleaved=interleaved)
    branch_tensors = read_back(branch)
    for name in fp8_layer_names(model):
        key = name + ".weight"
        if key in base_fp8:
            codes, scale = codes_by_hand(base, layout, key, CFG)
            layer = Fp8Linear.from_scaled(codes, scale, compute_dtype=torch.float32)
            assert model.fp8_layers[name] == "codes from the file"
        elif branch_fp8:
            stem = "transformer_blocks." + name.removeprefix("blocks.")
            layer = Fp8Linear.from_scaled(
                branch_tensors[stem + ".weight"], branch_tensors[stem + ".weight_scale"], compute_dtype=torch.float32
            )
            assert model.fp8_layers[name] == "codes from the file"
        else:
            assert name.endswith("to_out_linear") and "not fp8 in the file" in model.fp8_layers[name]
            values, scale = quantised_here(hybrid[key])
            layer = Fp8Linear.from_linear(by_hand.get_submodule(name), compute_dtype=torch.float32)
            assert torch.equal(layer.weight.double(), values) and torch.equal(layer.weight_scale, scale)
        set_layer(by_hand, name, layer)
    assert len(model.fp8_layers) == 2 * 5 + 2 * 4
    assert model.linears == (
        "fp8 (codes from the file)"
        if branch_fp8
        else "fp8 (codes from the file: 16 layers; quantised at load: 2 layers)"
    )
    assert_same_model(model, by_hand, hybrid=True)


def test_vdn_with_a_lora(written, loras):
    base, _, base_fp8, *_ = written["vdn base"]
    branch = written["vdn fp8 branch"][0]
    chosen = [(loras["comfy"], 1.0)]
    model = load_h3_model(base, branch=branch, loras=chosen, dtype=torch.float32, cfg=CFG, linears="fp8")
    # the same merge in fp32 through the dtype path, then quantised: identical for the merged layers
    plain = load_h3_model(base, branch=branch, loras=chosen, dtype=torch.float32, cfg=CFG)
    for name in ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2"):
        assert model.fp8_layers[name] == "quantised at load (LoRA merged)"
        values, scale = quantised_here(plain.get_submodule(name).weight)
        layer = model.get_submodule(name)
        assert torch.equal(layer.weight.double(), values) and torch.equal(layer.weight_scale, scale)
    assert sum(how == "codes from the file" for how in model.fp8_layers.values()) == 2 * 5 + 2 * 4 - 2


# ---- linears="dtype" and bad values ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["comfy per tensor", "official shards", "diffusers"])
def test_linears_dtype_is_todays_load(written, name, loras):
    path, _, _, interleaved, _ = written[name]
    for kwargs in ({}, {"linears": "dtype"}):
        model = load_h3_model(path, dtype=torch.bfloat16, cfg=CFG, **kwargs)
        assert model.linears == "dtype (bfloat16)" and model.fp8_layers == {} and not fp8_layer_names(model)
        assert_same_model(
            model, load_h3_model(path, cfg=CFG, qkv_interleaved=interleaved), hybrid=False, dtype=torch.bfloat16
        )
    # with linears="fp8" every other tensor is the dtype path's, bit for bit
    fp8 = load_h3_model(path, dtype=torch.bfloat16, cfg=CFG, linears="fp8")
    plain = model.state_dict()
    fp8_state = fp8.state_dict()
    others = [k for k in plain if k.rsplit(".", 1)[0] not in fp8.fp8_layers]
    assert others and all(fp8_state[k].dtype == plain[k].dtype and torch.equal(fp8_state[k], plain[k]) for k in others)
    assert fp8.layout == model.layout


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(linears="int8"), r"linears: got 'int8'; allowed: 'dtype' \(every weight in dtype\) or 'fp8'"),
        (dict(linears=None), r"linears: got None; allowed: 'dtype'"),
        (
            dict(linears="fp8", dtype=torch.float64),
            r"dtype: got torch\.float64 with linears='fp8'; fp8 layers compute "
            r"in torch\.bfloat16, torch\.float16, torch\.float32",
        ),
    ],
)
def test_bad_linears_are_refused_naming_the_value_first(tmp_path, kwargs, message):
    with pytest.raises(H3InputError, match=message):
        load_h3_model(tmp_path / "nowhere.safetensors", cfg=CFG, **kwargs)


class _RecordingReader(StagedReader):
    """The reader a load to a GPU uses, here on the CPU, noting what the load expects and what it asks for."""

    def __init__(self):
        super().__init__("cpu", chunk_bytes=4096, threads=3, ahead_slabs=3)
        self.expected, self.asked, self.before = [], [], None

    def expect(self, spans):
        self.expected, self.before = list(spans), len(self.asked)  # the sidecars are read before, to plan
        super().expect(self.expected)

    def read(self, path, offset, nbytes, dtype, shape):
        self.asked.append((Path(path), offset, nbytes))
        return super().read(path, offset, nbytes, dtype, shape)


@pytest.mark.parametrize(
    "base_name, branch_name",
    [("comfy per tensor", None), ("official shards", None), ("diffusers", None), ("vdn base", "vdn fp8 branch")],
)
def test_a_load_reads_ahead_exactly_what_it_then_asks_for(written, base_name, branch_name, monkeypatch):
    """The fp8 load's read-ahead plan is the order the load reads in, every read is served from it, and the model
    equals the memory-mapped load."""
    import h3_core.formats.dit_layers as dit_layers

    base, *_ = written[base_name]
    branch = written[branch_name][0] if branch_name else None
    mapped = load_h3_model(base, branch=branch, dtype=torch.float32, cfg=CFG, linears="fp8")
    reader = _RecordingReader()
    monkeypatch.setattr(dit_layers, "reader_for", lambda device: reader)
    staged = load_h3_model(base, branch=branch, dtype=torch.float32, cfg=CFG, linears="fp8")
    assert reader.expected and reader.asked[reader.before :] == reader.expected
    assert reader._ahead.taken == len(reader.expected)
    assert staged.fp8_layers == mapped.fp8_layers
    assert_same_model(staged, mapped, hybrid=branch is not None)


@pytest.mark.parametrize("per_row", [False, True], ids=["per tensor", "per row"])
def test_a_scale_that_is_not_finite_is_refused_naming_the_layer(dense, tmp_path, per_row):
    """The scales of the layers taken from the file are checked together once the layers are built."""
    fp8 = native_fp8(dense, per_row=per_row)
    key = "blocks.1.mlp.fc2.weight"
    ((codes, scale),) = fp8[key]
    broken = scale.clone()
    broken.view(-1)[-1] = float("inf")
    fp8[key] = [(codes, broken)]
    path = write(comfy_file(dense, fp8), tmp_path / "broken.safetensors")
    with pytest.raises(
        H3InputError,
        match=r"broken\.safetensors: the fp8 scales of 1 layer\(s\) are not finite "
        r"\(first: 'blocks\.1\.mlp\.fc2'\)",
    ):
        load_h3_model(path, dtype=torch.float32, cfg=CFG, linears="fp8")
