"""Batches by name, as Hugging Face models take them (issue 50): ``step(input_ids=ids,
labels=ids)``, ``step(batch_dict)`` and ``step(ids, labels=ids)`` train as the same model given
its batch positionally does (the same ops on the same values: bit-identical losses), and
``evaluate`` takes them alike; what is not a batch is a BatchError saying what is."""

from __future__ import annotations

import pytest
import torch
from models import _token_batch, build

import zerocc
from zerocc.compiler.batch import Keywords, as_batch, batch_from, call_arguments
from zerocc.errors import BatchError

pytest.importorskip("transformers")

PLAN = {"zero": {"stage": 3}, "units": {"classes": ["LlamaDecoderLayer"]},
        "optimizer": {"eps": 1e-3}, "backend": {"device": "cpu"}}  # fmt: skip
STEPS = 3


def _losses(call) -> list[float]:
    """The losses of STEPS steps of the tiny Llama, each batch given to ``call(step, ids)``."""
    step = zerocc.compile(build("llama").lm, PLAN)  # the Hugging Face model itself
    return [float(call(step, _token_batch(s, 0)[0])) for s in range(STEPS)]


def test_a_batch_by_name_trains_as_the_model_called_by_name():
    by_keywords = _losses(lambda step, ids: step(input_ids=ids, labels=ids))
    wrapped = zerocc.compile(
        build("llama"), {**PLAN}
    )  # forward(ids): lm(input_ids=ids, labels=ids)
    positional = [float(wrapped(*_token_batch(s, 0))) for s in range(STEPS)]
    assert by_keywords == positional
    assert _losses(lambda step, ids: step({"input_ids": ids, "labels": ids})) == by_keywords
    assert _losses(lambda step, ids: step(ids, labels=ids)) == by_keywords


def test_evaluate_takes_a_batch_by_name():
    step = zerocc.compile(build("llama").lm, PLAN)
    ids = _token_batch(0, 0)[0]
    evaluated = float(step.evaluate(input_ids=ids, labels=ids))
    assert float(step(input_ids=ids, labels=ids)) == evaluated  # (no dropout: the same forward)


def test_the_marker_names_the_values_after_the_positional_ones():
    x, y = torch.zeros(2), torch.ones(2)
    batch = batch_from((x,), {"labels": y})
    assert batch[0] == Keywords(("labels",), 1) and repr(batch[0]) == "keywords(labels)"
    args, named = call_arguments(batch)
    assert args == (x,) and list(named) == ["labels"] and named["labels"] is y
    assert batch_from((x, y), {}) == (x, y) and call_arguments((x, y)) == ((x, y), {})
    # A workload's batch (zerocc train, inspect): a mapping by name, a list as values
    assert as_batch({"labels": y}) == (Keywords(("labels",)), y) and as_batch([x, y]) == (x, y)


@pytest.mark.parametrize(
    ("args", "named", "message"),
    [
        (({1: torch.zeros(2)},), {}, "a batch's names must be strings"),
        (({"input_ids": torch.zeros(2)}, torch.zeros(2)), {}, "a mapping beside other values"),
    ],
)
def test_what_is_not_a_batch_is_a_batch_error(args, named, message):
    with pytest.raises(BatchError, match=message):
        batch_from(args, named)
