"""Cut a captured training step into pipeline stages: a forward and a backward program each.

The step is captured once, whole (:mod:`zerocc.compiler.capture`); this pass splits it along
the FSDP units the plan gives each stage. Which stage a node belongs to is read from the module
capture tagged it with:

- **forward**: a node inside a unit is that unit's stage's; a node between units (the model's
  own code around its layers: embeddings, a residual stream's setup) goes with the next unit
  that runs, and what runs after the last unit (final norm, head, loss) with the last stage;
- **backward**: autograd reaches the units in reverse, and capture marks where each unit's
  backward begins: a node belongs to the stage of the last unit whose backward began before
  it, and what runs before any (the loss's and the head's backward) to the last stage. A
  gradient's cast that only reads one gradient goes with that gradient; the recompute pass's
  copy of a forward cast (a norm's cast of the residual stream the stage before computed,
  under bf16) is no gradient's: it runs with its unit.

Everything a node reads from another stage is sent to it: an activation from a stage before
(sent in forward, kept by the receiver for its backward) or a gradient from a stage after
(sent in backward); the neighbour's, mostly, and directly from further away where a value
skips a stage (a skip connection, or under mixed precision the head's part of a tied
embedding's gradient, which the embedding's cast sums in the first stage). A value that only
depends on the batch and on buffers (positions, masks, rotary tables) is recomputed where it is
read instead of sent. A parameter read by two stages (an embedding tied to the output head) is
held by both: each computes its part of the gradient, which the stages that hold it sum
(``tied``). A gradient read by an earlier stage's backward, or an activation by a later
stage's forward, cannot be cut: a PlanError naming the tensor.

Each program is an ordinary graph: placeholders tagged with their role (parameters, buffers and
batch tensors as in the captured step, :data:`Role.RECEIVED` for what the neighbour sends,
:data:`Role.STASHED` for what the stage's own forward kept), and an output tuple that
:class:`StageProgram` lists slot by slot.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

import torch
from torch import fx

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.names import enclosing
from zerocc.compiler.parallel.stage_programs import (
    Output,
    Stage,
    StagedStep,
    StageProgram,
    build_program,
    of_params,
)
from zerocc.errors import PlanError
from zerocc.ir.kinds import OpKind, Role
from zerocc.ir.nodes import (
    BATCH,
    BUFFER,
    PARAM,
    info,
    op_kind,
)
from zerocc.ir.rng import is_random

_CAST = torch.ops.aten._to_copy.default
_ADD = torch.ops.aten.add.Tensor
_DETACH = torch.ops.aten.detach.default


def unit_of(module: str, units: Collection[str]) -> str | None:
    """The unit (a module FQN) ``module`` runs in: the innermost that contains it (~100k
    lookups among 127 units on the 405B example)."""
    return next((m for m in enclosing(module) if m in units), "" if "" in units else None)


def cut_stages(
    gm: fx.GraphModule, model: ModelInfo, stage_units: Sequence[Sequence[str]]
) -> StagedStep:
    """Cut the captured training step ``gm`` of ``model`` into ``len(stage_units)`` stages;
    stage ``s`` runs the units (module FQNs) ``stage_units[s]``, in model order (a step
    captured forward only, for evaluation, is cut alike: its stages' backward programs are
    empty, and its forwards keep nothing). Raises PlanError naming the tensor where the step
    cannot be cut there."""
    cut = _Cut(gm, model, stage_units)
    stages = [
        Stage(s, tuple(stage_units[s]), cut.program(s, "forward"), cut.program(s, "backward"))
        for s in range(cut.n)
    ]
    return StagedStep(stages, cut.tied)


class StageAssignment:
    """Which stage each computed node of a captured step runs in (the module docs' rules):
    ``stage[node]``, and the step's ``forward`` and ``backward`` nodes in program order. The
    cut builds its programs from it; the cost model weighs stages with it."""

    def __init__(self, gm: fx.GraphModule, stage_units: Sequence[Sequence[str]]) -> None:
        self.gm, self.n = gm, len(stage_units)
        if self.n < 1 or any(not units for units in stage_units):
            raise PlanError("pipeline.split: every stage needs at least one unit")
        self.unit_stage = {u: s for s, units in enumerate(stage_units) for u in units}
        nodes = list(gm.graph.nodes)
        self.output = nodes[-1]
        returned = self.output.args[0][0]  # the loss, detached as the step returns it
        self.loss = returned.args[0] if returned.target is _DETACH else returned
        computed = [n for n in nodes if n.op == "call_function" and n is not returned]
        self.forward = [n for n in computed if info(n).phase == "forward"]
        self.backward = [n for n in computed if info(n).phase != "forward"]
        self.order = {n: i for i, n in enumerate(nodes)}
        self.stage: dict[fx.Node, int] = {}
        self._assign_forward()
        self._assign_backward()
        self.derived = self._derived()

    def _derived(self) -> set[fx.Node]:
        """Forward views and casts of parameters, buffers and batch tensors (a weight
        transposed for a matmul, cast to the compute dtype), and what is computed from the
        parameters alone (a float8 weight's scale and cast: :func:`of_params`): each program
        that reads one derives it again from its inputs, rather than receive it from the stage
        that ran it first or keep it from forward to backward (stage 3 frees a gathered
        parameter after forward, and backward gathers it again, as the shard pass re-derives
        such values; it drops a ``keep`` of one)."""
        inputs = (PARAM, BUFFER, BATCH)
        params = {n for n in self.gm.graph.nodes if n.op == "placeholder" and info(n).role == PARAM}
        derived = of_params(self.forward, params)
        for node in self.forward:
            cheap = node.target is _CAST or op_kind(node) in (OpKind.VIEW, OpKind.PLUMBING)
            if cheap and all(
                i in derived
                or i.op == "get_attr"
                or (i.op == "placeholder" and info(i).role in inputs)
                for i in node.all_input_nodes
            ):
                derived.add(node)
        return derived

    def _unit_stage(self, node: fx.Node) -> int | None:
        unit = unit_of(info(node).module or "", self.unit_stage)
        return None if unit is None else self.unit_stage[unit]

    def _assign_forward(self) -> None:
        following = self.n - 1
        for node in reversed(self.forward):
            stage = self._unit_stage(node)
            following = following if stage is None else stage
            self.stage[node] = following
        self._check_order(self.forward, "forward", increasing=True)

    def _assign_backward(self) -> None:
        current = self.n - 1
        for node in self.backward:
            stage = self._unit_stage(node)
            current = current if stage is None else stage
            if self._casts_a_gradient(node):
                self.stage[node] = self.stage[node.all_input_nodes[0]]  # it goes with it
            else:
                self.stage[node] = current
        self._check_order(self.backward, "backward", increasing=False)

    def _casts_a_gradient(self, node: fx.Node) -> bool:
        """Whether backward ``node`` casts one gradient and nothing else. A recomputed cast
        of a forward value (the recompute pass's copy of a norm's cast of its input, which the
        stage before computed) is not one: it runs with its unit, as its module says."""
        inputs = node.all_input_nodes
        return (
            node.target is _CAST
            and len(inputs) == 1
            and inputs[0] in self.stage
            and info(inputs[0]).phase != "forward"
        )

    def _check_order(self, nodes: list[fx.Node], phase: str, increasing: bool) -> None:
        """The units ran in the order the split gives them (forward) and in reverse (backward)."""
        last = None
        for node in nodes:
            stage = self._unit_stage(node)
            if stage is None:
                continue
            if last is not None and (stage < last if increasing else stage > last):
                raise PlanError(
                    f"pipeline.split: in {phase}, {info(node).module or 'the model'} (stage "
                    f"{stage}) ran after a unit of stage {last}: the units of a pipeline must run "
                    "one after another in the order of the split"
                )
            last = stage


class _Cut(StageAssignment):
    """The cut: what each stage's programs run, read and return."""

    def __init__(
        self, gm: fx.GraphModule, model: ModelInfo, stage_units: Sequence[Sequence[str]]
    ) -> None:
        super().__init__(gm, stage_units)
        # One per trainable parameter, None where unused; none of a forward-only step's.
        grads = self.output.args[0][1:] or (None,) * len(model.trainable)
        self.param_of_grad = {
            g: p.fqn for p, g in zip(model.trainable, grads, strict=True) if g is not None
        }
        self.tied: dict[str, tuple[int, ...]] = {}
        self.joins: set[fx.Node] = set()  # adds of a tied parameter's parts across stages
        self.parts: dict[fx.Node, str] = {}  # a stage's part of a tied gradient: its FQN
        self._tie()
        self.free: dict[fx.Node, bool] = {}
        self.needs: dict[tuple[int, str], set[fx.Node]] = {}  # (stage, phase): nodes it runs
        self.crossing: dict[tuple[int, str], set[fx.Node]] = {}  # values received
        self._route()

    # -- tied parameters ----------------------------------------------------------------------

    def _tie(self) -> None:
        """A parameter read by several stages: each holds it; its gradient's sum across stages
        is split into each stage's part (the stages sum them after backward)."""
        for node in self.gm.graph.nodes:
            if node.op != "placeholder" or info(node).role != PARAM:
                continue
            stages = sorted(self._reading_stages(node))
            if len(stages) > 1:
                self.tied[info(node).key] = tuple(stages)
        for grad, fqn in self.param_of_grad.items():
            if fqn in self.tied:
                for part in self._parts(grad, fqn):
                    self.parts[part] = fqn

    def _reading_stages(self, node: fx.Node) -> set[int]:
        """The stages of the nodes that read ``node``, directly or through derived views."""
        stages: set[int] = set()
        for user in node.users:
            if user in self.derived:
                stages |= self._reading_stages(user)
            elif user in self.stage:
                stages.add(self.stage[user])
        return stages

    def _parts(self, grad: fx.Node, fqn: str) -> list[fx.Node]:
        if grad.target is _ADD and len(grad.all_input_nodes) == 2:
            a, b = grad.args[:2]
            if self.stage[a] != self.stage[b]:
                if any(u is not self.output and u not in self.joins for u in grad.users):
                    raise PlanError(
                        f"pipeline.split: the gradient of {fqn}, a parameter stages "
                        f"{list(self.tied[fqn])} share, is used after its parts are summed "
                        f"({', '.join(u.name for u in grad.users)}); zerocc sums the parts "
                        "after backward only"
                    )
                self.joins.add(grad)
                return self._parts(a, fqn) + self._parts(b, fqn)
        return [grad]

    # -- what crosses a cut -------------------------------------------------------------------

    def _is_free(self, node: fx.Node) -> bool:
        """Whether ``node``'s value depends only on batch tensors, buffers and constants (not
        on a parameter, a gradient or a draw): such a value is recomputed where another stage
        reads it."""
        if node not in self.free:
            if is_random(node):  # drawn once: a copy in another stage would draw anew
                self.free[node] = False
            elif node.op == "placeholder":
                self.free[node] = info(node).role in (BATCH, BUFFER)
            else:
                self.free[node] = info(node).phase == "forward" and all(
                    self._is_free(i) for i in node.all_input_nodes
                )
        return self.free[node]

    def _route(self) -> None:
        """Which nodes each program runs and which values it receives."""
        for node in self.forward + self.backward:
            if node in self.joins or node in self.derived:  # derived: where read
                continue
            phase = info(node).phase if info(node).phase == "forward" else "backward"
            self._run(node, self.stage[node], phase)

    def _run(self, node: fx.Node, stage: int, phase: str) -> None:
        runs = self.needs.setdefault((stage, phase), set())
        if node in runs:
            return
        runs.add(node)
        for source in node.all_input_nodes:
            if source.op == "get_attr":  # a constant: each program holds its own
                runs.add(source)
            if source.op in ("placeholder", "get_attr"):
                continue
            if source in self.derived:
                self._run(source, stage, phase)
            elif self.stage[source] == stage:
                continue
            elif self._is_free(source):
                self._run(source, stage, phase)  # recomputed here
            else:
                self._receive(source, node, stage)

    def _receive(self, source: fx.Node, reader: fx.Node, stage: int) -> None:
        """``reader`` (of ``stage``) reads ``source`` of another stage: an activation of a stage
        before, or a gradient of a stage after, sent to it directly (a skip connection over a
        stage, the head's part of a tied embedding's gradient); anything else cannot be cut."""
        source_forward = info(source).phase == "forward"
        if (self.stage[source] < stage) != source_forward:
            what = "activation" if source_forward else "gradient"
            raise PlanError(
                f"pipeline.split: {info(reader).module or 'the model'} (stage {stage}) reads the "
                f"{what} {source.name} of {info(source).module or 'the model'} (stage "
                f"{self.stage[source]}): a stage receives activations from the stages before "
                "it and gradients from those after it. Move the cut so that both are in one "
                "stage"
            )
        self.crossing.setdefault((stage, "forward" if source_forward else "backward"), set())
        self.crossing[(stage, "forward" if source_forward else "backward")].add(source)

    # -- programs -----------------------------------------------------------------------------

    def program(self, stage: int, phase: Literal["forward", "backward"]) -> StageProgram:
        runs = self.needs.get((stage, phase), set())
        read = {i for n in runs for i in n.all_input_nodes}
        inputs = [
            (node, info(node).role, info(node).key, None)
            for node in self.gm.graph.nodes
            if node.op == "placeholder" and node in read
        ]
        if phase == "backward":
            inputs += [(node, Role.STASHED, node.name, None) for node in self._stashed(stage)]
        received = sorted(self.crossing.get((stage, phase), set()), key=self.order.__getitem__)
        inputs += [(node, Role.RECEIVED, node.name, self.stage[node]) for node in received]
        body = sorted(runs, key=self.order.__getitem__)
        returned = self._outputs(stage, phase, runs)
        outputs = [(kind, self._key(kind, n), n, peer) for kind, n, peer in returned]
        return build_program(self.gm, stage, phase, inputs, body, outputs)

    def _key(self, kind: Output, node: fx.Node) -> str:
        if kind == "grad":
            return self.param_of_grad.get(node) or self.parts[node]
        return "loss" if kind == "loss" else node.name

    def _stashed(self, stage: int) -> list[fx.Node]:
        """Forward values (own, or received from the stage before) the stage's backward reads."""
        backward = self.needs.get((stage, "backward"), set())
        forward = self.needs.get((stage, "forward"), set())
        kept = forward | self.crossing.get((stage, "forward"), set())
        return sorted(
            {i for n in backward for i in n.all_input_nodes if i in kept and i not in backward},
            key=self.order.__getitem__,
        )

    def _outputs(
        self, stage: int, phase: str, runs: set[fx.Node]
    ) -> list[tuple[Output, fx.Node, int | None]]:
        """What a program returns: the loss, what it sends (to which stage), what its backward
        reads, the gradients."""
        sent: list[tuple[Output, fx.Node, int | None]] = [
            ("send", n, peer) for n, peer in self._sent(stage, phase)
        ]
        if phase == "forward":
            loss = [("loss", self.loss, None)] if self.loss in runs else []
            return loss + sent + [("stash", n, None) for n in self._stashed(stage)]
        grads: list[tuple[Output, fx.Node, int | None]] = [
            ("grad", n, None)
            for n in sorted(runs, key=self.order.__getitem__)
            if n in self.parts or (n in self.param_of_grad and n not in self.joins)
        ]
        return sent + grads

    def _sent(self, stage: int, phase: str) -> list[tuple[fx.Node, int]]:
        """What ``stage``'s program of ``phase`` sends, and to which stage: each value another
        stage receives from it (the next stages' in forward, the previous ones' in backward)."""
        return [
            (node, receiver)
            for (receiver, crossing_phase), values in sorted(self.crossing.items())
            if crossing_phase == phase
            for node in sorted(values, key=self.order.__getitem__)
            if self.stage[node] == stage
        ]
