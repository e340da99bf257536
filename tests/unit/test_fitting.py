"""A memory plan put into effect on a model gives the plain model's generation (h3_core.memory.apply)."""

import torch

from h3_core.memory.apply import apply_plan
from h3_core.memory.predict import BlockShape, ModelForm, evaluation_peak, plan_for_memory
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.generate import generate
from h3_core.pipeline.packing import pack_sequence
from h3_core.pipeline.prompt import from_conditioning
from h3_core.pipeline.request import ClipRequest

CFG = DiTConfig(
    hidden=64,
    layers=4,
    heads=4,
    head_dim=16,
    ffn=96,
    text_dim=5120,
    freq_dim=16,
    time_hidden=32,
    time_embed=24,
    rope_freqs=2,
    hybrid=True,
)
RUN = dict(frames=22, width=64, height=32, steps=2, seed=5)
FORM = ModelForm(CFG, hybrid=True, dtype=torch.float64)


def model():
    torch.manual_seed(0)
    m = H3DiT(CFG).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m


def shape():
    packed = pack_sequence(torch.ones(6, dtype=torch.long), 7, 2, 4, 37)
    return BlockShape.of(CFG, packed, torch.float64)


def test_each_kind_of_plan_generates_what_the_plain_model_does():
    prompt = from_conditioning(torch.randn(1, 6, 5120, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    with torch.no_grad():
        want = generate(model(), prompt, ClipRequest(**RUN))
    full = evaluation_peak(FORM, shape())["total"]
    budgets = {"roomy": full * 2, "grouped": full * 0.999, "streamed": full * 0.2}
    seen = {}
    for name, budget in budgets.items():
        plan = plan_for_memory(FORM, shape(), budget, steps=RUN["steps"])
        m = model()
        fitted = apply_plan(m, plan, "cpu")
        with torch.no_grad():
            got = generate(m, prompt, ClipRequest(**RUN))
        fitted.remove()
        seen[name] = plan
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name
        assert fitted.said and ("fits as it is" in fitted.said[0]) == (name == "roomy")
    assert seen["roomy"].steps == () and seen["grouped"].options.head_groups == 2
    assert seen["streamed"].resident_blocks is not None and seen["streamed"].adaln_on_host


def test_a_plan_that_cannot_fit_says_so():
    plan = plan_for_memory(FORM, shape(), 1)
    fitted = apply_plan(model(), plan, "cpu")
    assert not plan.fits and "above the" in fitted.said[-1] and "larger card" in fitted.said[-1]
    fitted.remove()
