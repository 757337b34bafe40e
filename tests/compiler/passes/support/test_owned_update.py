"""Muon's owned update as the optimizer pass emits it (zerocc/compiler/passes/support/
owned_update.py), graph-level on four simulated ranks: per unit one momentum, one exchange to
the owners and back, one orthogonalization of the matrices each rank owns; the layouts it is
not built for, and a vector given Muon, are plan errors naming them."""

from __future__ import annotations

import pytest

import zerocc
from zerocc.errors import PlanError
from zerocc.inspect.estimate import inspect_plan
from zerocc.ir.nodes import info, op_name

MUON = {"name": "muon", "lr": 0.02}


def _program(stage: int, **plan):
    plan = {
        "workload": "workload:workload",
        "zero": {"stage": stage},
        "units": {"classes": ["Block"]},
        "optimizer": MUON,
        **plan,
    }
    inspection = inspect_plan(zerocc.load_plan(plan), 4)
    return inspection.programs[True].gm, [u for u in inspection.units if u.trainable]


def _ops(gm, name: str) -> list:
    return [n for n in gm.graph.nodes if op_name(n.target) == f"zerocc.{name}"]


@pytest.mark.parametrize("stage", [0, 3])
def test_each_matrix_is_orthogonalized_by_one_owner(stage):
    gm, units = _program(stage)
    blocks = sorted(u.name for u in units if u.name != "root")
    ortho = _ops(gm, "muon_orthogonalize")
    assert sorted(info(n).unit for n in ortho) == blocks  # the root holds no hidden matrix
    owners = [n.args[2][4::5] for n in ortho]  # (offset, batch, rows, cols, owner) each
    assert all(len(o) == 4 for o in owners)  # c_attn, c_proj, c_fc, mlp.c_proj per block
    assert set().union(*map(set, owners)) == {0, 1, 2, 3}  # the work spread over the ranks
    assert sorted(info(n).unit for n in _ops(gm, "muon_apply_")) == blocks
    assert len(_ops(gm, "adamw_")) == len(units)  # the vectors (and the root's embeddings)
    exchanged = [info(n).unit for n in gm.graph.nodes if "Muon update" in (info(n).note or "")]
    assert sorted(exchanged) == ([] if stage == 0 else blocks)
    back = [n for n in gm.graph.nodes if "orthogonalized matrices" in (info(n).note or "")]
    assert len(back) == len(blocks)


@pytest.mark.parametrize(
    "plan, named",
    [  # (a pipeline's, parallel.pp, is refused alike where its ranks compile their programs)
        (
            {
                "parallel": {
                    "tp": 2,
                    "tp_layers": {
                        "transformer.h.*.mlp.c_fc": "colwise",
                        "transformer.h.*.mlp.c_proj": "rowwise",
                    },
                }
            },
            "parallel.tp",
        ),
        ({"offload": {"optimizer": "cpu"}}, "offload"),
    ],
)
def test_a_layout_muon_is_not_built_for_is_a_plan_error(plan, named):
    with pytest.raises(PlanError, match=f"optimizer.name: muon with {named}"):
        _program(3, **plan)


def test_a_vector_given_muon_is_a_plan_error():
    groups = [{"params": ["**"], "name": "muon"}]
    with pytest.raises(PlanError, match=r"transformer.wte.weight|ln_.*\(shape \["):
        _program(3, optimizer={**MUON, "groups": groups})
