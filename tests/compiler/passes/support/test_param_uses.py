"""The analysis the shard pass acts on (zerocc/compiler/passes/support/param_uses.py), on the
captured tiny GPT after partition: which nodes are re-derivable from parameters alone, each
unit's use window per phase, and each trainable parameter's gradient."""

from __future__ import annotations

import pytest
import torch
from models import _gpt_batch, tiny_gpt, tiny_gpt_dropout

import zerocc
from zerocc.compiler.capture import describe_model
from zerocc.compiler.passes.support.param_uses import analyze
from zerocc.compiler.workload import Workload
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import PARAM, info, placeholders, val
from zerocc.ir.rng import is_random

PLAN = {"workload": "unused:unused", "zero": {"stage": 3}, "units": {"classes": ["Block"]}}


def _analysed(build=tiny_gpt):
    """The partitioned graph (tagged, before shard) and its analysis."""
    workload = Workload(build(), batches=lambda rank, world: iter([_gpt_batch(0, rank)]))
    inspection = inspect_plan(zerocc.load_plan(PLAN), 2, workload, keep_graphs=True)
    gm = next(r.gm for r in inspection.stepping.records if r.name == "partition")
    trainable = [p.fqn for p in describe_model(workload.model).trainable]  # the model's order
    return gm, analyze(gm, trainable), trainable


@pytest.fixture(scope="module")
def gpt():
    return _analysed()


def test_derived_nodes_read_parameters_alone_and_are_never_outputs(gpt):
    gm, uses, _ = gpt
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert uses.derived, "a linear layer's weight is transposed: at least that is derived"
    for node in uses.derived:
        assert all(a in uses.unit_of or a in uses.derived for a in node.all_input_nodes), node
        assert node not in output.all_input_nodes
        assert not node.target._schema.is_mutable, node
    transposes = [n for n in uses.derived if n.target == torch.ops.aten.t.default]
    assert transposes and all(uses.roots[n] for n in transposes)


def test_every_compute_use_of_a_unit_lies_in_its_window(gpt):
    gm, uses, _ = gpt
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    used = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node not in uses.derived:
            for unit in uses.units_used_by(node):
                used.setdefault((unit, info(node).phase), []).append(position[node])
    assert set(used) == set(uses.windows)
    for key, (first, last) in uses.windows.items():
        assert (position[first], position[last]) == (min(used[key]), max(used[key])), key
    units = {info(n).unit for n in placeholders(gm, PARAM)}
    assert {u for u, phase in uses.windows if phase == "backward"} == units


def test_each_trainable_parameter_has_its_gradient(gpt):
    gm, uses, trainable = gpt
    shapes = {info(n).key: tuple(val(n).shape) for n in placeholders(gm, PARAM)}
    assert list(uses.grads) == trainable
    for fqn, grad in uses.grads.items():
        assert grad is not None and tuple(val(grad).shape) == shapes[fqn], fqn


def test_random_ops_are_never_derived():
    """A second draw would differ: dropout's mask is computed once, where captured."""
    gm, uses, _ = _analysed(tiny_gpt_dropout)
    random = [n for n in gm.graph.nodes if n.op == "call_function" and is_random(n)]
    assert random and not set(random) & uses.derived
