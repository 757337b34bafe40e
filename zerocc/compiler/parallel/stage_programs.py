"""The programs a pipeline stage runs, as the stage cut (:mod:`.stage_cut`) makes them: what
each reads and returns (:class:`StageProgram`), the backward's two halves for zero-bubble
schedules (:func:`split_backward`), the step form the plan's passes compile
(:func:`step_form`: what crosses a cut or was kept, moved by ``zerocc.send``/``recv``/``keep``/
``kept`` ops) and the graph a pipeline rank's update is compiled from (:func:`update_graph`)."""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zerocc.compiler.capture import ModelInfo
from zerocc.errors import PlanError
from zerocc.ir.kinds import OpKind, Role
from zerocc.ir.nodes import (
    BATCH,
    BUFFER,
    LOSS_SCALE,
    LOSS_SCALE_KEY,
    PARAM,
    copy_node,
    name_placeholder,
    op_kind,
    tag,
)
from zerocc.ir.rng import is_random

# What a program's output slot holds: the loss, a tensor for a neighbour (an activation for the
# next stage, a gradient for the one before), a tensor the stage's backward reads, a
# parameter's gradient (of a tied one, this stage's part of it).
Output = Literal["loss", "send", "stash", "grad"]
# A stage's programs: its forward, its backward, or (for a zero-bubble schedule) the backward
# split into the input gradient (what the stage before waits for) and the weight gradient.
Phase = Literal["forward", "backward", "input-grad", "weight-grad"]


@dataclass(frozen=True)
class Slot:
    """One input or output of a stage program: what it is, and its key (a parameter's FQN, a
    buffer's, a batch position, or for a tensor crossing a cut its name in the captured step);
    ``peer``: for a tensor sent, the stage it goes to, for one received, the stage it comes
    from (the neighbour, mostly; a skip connection's or a tied gradient's may pass one)."""

    kind: Role | Output
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    peer: int | None = None


@dataclass
class StageProgram:
    """The forward or backward program of one stage, and what it reads and returns."""

    stage: int
    phase: Phase
    gm: fx.GraphModule
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]

    def reads(self, kind: Role) -> list[str]:
        return [s.key for s in self.inputs if s.kind == kind]

    def writes(self, kind: Output) -> list[str]:
        return [s.key for s in self.outputs if s.kind == kind]


@dataclass
class Stage:
    """One stage of the cut: the units it runs, its forward and its backward."""

    index: int
    units: tuple[str, ...]
    forward: StageProgram
    backward: StageProgram

    @property
    def params(self) -> list[str]:
        """The parameters this stage holds (FQNs, in the captured step's order)."""
        keys = self.forward.reads(PARAM) + self.backward.reads(PARAM)
        return list(dict.fromkeys(keys))

    @property
    def buffers(self) -> list[str]:
        """The buffers this stage's programs read (FQNs)."""
        return list(dict.fromkeys(self.forward.reads(BUFFER) + self.backward.reads(BUFFER)))


@dataclass
class StagedStep:
    """A captured step cut into stages. ``tied``: the parameters several stages hold, with
    those stages; each computes a part of the gradient, and the parts sum to it."""

    stages: list[Stage]
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def format(self) -> str:
        """What each stage holds and what crosses each cut, a line each."""
        lines = []
        for s in self.stages:
            f, b = s.forward, s.backward
            units = f"{s.units[0]} .. {s.units[-1]}" if s.units else "(no unit)"
            lines.append(
                f"stage {s.index}: units {units} ({len(s.units)}), {len(s.params)} parameters, "
                f"forward {_ops(f.gm)} ops, backward {_ops(b.gm)} ops, "
                f"{len(f.writes('stash'))} tensors kept for backward"
            )
            for direction, program in (("->", f), ("<-", b)):
                sent = [o for o in program.outputs if o.kind == "send"]
                for peer in sorted({o.peer for o in sent}):
                    what = ", ".join(f"{o.key} {list(o.shape)}" for o in sent if o.peer == peer)
                    lines.append(f"  {direction} stage {peer}: {what}")
        for fqn, stages in self.tied.items():
            lines.append(f"tied {fqn}: held by stages {list(stages)}, gradient parts summed")
        return "\n".join(lines)


