"""Before training: does the plan fit in the memory of the machines its ranks run on?

Two checks, each before the memory it is about is allocated, both skipped with
``backend.check_memory: false``:

1. :func:`check_model_states`, when the TrainStep is built, before any state is allocated: the
   plan's persistent state (exact: the state layout it is then allocated from), the model's
   buffers and the scratch of building the state one unit at a time.
2. :func:`check_step_memory`, when a program is compiled, before it first runs: the transient
   memory of the step (activations, gathered units, offload's host buffers), the peak
   :func:`zerocc.cost.memory.predict_memory` predicts, beside the state already allocated.

Memory is counted per pool (:mod:`zerocc.runtime.machine_memory`): the GPU's memory and host
memory, or host memory alone on a CPU-only machine. A pool is shared by the ranks that draw on it:
every rank of a machine for host memory, the ranks of one GPU for its memory. Each rank reads what
its machine has before the ranks exchange their figures in one collective, so no rank reads
after another has allocated, and every rank decides on the same figures: all raise, or none.

A plan over the limit raises :class:`~zerocc.errors.InsufficientMemoryError`, which says by how
much and which plan changes would fit (another stage, offload, recomputation, more ranks), each
with its figure predicted by the same functions: the state layout of any plan and world size
(:func:`zerocc.compiler.driver.pass_manager.plan_layout`),
and, for the step's transient memory, the other plan's program compiled (on fake tensors).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from functools import partial

import torch
from torch import fx

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.driver.pass_manager import plan_layout
from zerocc.compiler.driver.plan_changes import MAX_WORLD_SIZE, plan_changes, smallest_world_size
from zerocc.compiler.driver.session import CompileSession
from zerocc.compiler.plan import Plan
from zerocc.compiler.state import DEVICE, HOST, NVME, StateLayout
from zerocc.compiler.units import Unit
from zerocc.cost.memory import STATE_CATEGORY, predict_memory
from zerocc.cost.pipeline_memory import PipelineMemory
from zerocc.engine.comm import Comm
from zerocc.errors import InsufficientMemoryError
from zerocc.ir.quantities import human_bytes
from zerocc.local_ranks import ranks_on_this_machine
from zerocc.runtime import machine_memory, nvml
from zerocc.runtime.machine_memory import DEVICE_POOL, HOST_POOL, pool_names

Need = dict[str, dict[str, int]]  # pool -> part (params, activations, ...) -> bytes per rank
Recompile = Callable[[Plan], fx.GraphModule]  # another plan's program, for the same batch
TURN_OFF = "To go on anyway, set backend.check_memory: false in the plan."


def pool_of(location: str, device: torch.device) -> str | None:
    """The pool a state location draws on (None for NVMe: files, whose room zerocc.runtime.nvme
    checks)."""
    if location == DEVICE:
        return DEVICE_POOL if device.type == "cuda" else HOST_POOL
    return HOST_POOL if location == HOST else None


def state_need(layout: StateLayout, device: torch.device) -> Need:
    """Bytes of a layout's persistent state per rank, by pool and category (params, grads,
    optimizer), exact: the tensors :func:`zerocc.compiler.state.allocate_state` allocates (a view of
    another is not counted; NVMe states are files)."""
    need: Need = {
        pool: dict.fromkeys(("params", "grads", "optimizer"), 0) for pool in pool_names(device)
    }
    for spec in layout:
        pool = pool_of(spec.location, device)
        if pool is not None and not spec.is_view:
            _add(need, pool, STATE_CATEGORY[spec.role], spec.nbytes)
    return need


def model_state_need(
    model_info: ModelInfo, units: list[Unit], layout: StateLayout, device: torch.device
) -> Need:
    """What building the TrainStep's state takes per rank and pool: the plan's persistent
    state, the model's buffers, and the scratch of building them (one unit's full weights at a
    time: its initial values and its flat buffer, at most twice the unit; one NVMe state's host
    buffer)."""
    need = state_need(layout, device)
    device_pool = pool_of(DEVICE, device)
    _add(need, device_pool, "buffers", sum(b.numel * b.dtype.itemsize for b in model_info.buffers))
    scratch = max((u.padded_numel * u.dtype.itemsize for u in units), default=0)
    _add(need, device_pool, "building", 2 * scratch)
    nvme = [s.nbytes for s in layout.at(NVME)]
    _add(need, HOST_POOL, "building", max(nvme, default=0))
    return need


def step_need(gm: fx.GraphModule, device: torch.device, *, gloo: bool) -> Need:
    """The transient memory of one run of ``gm`` per rank and pool, at its predicted peak:
    activations, gathered units and (``gloo``: its collectives run there) gloo's collective
    buffers where the device's peak is, offload's host buffers at their own peak (on a
    CPU-only machine both in host memory: an upper bound)."""
    timeline = predict_memory(gm, {}, gloo=gloo)  # without model states: the transient alone
    index, _ = timeline.peak()
    need: Need = {}
    device_pool = pool_of(DEVICE, device)
    parts = (("activations", "activations"), ("gathered units", "gathered"),
             ("collective buffers", "comm"))  # fmt: skip
    for part, series in parts:
        _add(need, device_pool, part, timeline.series[series][index] if timeline.labels else 0)
    _add(need, HOST_POOL, "host buffers", timeline.host_peak)
    return need


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One rank's side of a check: where it runs, what it needs and what it has, per pool."""

    rank: int
    machine: str
    device: str
    need: dict[str, int]
    available: dict[str, int]


