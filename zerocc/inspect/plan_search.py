"""`zerocc plan auto`: the fastest plan that fits, found with the cost model (issue 52).

The plan names the workload and whatever the user fixes; every field of the search space that
the plan leaves out is tried: the ZeRO stage (0-3), recomputation (none, every other unit,
all), on a GPU the optimizer's offload to host memory, and the mesh: tensor parallelism
within a machine (``parallel.tp`` 1, 2, 4, 8, where the plan names its ``tp_layers``, each
with and without sequence parallelism), over several machines hybrid sharding
(``zero.replicate``: shards within a machine, replicas across) and, where
``cost.group_link_gbps`` gives the machine's link, stage 3's secondary partition
(``zero.secondary_group``: a machine's ranks, hpZ), and for a model with experts modules
expert parallelism (``parallel.ep`` 1, 2, 4, ... dividing the ranks; its token exchanges
timed by the cost model).
Each candidate is compiled for the world size on fake tensors, as `zerocc estimate` compiles a
plan (a meta model of any size), and its peak memory per rank and step time predicted; those
over the memory a rank has are dropped and the rest ranked by step time per token (a tp group
trains one batch: fewer tokens per step). A candidate that cannot be compiled (a plan error)
is listed with why.

Candidates that differ only in what the passes do share one capture; each runs its passes on
a copy of it (:class:`~zerocc.compiler.driver.program.CapturedSteps`): a capture per tp degree.
With ``pipelines`` (`zerocc plan auto --pipelines`), pipelines are tried too (``parallel.pp``
2, 4, 8, as far as the model has units, with 1f1b and zero-bubble schedules), each compiled
rank by rank and timed by its schedule, as `zerocc estimate` times a pipeline plan
(:func:`~zerocc.inspect.pipeline_estimate.estimate_pipeline`): the highest rank's peak, the
schedule's makespan and the slowest update. They are opt-in because each compiles every
pipeline rank's programs, several times a candidate without one, and the space grows by a
mesh per degree and schedule. A pipeline is also tried with 2 and 4 times its default
micro-batches (one per stage), where each rank's batch divides into them: a smaller bubble
and fewer activations in flight, at smaller ops.

Most candidates are not compiled: the cost model's orders rule them out
(:mod:`zerocc.inspect.plan_pruning`); ``exhaustive=True`` (`zerocc plan auto --exhaustive`)
compiles every one. A deep model's candidates are drawn from compiles of shallow copies of it
and the pick compiled whole (:mod:`zerocc.inspect.plan_depth`). Last, the knobs that move a
step by a few percent are tuned around the pick (:mod:`zerocc.inspect.plan_refine`): its
blocks two to a unit (``units.blocks_per_unit``: a gather and a reduction for two blocks,
both held at once), its collectives in buckets of two of its largest units
(``overlap.bucket_mb``: the same messages, each unit still freed on its own, at the cost of
copies in and out), at stage 3 a second unit prefetched, and where it offloads, half its
units' states offloaded instead of all (``offload.ratio``: faster where the memory allows);
where one of them is faster, again around it, until none is (4 rounds at most).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import yaml

from zerocc.compiler.driver.plan_changes import derive_plan, plan_field, plan_sets, set_field
from zerocc.compiler.driver.program import CapturedSteps
from zerocc.compiler.driver.session import CompileSession, plan_mesh
from zerocc.compiler.parallel.experts import ExpertParallel
from zerocc.compiler.passes.recompute import chosen_units
from zerocc.compiler.plan import Plan
from zerocc.compiler.units import Unit
from zerocc.compiler.workload import Workload, load_workload
from zerocc.cost.memory import model_state_bytes_of
from zerocc.cost.rates import DeviceRates, rates_for
from zerocc.errors import PlanError, ZeroccError
from zerocc.inspect.estimate import estimate, first_batch, inspect_plan
from zerocc.inspect.pipeline_estimate import PipelineEstimate, estimate_pipeline
from zerocc.inspect.plan_depth import DEPTHS, BlockStack, confirmed, extrapolated
from zerocc.inspect.plan_pruning import SAVES_MEMORY, SOME, Candidate, pruned_search
from zerocc.inspect.plan_refine import BLOCKS, REFINED, climb, refinements, two_units_mb
from zerocc.ir.quantities import human_bytes, human_seconds

HOST_ONLY = {"offload.optimizer"}  # fields that mean nothing where host memory is the device's
SEQUENCE_PARALLEL = "parallel.sequence_parallel"  # (tried where the plan names tp_layers)
TP_DEGREES = (1, 2, 4, 8)  # tensor parallelism within a machine (NVLink's reach)
PP_DEGREES = (1, 2, 4, 8)  # pipeline stages' ranks (each stage at least one unit)
# Pipeline schedules tried where the plan names none: 1f1b (one stage a rank) and ZBV (two, the
# backward split: the smaller bubble, the activations of more micro-batches held)
PP_SCHEDULES = ("1f1b", "zero-bubble")
EP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # expert parallelism (DeepSeek-V3 trains at ep 64)
MICROBATCHES = "pipeline.microbatches"
# A pipeline's micro-batches tried beyond its default (one per stage): 2 and 4 times as many
MICROBATCH_FACTORS = (2, 4)


@dataclass(frozen=True)
class Search:
    """Every candidate, fastest first; the best is the fastest that fits ``memory`` per rank."""

    plan: Plan
    world_size: int
    memory: int
    rates: DeviceRates
    candidates: list[Candidate]
    fixed: list[str]  # fields of the space the plan sets, not searched
    counts_tokens: bool = False  # the candidates' work is tokens (else batches)
    stack: BlockStack | None = None  # the model's blocks, cut to screen candidates (plan_depth)

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits(self.memory)), None)

    @property
    def grid(self) -> list[Candidate]:
        """The candidates of the search space, without those tried around the pick
        (:data:`REFINED`)."""
        return [c for c in self.candidates if not set(c.fields) & set(REFINED)]

    def format(self) -> str:
        """The table of candidates and the choice, or why none fits."""
        pruned = sum(c.pruned is not None for c in self.candidates)
        around = len(self.candidates) - len(self.grid)
        lines = [
            f"{self.plan.source or 'plan'}: {len(self.candidates)} candidate plans on "
            f"{self.world_size} ranks, {human_bytes(self.memory)} per rank "
            f"({self.rates.device} rates)"
            + (f"; {around} of them around the pick" if around else "")
            + (f"; {pruned} pruned, {len(self.candidates) - pruned} compiled" if pruned else ""),
        ]
        if self.fixed:
            lines.append(f"fixed by the plan, not searched: {', '.join(self.fixed)}")
        lines.append(
            f"  {'step':>10}  {'tokens/s':>9}  {'peak':>10}  fits  {'bound by':<13}  plan "
            "(bytes per step by mesh group)"
        )
        for c in self.candidates:
            if not c.predicted:
                lines.append(f"  {'-':>10}  {'-':>9}  {'-':>10}  -     {'-':<13}  "
                             f"{c.describe()}: {c.error or c.pruned}")  # fmt: skip
                continue
            fits = "yes" if c.fits(self.memory) else "no"
            rate = self.tokens_per_s(c)
            near = "≈" if c.extrapolated else ""
            lines.append(
                f"  {near + human_seconds(c.step_s):>10}  {rate:>9}  "
                f"{near + human_bytes(c.peak):>10}  "
                f"{fits:<4}  {c.bound_by:<13}  {c.describe()} ({c.moved_text() or 'none'})"
            )
        if self.stack is not None and any(c.extrapolated for c in self.candidates):
            lines.append(
                f"≈: the line through compiles of the model cut to {self.stack.describe()}; "
                "the others compiled whole"
            )
        best = self.best
        if best is None:
            closest = min(
                (c for c in self.candidates if c.predicted),
                key=lambda c: c.peak,
                default=None,
            )
            over = (
                f" (the closest, {closest.describe()}, needs {human_bytes(closest.peak)})"
                if closest is not None
                else ""
            )
            lines.append(
                f"no candidate fits{over}: more ranks, offload to NVMe or a smaller batch "
                "would lower the peak (`zerocc estimate` prints the figures of each)"
            )
        else:
            lines.append(f"best: {best.describe()} ({why(best, self.candidates, self.memory)})")
        return "\n".join(lines)

    def tokens_per_s(self, candidate: Candidate) -> str:
        """The candidate's predicted tokens per second over every rank ('-' when the workload
        does not count tokens)."""
        if not self.counts_tokens or candidate.step_s <= 0:
            return "-"
        return f"{candidate.work / candidate.step_s:,.0f}"


def why(best: Candidate, candidates: list[Candidate], memory: int) -> str:
    """Why the best won: its time and peak, and what the faster candidates needed."""
    faster = [
        c for c in candidates
        if c.predicted and c.seconds_per_work < best.seconds_per_work
    ]  # fmt: skip
    said = f"predicted step {human_seconds(best.step_s)}, peak {human_bytes(best.peak)}"
    if faster:
        least = min(c.peak for c in faster)
        said += (
            f"; {len(faster)} faster candidate(s) need {human_bytes(least)} or more, over "
            f"{human_bytes(memory)}"
        )
    return said


def search_space(
    plan: Plan,
    device: str,
    world_size: int,
    ranks_per_node: int | None = None,
    experts: bool = False,
    some: list[str] | None = None,
    units: int = 0,
) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
    """The fields to try and their values, and the fields the plan fixes (set in its file).
    ``ranks_per_node``: ranks per machine (None: one machine), which bounds tensor parallelism
    and places hybrid sharding's replicas; ``experts``: the model has experts modules, which
    expert parallelism may split; ``some``: units to recompute between none and all;
    ``units``: the model's trainable units, which a pipeline's stages divide."""
    per_node = min(ranks_per_node or world_size, world_size)
    space, fixed = {}, []
    chains = {
        path: tuple(some if v == SOME else v for v in values if v != SOME or some)
        for path, values in SAVES_MEMORY.items()
    }
    mesh = _mesh_space(plan, world_size, per_node, experts, units)
    for path, values in {**chains, **mesh}.items():
        if device != "cuda" and path in HOST_ONLY:
            continue
        if path == SEQUENCE_PARALLEL and not plan.parallel.tp_layers:
            continue  # (nothing to split the sequence beside)
        if plan_sets(plan, path):
            fixed.append(f"{path}: {plan_field(plan, path)}")
            continue
        space[path] = values
    return space, fixed


def _mesh_space(
    plan: Plan, world_size: int, per_node: int, experts: bool, units: int
) -> dict[str, tuple[Any, ...]]:
    """The mesh's fields worth trying: tp degrees that divide a machine's ranks (where the plan
    names the layers tp splits), over several machines one replica per machine, or a secondary
    partition within each where the plan gives the ``secondary`` group a link of its own
    (stage 3's backward gathers inside a machine), and for a
    mixture of experts the ep degrees that divide the ranks (those that do not divide the data
    ranks of a candidate's mesh are no candidates; those that do not divide its experts, plan
    errors listed as such), and for a model of ``units`` units pipelines of up to as many
    stages' ranks, with each schedule of :data:`PP_SCHEDULES`."""
    space: dict[str, tuple[Any, ...]] = {}
    if experts:
        space["parallel.ep"] = tuple(d for d in EP_DEGREES if world_size % d == 0)
    if units >= 2:  # a pipeline: each of its stages at least one unit
        degrees = tuple(d for d in PP_DEGREES if world_size % d == 0 and d <= units)
        if len(degrees) > 1:
            space["parallel.pp"] = degrees
            space["pipeline.schedule"] = PP_SCHEDULES
    if plan.parallel.tp_layers:
        degrees = tuple(d for d in TP_DEGREES if d <= per_node and per_node % d == 0)
        if len(degrees) > 1:
            space["parallel.tp"] = degrees
    if world_size > per_node and world_size % per_node == 0:
        space["zero.replicate"] = (1, world_size // per_node)
        if "secondary" in plan.cost.group_link_gbps:
            # stage 3 across machines, backward's gathers kept inside one (hpZ), where the plan
            # says a machine's link is its own (on one link for all it only costs memory); a
            # candidate whose shard group it cannot divide, or at another stage, is none
            space["zero.secondary_group"] = (1, per_node)
    return space


def candidate_fields(space: dict[str, tuple[Any, ...]]) -> Iterator[dict[str, Any]]:
    """Every combination of the space's values."""
    for values in itertools.product(*space.values()):
        yield dict(zip(space, values, strict=True))


def search_plans(
    plan: Plan,
    world_size: int,
    memory: int,
    rates: DeviceRates | None = None,
    workload: Workload | None = None,
    ranks_per_node: int | None = None,
    exhaustive: bool = False,
    pipelines: bool = False,
    whole: bool = False,
) -> Search:
    """Compile the candidates of ``plan``'s search space for ``world_size`` ranks and rank
    them (see the module's docstring); ``memory``: bytes a rank has on its device;
    ``ranks_per_node``: ranks per machine (None: one machine); ``exhaustive``: compile every
    candidate, none pruned; ``pipelines``: try pipelines too (a plan that sets
    ``parallel.pp`` is searched around its pipeline either way); ``whole``: compile every
    candidate at the model's depth (by default a deep model's are drawn from shallow copies
    of it, :mod:`zerocc.inspect.plan_depth`, and the pick compiled whole)."""
    rates = rates or rates_for(plan)
    workload = workload or load_workload(plan)
    experts = ExpertParallel.holds_experts(workload.model, plan)
    units = trainable_units(plan, workload, world_size)
    some = [u.key for u in units[::2]] if len(units) >= 2 else None  # (every other unit)
    space, fixed = search_space(plan, rates.device, world_size, ranks_per_node, experts, some,
                                len(units) if pipelines else 0)  # fmt: skip
    bucket_mb = two_units_mb(plan, units)
    captured = CapturedSteps()  # (the candidates differ in their passes: one capture serves)
    microbatches = _searches_microbatches(plan, space)
    if microbatches:
        space[MICROBATCHES] = (None,)  # (the default; more for each pipeline, below)
    plans = {}
    for base in candidate_fields(space):
        if _no_pipeline_but_its_schedule(plan, base):
            continue
        derived = _derived(plan, base, world_size)
        if derived is None:
            continue  # (the schema or the world refuses it)
        plans[_key(base)] = (base, derived)
        for count in _more_microbatches(derived, workload, world_size) if microbatches else ():
            fields = {**base, MICROBATCHES: count}
            if (more := _derived(plan, fields, world_size)) is not None:
                plans[_key(fields)] = (fields, more)

    def predict_whole(fields: dict[str, Any]) -> Candidate:
        derived = plans[_key(fields)][1]
        predicted = _predicted(fields, derived, world_size, rates, workload, captured)
        return replace(predicted, work=_work(derived, world_size, workload))

    stack = None if whole else BlockStack.of(workload.model)
    copies = _shallow_copies(plan, workload, world_size, stack) if stack is not None else []

    def predict(fields: dict[str, Any]) -> Candidate:
        derived = plans[_key(fields)][1]
        if stack is None or derived.parallel.pp > 1:  # (a pipeline's stages split the units)
            return predict_whole(fields)
        points = []
        for shallow in copies:
            at = shallow.fields(fields)
            cut = _derived(plan, at, world_size)
            if cut is None:
                return predict_whole(fields)
            point = _predicted(at, cut, world_size, rates, shallow.workload, shallow.captured)
            if point.error is not None:  # (say, the plan names a block beyond the cut)
                return predict_whole(fields)
            points.append(point)
        line = extrapolated(points, [shallow.depth for shallow in copies], stack.depth)
        return replace(line, fields=fields, work=_work(derived, world_size, workload))

    def states(fields: dict[str, Any]) -> int:
        derived = plans[_key(fields)][1]
        try:
            session = CompileSession.open(workload.model, derived, world_size, workload.loss_fn)
        except ZeroccError:
            return 0  # (compiling it says why)
        return model_state_bytes_of(session.layout)["total"]

    fields_of = [fields for fields, _ in plans.values()]
    if exhaustive:
        candidates = [predict(fields) for fields in fields_of]
    else:
        candidates = pruned_search(fields_of, predict, states, memory)
    tried = set(plans)

    def around(best: Candidate) -> list[Candidate]:
        """The candidates the knobs make of ``best``, each new one predicted (one that does
        not apply is not a candidate)."""
        picked = plans[_key(best.fields)][1]
        bucket = bucket_mb
        if BLOCKS in best.fields:  # (buckets of two of its own, larger, units)
            bucket = two_units_mb(picked, trainable_units(picked, workload, world_size))
        out = []
        for fields in refinements(plan, best.fields, picked, bucket):
            if _key(fields) in tried:
                continue
            tried.add(_key(fields))
            if (derived := _derived(plan, fields, world_size)) is not None:
                plans[_key(fields)] = (fields, derived)
                if (refined := predict(fields)).error is None:
                    out.append(refined)
        return out

    def confirm(candidates: list[Candidate]) -> list[Candidate]:
        return confirmed(candidates, predict_whole, memory) if stack is not None else candidates

    candidates = climb(confirm(candidates), memory, around, confirm)
    candidates.sort(key=lambda c: (c.pruned is not None, c.error is not None,
                                   c.seconds_per_work, c.peak))  # fmt: skip
    counts_tokens = workload.tokens_per_batch is not None
    return Search(plan, world_size, memory, rates, candidates, fixed, counts_tokens, stack)


@dataclass(frozen=True)
class _ShallowCopy:
    """The workload with the model's stack cut to ``depth`` blocks, its own captures, and its
    every-other-unit recompute (the search's :data:`SOME` at this depth)."""

    depth: int
    workload: Workload
    captured: CapturedSteps
    some: list[str] | None

    def fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A candidate's fields for this copy: its every-other-unit list, this copy's."""
        if isinstance(fields.get("recompute.units"), list):
            return {**fields, "recompute.units": self.some}
        return fields


def _shallow_copies(
    plan: Plan, workload: Workload, world_size: int, stack: BlockStack
) -> list[_ShallowCopy]:
    copies = []
    for depth in DEPTHS:
        cut = replace(workload, model=stack.cut(workload.model, depth))
        some = [u.key for u in trainable_units(plan, cut, world_size)[::2]]
        copies.append(_ShallowCopy(depth, cut, CapturedSteps(), some or None))
    return copies


def _key(fields: dict[str, Any]) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in fields.items())


def trainable_units(plan: Plan, workload: Workload, world_size: int) -> list[Unit]:
    """The units ``recompute.units: all`` would recompute: every other one of them is
    the search's recompute between none and all (half the activations kept, at about half the
    recompute's cost), and a pipeline's stages divide them. Where the plan (without its
    pipeline) cannot be laid out (each candidate says why): none."""
    flat = (derive_plan(plan, {"parallel.pp": 1}) if plan.parallel.pp > 1 else plan) or plan
    try:
        session = CompileSession.open(workload.model, flat, world_size, workload.loss_fn)
    except ZeroccError:
        return []
    return [u for u in chosen_units(session.units, "all") if u.trainable]


def _derived(plan: Plan, fields: dict[str, Any], world_size: int) -> Plan | None:
    """``plan`` with ``fields`` set; None where the schema or the world refuses it."""
    changed = {k: v for k, v in fields.items() if plan_field(plan, k) != v}
    derived = derive_plan(plan, changed) if changed else plan
    return derived if derived is not None and _takes(derived, world_size) else None


def _searches_microbatches(plan: Plan, space: dict[str, tuple[Any, ...]]) -> bool:
    """Whether a pipeline's micro-batch count is searched: pipelines are tried (or the plan
    has one) and the plan does not set the count."""
    pipelines = "parallel.pp" in space or plan.parallel.pp > 1
    return pipelines and not plan_sets(plan, MICROBATCHES)


def _more_microbatches(plan: Plan, workload: Workload, world_size: int) -> list[int]:
    """Micro-batch counts beyond a pipeline's default (one per stage) worth trying:
    :data:`MICROBATCH_FACTORS` times it, where each rank's batch divides into them (more
    micro-batches, a smaller bubble and fewer activations in flight, at smaller ops); none
    without a pipeline."""
    if plan.parallel.pp == 1:
        return []
    default = plan.pipeline.microbatches_of(plan.parallel.pp)
    batch = first_batch(workload, _data_ranks(plan, world_size))
    rows = next((t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim()), 0)
    return [f * default for f in MICROBATCH_FACTORS if rows and rows % (f * default) == 0]


def _no_pipeline_but_its_schedule(plan: Plan, fields: dict[str, Any]) -> bool:
    """Whether ``fields`` set a pipeline schedule without a pipeline (the same candidate as the
    plan's schedule: not tried twice)."""
    pp = fields.get("parallel.pp", plan.parallel.pp)
    schedule = fields.get("pipeline.schedule", plan.pipeline.schedule)
    return pp == 1 and schedule != plan.pipeline.schedule


def _takes(plan: Plan, world_size: int) -> bool:
    """Whether ``world_size`` ranks can take the plan's mesh (tp with hybrid sharding may
    leave shard groups of one rank: not a candidate)."""
    try:
        plan.check_world_size(world_size)
    except PlanError:
        return False
    return True


def _data_ranks(plan: Plan, world_size: int) -> int:
    """How many batches one step of candidate ``plan`` trains on (its mesh's data-parallel
    ranks): the plan search's entry, where no session is open yet."""
    return plan_mesh(plan, world_size).data_parallel


def _work(plan: Plan, world_size: int, workload: Workload) -> int:
    """What one optimizer step of ``plan`` trains on over every rank: the data-parallel ranks'
    batches, each of the plan's micro-batches, in tokens where the workload counts them."""
    data_ranks = _data_ranks(plan, world_size)
    batches = data_ranks * plan.grad_accumulation
    if workload.tokens_per_batch is None:
        return batches
    return workload.tokens_per_batch(first_batch(workload, data_ranks)) * batches


def _predicted(
    fields: dict[str, Any],
    plan: Plan,
    world_size: int,
    rates: DeviceRates,
    workload: Workload,
    captured: CapturedSteps,
) -> Candidate:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (each candidate's notes: the table says enough)
            if plan.parallel.pp > 1:
                predicted_pipeline = estimate_pipeline(plan, world_size, workload, rates, captured)
                return _predicted_pipeline(fields, predicted_pipeline)
            inspection = inspect_plan(plan, world_size, workload, captured=captured)
            predicted = estimate(inspection, rates)
    except ZeroccError as exc:
        return Candidate(fields, error=str(exc).splitlines()[0])
    timing = predicted.timing
    assert timing is not None  # (`estimate` simulates the step)
    parts = {
        "communication": timing.exposed_s,
        "offload copies": timing.copy_waited_s,
    }
    parts["compute"] = timing.step_s - sum(parts.values())
    bound_by = max(parts, key=parts.__getitem__)
    return Candidate(
        fields, predicted.peak["total"], timing.step_s, bound_by, _by_group(predicted.comm)
    )


def _predicted_pipeline(fields: dict[str, Any], predicted: PipelineEstimate) -> Candidate:
    """A pipeline candidate: its highest rank's peak, its step (the schedule, then the slowest
    update), bound by its bubble where the ranks wait for a neighbour more than they work."""
    timeline = predicted.timeline
    bound_by = "pipeline bubble" if timeline.bubble > 0.5 else "compute"
    moved: dict[str, int] = {}
    for rank in predicted.ranks:
        for group, nbytes in _by_group(rank.collective_bytes).items():
            moved[group] = moved.get(group, 0) + nbytes
    microbatches = predicted.inspection.schedule.microbatches
    moved["pp"] = microbatches * sum(
        sum(sent.values()) for rank in predicted.ranks for sent in rank.sent.values()
    )
    peak = max(rank.memory.peak for rank in predicted.ranks)
    return Candidate(fields, peak, predicted.step_s, bound_by, moved)


def _by_group(comm: dict[str, int]) -> dict[str, int]:
    """Bytes per step by mesh group, from the estimate's by collective kind (``all_gather``
    on ``dp``, ``all_gather (tp)`` on ``tp``)."""
    moved: dict[str, int] = {}
    for kind, nbytes in comm.items():
        group = kind.partition(" (")[2].rstrip(")") or "dp"
        moved[group] = moved.get(group, 0) + nbytes
    return moved


def best_plan_yaml(search: Search) -> str:
    """The best candidate as a plan file: the fields the plan set, the chosen ones beside
    them, and a comment saying why it won."""
    best = search.best
    if best is None:
        raise ZeroccError("zerocc plan auto: no candidate fits; nothing to write")
    data = search.plan.model_dump(mode="json", exclude_unset=True)
    for path, value in best.fields.items():
        set_field(data, path, value)
    header = [
        f"# Chosen by `zerocc plan auto` for {search.world_size} ranks, "
        f"{human_bytes(search.memory)} per rank, {search.rates.device} rates:",
        f"# {best.describe()}",
        f"# {why(best, search.candidates, search.memory)}",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False)
