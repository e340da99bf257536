"""Loading VDN-H3 from the base DiT file plus the linear-branch file (h3_core.formats.vdn)."""

import pytest
import torch
from safetensors.torch import save_file

from h3_core.errors import H3InputError
from h3_core.formats.checkpoints import load_h3_model
from h3_core.models.dit import DiTConfig, H3DiT

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
    hybrid=True,
)
ADDED = (".attn.softmax_gate.", ".attn.to_out_linear.", ".attn.linear_attention.")
PRE_V2 = (
    (".attn.linear_attention.output_gate.", ".attn.far.gate."),
    (".attn.linear_attention.", ".attn.far."),
    (".attn.softmax_gate.", ".attn.local_gate."),
    (".attn.to_out_linear.", ".attn.w_o_far."),
)


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    m = H3DiT(CFG)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return {k: v.contiguous() for k, v in m.state_dict().items()}


def write(tmp_path, state, rename=()):
    base = {k: v for k, v in state.items() if not any(a in k for a in ADDED)}
    branch = {}
    for k, v in state.items():
        if any(a in k for a in ADDED):
            name = "transformer_blocks." + k.removeprefix("blocks.")
            for new, old in rename:
                if new in name:
                    name = name.replace(new, old)
                    break
            branch[name] = v
    branch["__window__"] = torch.tensor([1, 5])
    save_file(base, tmp_path / "h3.safetensors")
    save_file(branch, tmp_path / "branch.safetensors")
    return tmp_path / "h3.safetensors", tmp_path / "branch.safetensors"


@pytest.mark.parametrize("rename", [(), PRE_V2], ids=["v2", "pre-v2"])
def test_every_tensor_lands_where_it_belongs(tmp_path, source, rename):
    base, branch = write(tmp_path, source, rename)
    model = load_h3_model(base, branch=branch, dtype=torch.float32, cfg=CFG)
    assert model.cfg.hybrid and "VDN-H3" in model.layout
    got = model.state_dict()
    assert set(got) == set(source)
    for key, value in source.items():
        assert torch.equal(got[key], value), key


def test_a_branch_for_another_model_is_refused_by_name(tmp_path, source):
    base, branch = write(tmp_path, source)
    short = {k: v for k, v in source.items() if not k.startswith("blocks.1.")}
    save_file(
        {"transformer_blocks." + k.removeprefix("blocks."): v for k, v in short.items() if any(a in k for a in ADDED)},
        tmp_path / "short.safetensors",
    )
    with pytest.raises(H3InputError, match=r"short\.safetensors: not a VDN-H3 linear branch.*missing \d+ keys"):
        load_h3_model(base, branch=tmp_path / "short.safetensors", dtype=torch.float32, cfg=CFG)