def check_model_states(
    model_info: ModelInfo,
    units: list[Unit],
    layout: StateLayout,
    plan: Plan,
    comm: Comm,
    device: torch.device,
) -> None:
    """Raise :class:`InsufficientMemoryError` on every rank when building ``layout``, the
    plan's state, would not fit in some machine's memory (call before any state is
    allocated)."""
    _check_states(
        model_info, units, layout, plan, comm.world_size, device,
        lambda need: _exchange(comm, device, need),
    )  # fmt: skip


def check_states_before_launch(
    session: CompileSession,
    plan: Plan,
    local_ranks: int,
    first_rank: int = 0,
    device_type: str = "cpu",
    gpu_free: Callable[[list[int]], dict[int, int] | None] = nvml.free_bytes,
) -> None:
    """`zerocc train`'s pre-flight: raise :class:`InsufficientMemoryError` before any rank is
    launched when the model states of the ``local_ranks`` ranks it is about to start here
    (global ranks from ``first_rank``; on ``device_type`` "cuda" local rank ``r`` on GPU
    ``r``) would not fit this machine's memory or their GPUs'; the figures and the message of
    :func:`check_model_states`, which each rank would raise after starting. Every rank would
    read what this process reads now: none has allocated anything yet. A GPU's free memory
    comes from NVML (``gpu_free``, which creates no CUDA context); where NVML cannot say, the
    ranks check it once started."""
    cuda = device_type == "cuda"
    free = gpu_free(list(range(local_ranks))) if cuda else {}
    if free is None:
        return
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def views(need: dict[str, int]) -> list[RankMemory]:
        host = machine_memory.available_memory(torch.device("cpu"))[HOST_POOL]
        machine = socket.gethostname()
        return [
            RankMemory(
                first_rank + r,
                machine,
                f"cuda:{r}" if cuda else "cpu",
                need,
                {HOST_POOL: host, **({DEVICE_POOL: free[r]} if cuda else {})},
            )
            for r in range(local_ranks)
        ]

    _check_states(
        session.model_info, session.units, session.layout, plan, session.world_size, device, views
    )


