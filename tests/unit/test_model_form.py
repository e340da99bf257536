"""The memory model's and the policy's public functions take a handful of parameters: the model as it will be
evaluated travels as one ``ModelForm`` (h3_core.memory.predict), the user's choices for a run as one ``RunChoices``
(h3_core.memory.policy); both are checked when made."""

import inspect
from dataclasses import replace

import pytest
import torch
from tiny_dit import CFG as TINY

from h3_core.errors import H3InputError
from h3_core.memory import policy, predict
from h3_core.memory.predict import ModelForm
from h3_core.models.dit import H3DiT
from h3_core.models.fp8_linear import quantize_linears

CFG = replace(TINY, hybrid=True)


@pytest.mark.parametrize(
    "function",
    [
        predict.evaluation_peak,
        predict.plan_for_memory,
        predict.predicted_seconds,
        policy.decide_placement,
        policy.place_for_run,
    ],
)
def test_each_takes_a_handful_of_parameters(function):
    assert len(inspect.signature(function).parameters) <= 8, function.__name__


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(linears="int4"), r"linears: must be one of \['dtype', 'fp8', 'fp8 weights only'\], got 'int4'"),
        (dict(attention_precision="fp16"), r"attention_precision: must be one of \['bf16', 'fp8'\], got 'fp16'"),
    ],
)
def test_a_bad_form_is_named(given, message):
    with pytest.raises(H3InputError, match=message):
        ModelForm(CFG, hybrid=True, **given)


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(placement="everywhere"), r"placement must be one of \['auto', 'resident', 'stream blocks'\], got"),
        (dict(memory="tight"), r"memory mode must be one of \['auto', 'off'\], got 'tight'"),
        (dict(compile="fast"), r"compile must be one of \['auto', 'off'\], got 'fast'"),
        (dict(attention_precision="fp16"), r"attention_precision: must be one of \['bf16', 'fp8'\], got 'fp16'"),
    ],
)
def test_a_bad_choice_is_named(given, message):
    with pytest.raises(H3InputError, match=message):
        policy.RunChoices(**given)


def test_the_form_of_a_loaded_model():
    model = H3DiT(CFG).to(torch.bfloat16)
    assert ModelForm.of(model) == ModelForm(CFG, hybrid=True, dtype=torch.bfloat16)
    quantize_linears(model, compute_dtype=torch.float32)
    model.fp8_layers = {"blocks.0.mlp.fc2": "quantised on load"}  # as the loader records them
    form = ModelForm.of(model, fused="compiled", attention_precision="fp8")
    assert form == ModelForm(
        CFG, hybrid=True, dtype=torch.float32, linears="fp8", fused=True, attention_precision="fp8"
    )
