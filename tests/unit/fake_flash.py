"""Stand-ins for flash-attn builds (FA2, FA3, FA4) and for a GPU's device facts, so the kernel adapters
can be exercised on the CPU: exact float64 attention behind each library's call signature."""

import math
import sys
import types

import torch

from h3_core.attention import kernels
from h3_core.attention.kernels import DeviceFacts

LOG2_E = 1.0 / math.log(2.0)


class FakeFlash:
    """Exact attention in float64 standing in for a flash-attn build; records every call's layout."""

    def __init__(self, lse_factor=1.0, fail=None):
        self.calls = []
        self.problems = []
        self.lse_factor = lse_factor
        self.fail = fail

    def compute(self, q, k, v, softmax_scale, causal=False):
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dim() != 4 or x.stride(-1) != 1:
                self.problems.append(f"{name} shape {tuple(x.shape)} strides {x.stride()}")
        if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or k.shape != v.shape:
            self.problems.append(f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
        self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), k_stride=k.stride(), scale=softmax_scale))
        if self.fail is not None:
            raise self.fail
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        self.calls[-1]["causal"] = causal
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, S]
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v.double())
        return out.to(q.dtype), (lse * self.lse_factor).float()


def install_fa3(monkeypatch, fake):
    mod = types.ModuleType("flash_attn_interface")

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_attn_probs=False):
        out, lse = fake.compute(q, k, v, softmax_scale, causal)
        return (out, lse) if return_attn_probs else out

    mod.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


def install_fa2(monkeypatch, fake):
    mod = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
        if dropout_p != 0.0:
            fake.problems.append(f"dropout_p={dropout_p}")
        out, lse = fake.compute(q, k, v, softmax_scale, causal)
        return (out, lse, None) if return_attn_probs else out

    mod.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)


def install_fa4(monkeypatch, fake):
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    cute = types.ModuleType("flash_attn.cute")

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
        out, lse = fake.compute(q, k, v, softmax_scale, causal)
        return out, (lse if return_lse else None)

    interface = types.ModuleType("flash_attn.cute.interface")

    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, out=None):
        res, lse = fake.compute(q, k, v, softmax_scale, causal)
        if out is not None:
            fake.calls[-1]["out"] = (out.data_ptr(), out.stride())
            out.copy_(res)
            res = out
        return res, (lse if return_lse else None), None, None, None

    cute.flash_attn_func = flash_attn_func
    interface._flash_attn_fwd = _flash_attn_fwd
    cute.interface = interface
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)


LEGS = {
    "fa3": ((9, 0), install_fa3),
    "fa2": ((8, 0), install_fa2),
    "fa4": ((10, 0), install_fa4),
}


def pretend_gpu(monkeypatch, capability, **facts):
    """Make every device look like a GPU with these facts (the vae module reads them too)."""
    fake = lambda device: DeviceFacts("cuda", capability, **facts)  # noqa: E731
    monkeypatch.setattr(kernels, "device_facts", fake)
    from h3_core.attention import vae

    monkeypatch.setattr(vae, "device_facts", fake)