def _check_states(
    model_info: ModelInfo,
    units: list[Unit],
    layout: StateLayout,
    plan: Plan,
    world_size: int,
    device: torch.device,
    views: Callable[[dict[str, int]], list[RankMemory]],
) -> None:
    """:func:`check_model_states` on the figures ``views`` gives every rank (from this
    rank's need, by pool)."""
    need = model_state_need(model_info, units, layout, device)
    short = _shortfalls(views(_totals(need)))
    if not short:
        return
    budget, sharers = short[0].view.available, short[0].sharing

    def need_of(candidate: Plan, world_size: int) -> dict[str, int]:
        at = _at(units, world_size)
        return _totals(model_state_need(model_info, at, plan_layout(candidate, at), device))

    rows = []
    for change in plan_changes(plan, device, recompute=False):
        changed = need_of(change.plan, world_size)
        if _helps(changed, _totals(need)):
            rows.append(_row(change.text, changed, budget, sharers))
    rows.append(_ranks_row(plan, world_size, partial(need_of, plan), budget, sharers))
    raise InsufficientMemoryError(
        "\n".join(
            [
                "the model states of this plan do not fit in memory " + _where(short),
                *_shortfall_lines(short, need, "available"),
                "plan changes, each with its model states per rank "
                f"(fits: {_budget_text(budget, sharers)}):",
                *rows,
                "(building: one unit's weights at a time, materialized to build its state.) "
                "Activations and gathered units come on top; they are checked before the first "
                "step runs.",
                TURN_OFF,
            ]
        )
    )


def check_step_memory(
    gm: fx.GraphModule,
    units: list[Unit],
    layout: StateLayout,
    plan: Plan,
    comm: Comm,
    device: torch.device,
    recompile: Recompile,
) -> None:
    """Raise :class:`InsufficientMemoryError` on every rank when the transient memory of the
    program ``gm`` would not fit beside the state already allocated (``layout``; call before
    it first runs). ``recompile(plan)`` compiles another plan's program for the same batch:
    the figures of the changes the error proposes come from it (only on the error path)."""
    gloo = comm.on_gloo
    need = step_need(gm, device, gloo=gloo)
    short = _shortfalls(_exchange(comm, device, _totals(need)))
    if not short:
        return
    available, sharers = short[0].view.available, short[0].sharing
    held = _totals(state_need(layout, device))
    # A change replaces this plan's states: what they hold is room for the changed plan's.
    budget = {p: a + held.get(p, 0) * sharers[p] for p, a in available.items()}
    current = _sum(held, _totals(need))
    rows = []
    for change in plan_changes(plan, device, recompute=True):
        states = _totals(state_need(plan_layout(change.plan, units), device))
        if not _fits(states, budget, sharers):  # too large before its step: not compiled
            if _helps(states, current):
                rows.append(_row(change.text, states, budget, sharers, "model states alone"))
            continue
        changed = _sum(states, _totals(step_need(recompile(change.plan), device, gloo=gloo)))
        if _helps(changed, current):
            rows.append(_row(change.text, changed, budget, sharers))

    def need_at(world_size: int) -> dict[str, int]:
        at = _at(units, world_size)
        return _sum(_totals(state_need(plan_layout(plan, at), device)), _totals(need))

    rows.append(_ranks_row(plan, comm.world_size, need_at, budget, sharers, "step as now"))
    raise InsufficientMemoryError(
        "\n".join(
            [
                "the training step of this plan does not fit in memory beside its model states "
                + _where(short),
                *_shortfall_lines(short, need, "available now"),
                f"  (its model states, already allocated: {_figure(held)} per rank)",
                "plan changes, each with what it needs per rank in all, model states and step "
                f"(fits: {_budget_text(budget, sharers)}: what is available now plus what this "
                "plan's model states hold):",
                *rows,
                TURN_OFF,
            ]
        )
    )