def _ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def split_backward(backward: StageProgram) -> tuple[StageProgram, StageProgram]:
    """``backward`` as two programs, for a zero-bubble schedule: the input gradient (the nodes
    the gradients sent to the stage before depend on, and those sends) and the weight gradient
    (everything else: the parameters' gradients, but those an op of the first computes beside
    its input gradient, as a layer norm's backward does); a recomputed draw's replay, the
    generator-state ops around it, goes where the draw goes. The first receives what the
    stage after sends and returns, as ``stash``, what the second reads of it and of what it
    received; the second runs later, while nothing waits for it."""
    nodes = list(backward.gm.graph.nodes)
    values = nodes[-1].args[0]
    slots = list(zip(backward.outputs, values, strict=True))
    needed: set[fx.Node] = set()

    def need(stack: list[fx.Node]) -> None:
        while stack:
            node = stack.pop()
            if node not in needed and node.op != "placeholder":
                needed.add(node)
                stack.extend(node.all_input_nodes)

    need([v for slot, v in slots if slot.kind == "send"])
    # A recomputed draw replays its forward's numbers between the generator ops around it:
    # they run in the draw's program.
    replays = _replays(nodes)
    need([op for draw in list(needed) for op in replays.get(draw, ())])
    for node in list(needed):  # an op's other results come with it (the stash holds tensors)
        if not isinstance(node.meta.get("val"), torch.Tensor):
            needed.update(u for u in node.users if u.target is operator.getitem)
    first = [n for n in nodes if n in needed]
    second = [n for n in nodes if n.op not in ("placeholder", "output") and n not in needed]
    given = zip((n for n in nodes if n.op == "placeholder"), backward.inputs, strict=True)
    placeholders = {n: (slot.kind, slot.key, slot.peer) for n, slot in given}

    def read_by(body: list[fx.Node]) -> set[fx.Node]:
        return {i for n in body for i in n.all_input_nodes}

    # A gradient received from the next stage that the weight gradient reads (a linear
    # layer's, say, where no op of the input gradient's reads it first) is received by the
    # first half, which runs when the next stage sends it, and kept for the second.
    handed = [
        n for n in placeholders
        if placeholders[n][0] == Role.RECEIVED and n in read_by(second)
    ]  # fmt: skip
    later = set(second)
    kept = [n for n in first if any(u in later for u in n.users)] + handed
    read_first = read_by(first) | set(handed)
    read_second = read_by(second) - set(handed)
    input_grad = build_program(
        backward.gm,
        backward.stage,
        "input-grad",
        [(n, *placeholders[n]) for n in placeholders if n in read_first],
        first,
        [(slot.kind, slot.key, v, slot.peer) for slot, v in slots if v in needed]
        + [("stash", n.name, n, None) for n in kept],
    )
    weight_grad = build_program(
        backward.gm,
        backward.stage,
        "weight-grad",
        [(n, *placeholders[n]) for n in placeholders if n in read_second]
        + [(n, Role.STASHED, n.name, None) for n in kept],
        second,
        [(slot.kind, slot.key, v, slot.peer) for slot, v in slots if v not in needed],
    )
    return input_grad, weight_grad


