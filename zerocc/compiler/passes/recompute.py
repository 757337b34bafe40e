"""recompute: activation checkpointing of chosen units, on the captured joint graph.

A unit's *region* is the forward nodes attributed to it: those whose source module's innermost
unit root is the unit's (a nested unit owns its own modules). Each maximal run of a region in
program order (one call of the unit) is checkpointed on its own, as ``torch.utils.checkpoint``
checkpoints one call:

- **Kept** (saved for backward as before): values made outside the run (its inputs),
  placeholders, parameters and what is computed from them alone (the shard pass re-derives
  those next to each use, from the gathered copy live there), the run's outputs (what forward
  nodes outside it read), random ops drawing from a generator of their own, and ops with side
  effects outside the run (batch norm's running statistics; expert parallelism's exchanges and
  experts, with their waits), which are never duplicated.
- **Recomputed**: every other value of the run that a backward node reads. The forward nodes it
  needs are copied, in program order, right before the first backward node that reads any of
  them, tagged ``phase="backward"`` with a note naming the unit; backward reads the copies, so
  the originals die in forward. In-place ops on storage the run itself allocated (dropout's
  ``bernoulli_``) are copied with it. A node whose copy could not see what the original saw
  (it would read a kept value that an in-place op overwrites before the recompute) is kept
  instead, and its note says why.
- **Random ops** replay their forward's numbers (:mod:`zerocc.ir.rng`): the generator state is
  saved right before the op in forward, set before its copy and restored after it.

It runs before shard: the copies are ordinary backward nodes there, so stage 3 gathers a unit
for its recompute through the unit's backward use window, with no special case.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

import zerocc.ir.rng  # noqa: F401  (registers the RNG ops the copies use)
from zerocc.compiler.names import glob_matches
from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.passes.support.param_uses import analyze
from zerocc.compiler.units import Unit
from zerocc.errors import PlanError
from zerocc.ir.access import StorageRoots, written_arguments
from zerocc.ir.nodes import copy_node, emit, info, op_name, tag, val
from zerocc.ir.rng import RNG_STATE, SET_RNG_STATE, argument, is_random
from zerocc.ir.verify import check_well_formed

aten = torch.ops.aten


def chosen_units(units: list[Unit], spec: str | list[str]) -> list[Unit]:
    """The units ``recompute.units`` names: none, all but the root, or those matching a
    glob (each glob must match a unit)."""
    if spec == "none":
        return []
    if spec == "all":
        # (the root unit left out: its forward ends where backward begins)
        return [u for u in units if u.roots != ("",)]
    chosen = []
    for pattern in spec:
        hits = [u for u in units if glob_matches(u.key, pattern)]
        if not hits:
            names = ", ".join(u.key for u in units[:8])
            raise PlanError(
                f"recompute.units: pattern {pattern!r} matches no unit; units are: {names}"
            )
        chosen += [u for u in hits if u not in chosen]
    return chosen


def owner_of(module: str, roots: list[str]) -> str:
    """The innermost unit root (a module FQN, "" for the root) that contains ``module``."""
    inside = [r for r in roots if r == "" or module == r or module.startswith(r + ".")]
    return max(inside, key=len, default="")


@dataclass
class Run:
    """One call of a checkpointed unit: its forward nodes and what the pass does with them."""

    unit: str
    nodes: list[fx.Node]
    kept: set[fx.Node] = field(default_factory=set)
    saved: list[fx.Node] = field(default_factory=list)  # read by backward, to recompute
    copied: list[fx.Node] = field(default_factory=list)  # program order
    first_reader: fx.Node | None = None  # where the copies go


class _Analysis:
    """Storage, ownership and parameter facts of the captured graph, computed once.

    Every value lives in the storage of its *root*, the node that allocated it (views, in-place
    ops and a getitem of a view list share their input's root), as :mod:`zerocc.ir.access` counts
    them; ``writers`` lists, per root, the nodes that write it in place, in program order.
    """

    def __init__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        self.gm = gm
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.param_like = set(analyze(gm, [p.fqn for p in ctx.model.trainable]).roots)
        roots = StorageRoots(gm)
        self.root = roots.root
        self.writes: dict[fx.Node, set[fx.Node]] = {}
        self.writers: dict[fx.Node, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            self.writes[node] = {self.root[a] for a in written_arguments(node)}
            for root in self.writes[node]:
                self.writers.setdefault(root, []).append(node)

    def runs(self, owners: dict[fx.Node, str], chosen: dict[str, str]) -> list[Run]:
        """Maximal runs, in program order, of forward nodes owned by a chosen unit root."""
        runs: list[Run] = []
        current: Run | None = None
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or info(node).phase != "forward":
                continue
            owner = owners[node]
            if current is None or owners[current.nodes[0]] != owner:
                current = Run(chosen[owner], []) if owner in chosen else None
                if current is not None:
                    runs.append(current)
            if current is not None:
                current.nodes.append(node)
        return runs

    def plan(self, run: Run) -> None:
        """Decide what the run keeps, what backward reads of it, and what has to be copied.

        A node whose copy could not reproduce its value (it would read a kept value some
        in-place op overwrites before the recompute, or allocate storage written by an op that
        is not copied) is kept too, with a note saying why, and the plan is made again (an
        in-place write to what is kept now is kept with it)."""
        members = set(run.nodes)
        while True:
            for node in run.nodes:  # program order: a getitem's source and a write's root first
                if node not in run.kept and self._kept(node, members, run.kept):
                    run.kept.add(node)
            run.saved = [
                n
                for n in run.nodes
                if n not in run.kept and any(info(u).phase == "backward" for u in n.users)
            ]
            if not run.saved:
                run.copied = []
                return
            run.first_reader = min(
                (u for n in run.saved for u in n.users if info(u).phase == "backward"),
                key=self.order.__getitem__,
            )
            unsafe = self._closure(run, members)
            unsafe.update(self._stale_reads(run))
            if not unsafe:
                return
            for node, why in unsafe.items():
                run.kept.add(node)
                info(node).note = info(node).note or f"kept for backward, not recomputed: {why}"

    def _kept(self, node: fx.Node, members: set[fx.Node], kept: set[fx.Node]) -> bool:
        if node in self.param_like:
            return True
        if any(u not in members and info(u).phase != "backward" for u in node.users):
            return True  # an output of the run: read by forward outside it, or returned
        if node.target is operator.getitem:
            return node.args[0] in kept or node.args[0] not in members
        if op_name(node.target) == "zerocc.wait" and node.args[0].is_impure():
            return True  # what a start never duplicated made (expert parallelism's exchanges)
        if is_random(node) and (
            argument(node, "generator") is not None or not _tensor_inputs(node)
        ):
            return True  # only the default generator is replayed, for an op that has a device
        written = self.writes[node]
        if not written:
            # A side effect outside any tensor is never duplicated; a draw is replayed (fx
            # calls every op torch tags as seeded impure, attention without dropout too).
            seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
            return node.is_impure() and not seeded
        # In place on storage the run allocates and recomputes: replayed on the copy.
        return any(r not in members or r in kept for r in written)

    def _closure(self, run: Run, members: set[fx.Node]) -> dict[fx.Node, str]:
        """Fill ``run.copied``: the run's nodes that recomputing ``saved`` needs, with every
        in-place write to storage they allocate (so the copies see the same sequence of
        values). Returns the allocations some op that is not copied writes."""
        copied: set[fx.Node] = set()
        unsafe: dict[fx.Node, str] = {}
        stack = list(run.saved)
        while stack:
            node = stack.pop()
            if node in copied or node not in members or node in run.kept:
                continue
            copied.add(node)
            stack += node.all_input_nodes
            for writer in self.writers.get(node, []) if self.root[node] is node else []:
                if info(writer).phase == "backward":
                    continue  # it reads a saved value: rewired to the copies like any reader
                if writer not in members or writer in run.kept:
                    unsafe[node] = f"{writer.name} ({op_name(writer.target)}) writes it in place"
                stack.append(writer)
        run.copied = [n for n in run.nodes if n in copied]
        return unsafe

    def _stale_reads(self, run: Run) -> dict[fx.Node, str]:
        """Copies that would read a kept value after an in-place write the original did not
        see (between the original and the recompute)."""
        copied = set(run.copied)
        until = self.order[run.first_reader]
        unsafe = {}
        for node in run.copied:
            for arg in node.all_input_nodes:
                if arg in copied:
                    continue
                for writer in self.writers.get(self.root[arg], []):
                    if self.order[node] < self.order[writer] < until:
                        unsafe[node] = (
                            f"it reads {arg.name}, which {writer.name} "
                            f"({op_name(writer.target)}) overwrites in place before backward"
                        )
        return unsafe


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]


def _save_rng_state(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """Right before random ``node`` in forward: the state of the generator it draws from."""
    like = _tensor_inputs(node)[0]  # on the device whose generator it draws from
    with graph.inserting_before(node):
        return emit(
            graph,
            RNG_STATE,
            (like,),
            phase="forward",
            module=info(node).module,
            note=f"RNG state before {node.name}, replayed by its recompute",
        )


def _replayed(graph: fx.Graph, node: fx.Node, state: fx.Node, copies: dict) -> fx.Node:
    """A copy of random ``node`` drawing from the forward's ``state``; the generator is left as
    it was, so every later draw is what it would have been without recompute."""
    like = copies.get(state.args[0], state.args[0])
    now = emit(graph, RNG_STATE, (like,), phase="backward", note=f"before {node.name}'s replay")
    emit(graph, SET_RNG_STATE, (state, like), phase="backward", note=f"replay {node.name}'s draw")
    copy = copy_node(graph, node, lambda a: copies.get(a, a))
    emit(graph, SET_RNG_STATE, (now, like), phase="backward", note="later draws are unchanged")
    return copy


def recompute_run(gm: fx.GraphModule, run: Run) -> None:
    """Copy the run's needed forward before its first backward reader; rewire backward."""
    graph = gm.graph
    states = {node: _save_rng_state(graph, node) for node in run.copied if is_random(node)}
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(run.first_reader):
        for node in run.copied:
            if node in states:
                copies[node] = _replayed(graph, node, states[node], copies)
            else:
                copies[node] = copy_node(graph, node, lambda a: copies.get(a, a))
            tag(copies[node], phase="backward", note=f"recomputed: forward of {run.unit}")
    made = set(copies.values())
    for node in run.saved:
        for user in list(node.users):
            if info(user).phase == "backward" and user not in made:
                user.replace_input_with(node, copies[node])
    # What only backward read is dead in forward now: the generated code would hold it to the
    # end of the program (it drops a value after its last use, and it has none).
    for node in reversed(run.nodes):
        if not node.users and not node.is_impure():
            graph.erase_node(node)


@register_pass(
    "recompute",
    requires=("units",),
    provides=("recompute",),
    forbids=("sharded_params",),
    options=lambda plan: {"units": plan.recompute.units},
    enabled=lambda plan: plan.recompute.enabled,
    when="recompute.units is set",
    off_because="recompute.units is 'none'",
    turn_on="set recompute.units (e.g. all)",
)
def recompute(gm: fx.GraphModule, ctx: PassContext, *, units: str | list[str]) -> fx.GraphModule:
    """Recompute the forward of the chosen units in backward instead of saving it."""
    chosen: dict[str, str] = {}  # unit root module -> the unit named in notes (trainable first)
    for unit in sorted(chosen_units(ctx.units, units), key=lambda u: not u.trainable):
        for root in unit.roots:  # (a unit of several blocks: each block's calls its own runs)
            chosen.setdefault(root, unit.name)
    if not chosen:
        return gm
    roots = sorted({r for u in ctx.units for r in u.roots})
    owners = {
        n: owner_of(info(n).module or "", roots) for n in gm.graph.nodes if n.op == "call_function"
    }
    analysis = _Analysis(gm, ctx)
    runs = analysis.runs(owners, chosen)
    for run in runs:  # tag, then act: every decision is taken on the captured graph
        analysis.plan(run)
    for run in runs:
        if run.copied:
            recompute_run(gm, run)
    check_well_formed(gm, after="recompute")
    return gm