def check_pipeline_memory(
    memory: PipelineMemory,
    others: dict[str, PipelineMemory],
    stages: list[int],
    comm: Comm | None,
    device: torch.device,
    less_gathered: str | None = None,
    offloaded: int = 0,
    views: Callable[[dict[str, int]], list[RankMemory]] | None = None,
) -> None:
    """Raise :class:`InsufficientMemoryError` on every rank when a pipeline rank's predicted
    peak would not fit its machine (call before any state is allocated; ``views``: every
    rank's figures from this rank's need, given instead of exchanged over ``comm``, as
    `zerocc train` reads them before it launches any rank): its model states,
    what its stages keep for backward over the schedule's micro-batches, and the running
    program's transients (:mod:`zerocc.cost.pipeline_memory`). ``others``: the same rank's
    peak under each other schedule that runs its programs; ``stages``: the rank's;
    ``less_gathered``: the plan change that holds fewer parameters whole, if any;
    ``offloaded``: bytes of the rank's states offload keeps in host memory."""
    pool = pool_of(DEVICE, device)
    need: Need = {pool: {}}
    transient = memory.peak - memory.model_states - memory.kept
    parts = {"model states": memory.model_states, "kept for backward": memory.kept,
             "the running program": transient}  # fmt: skip
    for part, nbytes in parts.items():
        _add(need, pool, part, nbytes)
    if offloaded:
        _add(need, HOST_POOL, "model states offloaded to the host", offloaded)
    figures = views or partial(_exchange, comm, device)
    short = _shortfalls(figures(_totals(need)))
    if not short:
        return
    budget = short[0].view.available.get(pool, 0)
    fitting = [
        f"  pipeline.schedule: {name}: this rank's peak {human_bytes(m.peak)}"
        + (" (fits)" if m.peak * short[0].sharing[pool] <= budget else "")
        for name, m in sorted(others.items(), key=lambda item: item[1].peak)
        if m.peak < memory.peak
    ]
    raise InsufficientMemoryError(
        "\n".join(
            [
                f"this pipeline rank's stages {stages} do not fit in memory " + _where(short),
                *_shortfall_lines(short, need, "available"),
                f"  (peak at {memory.at}, with {memory.in_flight} forward(s) awaiting their "
                "backward)",
                "what lowers it: another schedule, with this rank's peak under it"
                if fitting
                else "what lowers it:",
                *fitting,
                "  more pipeline ranks (parallel.pp), so that each holds fewer layers; "
                "recompute (fewer tensors kept for backward); smaller micro-batches "
                "(pipeline.microbatches up, the batch alike)",
                *([f"  {less_gathered}"] if less_gathered else []),
                TURN_OFF,
            ]
        )
    )


# -- figures and messages ----------------------------------------------------------------------


def _add(need: Need, pool: str, part: str, nbytes: int) -> None:
    parts = need.setdefault(pool, {})
    parts[part] = parts.get(part, 0) + nbytes


def _totals(need: Need) -> dict[str, int]:
    return {pool: sum(parts.values()) for pool, parts in need.items()}


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {p: a.get(p, 0) + b.get(p, 0) for p in {*a, *b}}


def _at(units: list[Unit], world_size: int) -> list[Unit]:
    """The same units laid out for another world size (only their padding changes)."""
    return [dataclasses.replace(u, world_size=world_size) for u in units]


def _exchange(comm: Comm, device: torch.device, need: dict[str, int]) -> list[RankMemory]:
    """Every rank's figures: each rank reads its own, then all are exchanged."""
    mine = RankMemory(
        comm.rank,
        socket.gethostname(),
        str(device),
        need,
        machine_memory.available_memory(device),
    )
    return comm.all_gather_object(mine)  # on the control group: CPU objects, also on NCCL


def _sharers(views: list[RankMemory], view: RankMemory, pool: str) -> int:
    """Ranks drawing on the pool ``view`` draws on: its machine's ranks for host memory, its
    GPU's for device memory. Without a process group to count them: torchrun's
    LOCAL_WORLD_SIZE for host memory."""
    if len(views) == 1:
        return ranks_on_this_machine(unknown=1) if pool == HOST_POOL else 1
    return sum(
        v.machine == view.machine and (pool == HOST_POOL or v.device == view.device) for v in views
    )


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """A pool of one rank's machine that the ranks drawing on it overrun."""

    view: RankMemory
    pool: str
    sharing: dict[str, int]  # pool -> ranks drawing on it, for every pool of the rank

    @property
    def sharers(self) -> int:
        return self.sharing[self.pool]

    @property
    def needed(self) -> int:
        return self.view.need[self.pool] * self.sharers