def _replays(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Each draw of a program with the generator ops around it (recompute's replay: the state
    read and the saved state set before the draw, and the state set back after it, which sets
    the state read before)."""
    replays: dict[fx.Node, list[fx.Node]] = {}
    owner: dict[fx.Node, fx.Node] = {}
    pending: list[fx.Node] = []
    for node in nodes:
        if is_random(node):
            replays[node] = pending
            owner.update(dict.fromkeys(pending, node))
            pending = []
        elif op_kind(node) is OpKind.RNG:
            state = node.args[0] if node.args else None
            if isinstance(state, fx.Node) and state in owner:  # sets back what was read
                replays[owner[state]].append(node)
            else:
                pending.append(node)
    return replays


def of_params(nodes: list[fx.Node], params: set[fx.Node]) -> set[fx.Node]:
    """Which of ``nodes`` (in program order) are computed from the parameters ``params``
    alone, neither drawing nor writing in place: what the shard pass re-derives next to each
    use (:mod:`zerocc.compiler.passes.support.param_uses`), such as a weight's transpose, its
    cast, or its float8 scale and cast. A program that reads one derives it again from the
    parameters: kept from one program to another it would be a ``keep`` of a parameter's
    value, which the shard pass drops with the rest of what it re-derives."""
    found: set[fx.Node] = set()
    for node in nodes:
        inputs = node.all_input_nodes
        target = node.target
        writes = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        if (
            node.op == "call_function"
            and inputs
            and not writes
            and not is_random(node)
            and all(i in params or i in found for i in inputs)
        ):
            found.add(node)
    return found


def stage_model(model: ModelInfo, *stages: Stage) -> ModelInfo:
    """What of ``model`` the stages (one, or a pipeline rank's) hold: their parameters (a tied
    one in every stage that reads it) and the buffers, for the passes that compile their
    programs."""
    held = {fqn for stage in stages for fqn in stage.params}
    return ModelInfo(tuple(p for p in model.params if p.fqn in held), model.buffers, model.modules)


def step_form(program: StageProgram, model: ModelInfo) -> fx.GraphModule:
    """``program`` as the passes compile a step: what it receives and what its forward kept
    read by ``recv`` and ``kept`` ops, what it sends and keeps written by ``send`` and
    ``keep`` ops, and the output ``(loss, *grads)``, one gradient per trainable parameter of
    ``model`` (the stage's, :func:`stage_model`; None where the program computes none, and
    no loss but in the last stage's forward)."""
    gm = fx.GraphModule(program.gm, copy.deepcopy(program.gm.graph))
    graph, ops = gm.graph, torch.ops.zerocc
    forward = program.phase == "forward"
    phase = "forward" if forward else "backward"
    nodes = list(graph.nodes)

    def emit(target: torch._ops.OpOverload, args: tuple) -> fx.Node:
        name = target.overloadpacket.__name__  # recv, not recv_default
        return tag(graph.create_node("call_function", target, args, name=name), phase=phase)

    placeholders = (n for n in nodes if n.op == "placeholder")
    for node, slot in zip(placeholders, program.inputs, strict=True):
        if slot.kind not in (Role.RECEIVED, Role.STASHED):
            continue
        value = node.meta["val"]
        like = (list(value.shape), value.dtype, value.device)
        with graph.inserting_before(node):
            if slot.kind == Role.RECEIVED:
                new = emit(ops.recv.default, (*like, slot.peer, slot.key))
            else:
                new = emit(ops.kept.default, (*like, slot.key))
        new.meta["val"] = value
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    output = nodes[-1]
    loss, grads = None, {}
    with graph.inserting_before(output):
        for slot, value in zip(program.outputs, output.args[0], strict=True):
            if slot.kind == "send":
                emit(ops.send.default, (value, slot.peer, slot.key))
            elif slot.kind == "stash":
                emit(ops.keep.default, (value, slot.key))
            elif slot.kind == "loss":
                loss = value
            else:
                grads[slot.key] = value
    output.args = ((loss, *(grads.get(p.fqn) for p in model.trainable)),)
    gm.recompile()
    return gm


def update_graph(model: ModelInfo, device: torch.device, loss_scale: bool) -> fx.GraphModule:
    """The graph a pipeline rank's update is compiled from (with ``update_of`` in the pass
    context): the parameters of ``model`` (the rank's stages'), the loss scale (``loss_scale``:
    the gradients are unscaled by it) and no forward or backward; the passes add the reduction
    of the gradients the stages' programs accumulated, the checks and the update."""
    graph = fx.Graph()
    inputs = [(PARAM, p.fqn, p.shape, p.dtype) for p in model.params]
    if loss_scale:
        inputs.append((LOSS_SCALE, LOSS_SCALE_KEY, (), torch.float32))
    with FakeTensorMode():
        for role, key, shape, dtype in inputs:
            node = graph.placeholder(key)
            node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
            name_placeholder(node, _prefix(role) + key)
            tag(node, role=role, key=key, phase="forward")
    graph.output((None, *(None for _ in model.trainable)))
    return fx.GraphModule(torch.nn.Module(), graph)


def build_program(
    root: fx.GraphModule,
    stage: int,
    phase: Phase,
    inputs: list[tuple[fx.Node, Role, str, int | None]],
    body: list[fx.Node],
    outputs: list[tuple[Output, str, fx.Node, int | None]],
) -> StageProgram:
    """A program of ``body`` (nodes of ``root``'s graph, in order) that reads ``inputs``
    (a node of ``root`` each, which becomes a placeholder of that role and key; the stage a
    received one comes from) and returns ``outputs`` (the stage a sent one goes to)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, kind, key, _ in inputs:
        new = graph.placeholder(node.name)
        new.meta["val"] = node.meta.get("val")
        name_placeholder(new, _prefix(kind) + key)
        env[node] = tag(new, role=kind, key=key, phase=phase)
    for node in body:
        env[node] = copy_node(graph, node, env.__getitem__)
    graph.output(tuple(env[n] for _, _, n, _ in outputs))
    return StageProgram(
        stage,
        phase,
        fx.GraphModule(root, graph),
        tuple(_slot(kind, key, node, peer) for node, kind, key, peer in inputs),
        tuple(_slot(kind, key, node, peer) for kind, key, node, peer in outputs),
    )


def _prefix(kind: Role) -> str:
    return {PARAM: "p_", BUFFER: "b_", BATCH: "batch_", LOSS_SCALE: ""}.get(kind, "")


def _slot(kind: Role | Output, key: str, node: fx.Node, peer: int | None) -> Slot:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise PlanError(f"pipeline.split: {node.name} crosses a cut but is not a tensor")
    return Slot(kind, key, tuple(value.shape), value.dtype, peer)