def _shortfalls(views: list[RankMemory]) -> list[Shortfall]:
    """The short pools of the first rank (in rank order) whose machine is short."""
    for view in views:
        sharing = {p: _sharers(views, view, p) for p in view.available}
        short = [Shortfall(view, p, sharing) for p in view.need]
        short = [s for s in short if s.needed > view.available.get(s.pool, 0)]
        if short:
            return short
    return []


def _where(short: list[Shortfall]) -> str:
    return f"(rank {short[0].view.rank}, machine {short[0].view.machine!r}):"


def _helps(changed: dict[str, int], current: dict[str, int]) -> bool:
    """Whether a change needs less in some pool (a change that only adds is not proposed)."""
    return any(changed.get(p, 0) < b for p, b in current.items())


def _fits(need: dict[str, int], budget: dict[str, int], sharers: dict[str, int]) -> bool:
    return all(b * sharers[p] <= budget.get(p, 0) for p, b in need.items())


def _figure(need: dict[str, int]) -> str:
    """``device 3.1GiB, host 12.0GiB`` (pools with nothing left out)."""
    return ", ".join(f"{p} {human_bytes(b)}" for p, b in sorted(need.items()) if b) or "0B"


def _shortfall_lines(short: list[Shortfall], need: Need, available: str) -> list[str]:
    """Per short pool (of the short rank's device): the figure per rank by part, × the ranks
    sharing it, what is there."""
    lines: list[str] = []
    for s in short:
        names = pool_names(torch.device(s.view.device))
        parts = " + ".join(f"{part} {human_bytes(b)}" for part, b in need[s.pool].items() if b)
        times = f"× {s.sharers} ranks = {human_bytes(s.needed)}; " if s.sharers > 1 else ""
        have = s.view.available.get(s.pool, 0)
        lines += [
            f"  {names[s.pool]}: per rank {parts} = {human_bytes(s.view.need[s.pool])}",
            f"    {times}{available}: {human_bytes(have)}; short by {human_bytes(s.needed - have)}",
        ]
    return lines


def _budget_text(budget: dict[str, int], sharers: dict[str, int]) -> str:
    """``host × 2 ranks within 20.0GiB``, per pool."""
    return ", ".join(
        f"{p}{f' × {sharers[p]} ranks' if sharers[p] > 1 else ''} within {human_bytes(b)}"
        for p, b in sorted(budget.items())
    )


def _row(
    text: str,
    need: dict[str, int],
    budget: dict[str, int],
    sharers: dict[str, int],
    what: str = "",
) -> str:
    """One proposed change: whether it fits, its figure per rank and pool (``what`` it counts,
    if not all), the change."""
    over = {p: b * sharers[p] - budget.get(p, 0) for p, b in need.items()}
    short = [f"{p} short by {human_bytes(o)}" for p, o in sorted(over.items()) if o > 0]
    figure = f"{what}: {_figure(need)}" if what else _figure(need)
    return f"  {'; '.join(short) or 'fits':<24} {figure:<30} {text}"


def _ranks_row(
    plan: Plan,
    world_size: int,
    need_at: Callable[[int], dict[str, int]],
    budget: dict[str, int],
    sharers: dict[str, int],
    what: str = "",
) -> str:
    """The smallest world size that fits (as many ranks per machine as now), or that none
    does."""

    def fits(n: int) -> bool:
        return _fits(need_at(n), budget, sharers)

    ranks = smallest_world_size(fits, world_size)
    if ranks is None:
        return f"  {'no world size fits':<24} {'':<30} more ranks (up to {MAX_WORLD_SIZE})"
    text = f"{ranks} ranks"
    per_machine = sharers.get(HOST_POOL, 1)
    if per_machine > 1:  # whole machines, as many ranks on each as now
        machines = -(-ranks // per_machine)
        ranks = machines * per_machine if fits(machines * per_machine) else ranks
        text = f"{ranks} ranks ({machines} machines of {per_machine})"
    if plan.zero.world_size:
        text += f", zero.world_size: {ranks}"
    return _row(text, need_at(ranks), budget, sharers, what)
