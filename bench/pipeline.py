"""Pipeline bubbles measured on CPU ranks, per schedule, against the formula, the simulation
and the estimate.

The example GPT (8 blocks) is trained by ``zerocc.compile`` as a pipeline of ``--pp`` gloo ranks
(ZeRO-3 inside each stage, one data-parallel rank) under each schedule, ``--microbatches`` per
step. Each rank records its last step's actions (``step.pipeline.timeline.actions``): the time it
computed is every action's time less what it spent waiting for a neighbour's tensor. The
measured bubble is the share of the step (first action to last, the slowest rank's) a rank did
not compute, averaged over the ranks; the formula is GPipe's and 1F1B's ``(pp-1)/(M+pp-1)``, and
the simulation walks the schedule with each kind of action's mean measured time
(:meth:`~zerocc.compiler.parallel.pipeline_schedule.PipelineSchedule.simulate`); the estimate
is ``zerocc estimate``'s (:func:`~zerocc.inspect.pipeline_estimate.estimate_pipeline`: each
action's program timed by the cost model with this machine's default CPU rates, nothing run).
The table gives them side by side, with CPU seconds per step beside wall seconds and the
estimated step; the JSON, with the commit measured, goes to bench/results/.

On a machine with fewer cores than ranks the ranks share cores: a rank that waits frees its
core for another, which shortens the others' actions and the measured bubble with them, so
compare schedules measured on one machine, not with the formula alone.

    python bench/pipeline.py [--pp 2] [--microbatches 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples" / "gpt"), str(ROOT / "tests")]

from multirank import run_ranks  # noqa: E402
from provenance import provenance  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}
MODEL = {"n_layer": 8, "n_embd": 128, "n_head": 4, "block_size": 64, "vocab_size": 256}


def _plan(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> dict:
    return {
        "zero": {"stage": 3},
        "units": {"classes": ["Block"]},
        "parallel": {"pp": pp},
        "pipeline": {"schedule": schedule, "microbatches": microbatches,
                     "stages_per_rank": stages_per_rank},
        "backend": {"device": "cpu"},
    }  # fmt: skip


def _rank(rank: int, world: int, schedule: str, stages_per_rank: int, microbatches: int,
          steps: int) -> dict:  # fmt: skip
    """One pipeline rank: its last step's actions, and its CPU and wall seconds per step."""
    from workload import workload

    import zerocc

    work = workload(batch_size=2 * microbatches, **MODEL)
    plan = _plan(schedule, world, stages_per_rank, microbatches)
    step = zerocc.compile(work.model, plan, loss_fn=work.loss_fn)
    batches = iter(work.batches(step.data_rank, step.data_parallel))
    step(*next(batches))  # compiles
    cpu, wall = [], []
    for _ in range(steps):
        usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step(*next(batches))
        after = resource.getrusage(resource.RUSAGE_SELF)
        wall.append(time.perf_counter() - start)
        cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
    actions = [(str(a), a.kind, b, e, waited) for a, b, e, waited in step.pipeline.timeline.actions]
    return {"actions": actions, "cpu_s": cpu, "wall_s": wall}


def measure(schedule: str, pp: int, microbatches: int, steps: int) -> dict:
    """The bubble of ``schedule`` on ``pp`` ranks: measured, by the formula, simulated."""
    from zerocc.compiler.parallel.pipeline_schedule import pipeline_schedule

    stages_per_rank = SCHEDULES[schedule]
    ranks = run_ranks(pp, _rank, schedule, stages_per_rank, microbatches, steps)
    makespan = max(end for r in ranks for _, _, _, end, _ in r["actions"])
    busy = [sum(end - begin - waited for _, _, begin, end, waited in r["actions"]) for r in ranks]
    measured = 1 - sum(busy) / (pp * makespan)
    kinds: dict[str, list[float]] = {}
    for r in ranks:
        for _, kind, begin, end, waited in r["actions"]:
            kinds.setdefault(kind, []).append(end - begin - waited)
    costs = {k: sum(v) / len(v) for k, v in kinds.items()}
    costs = {k: costs.get(k, 0.0) for k in "FBIW"}
    simulated = pipeline_schedule(schedule, pp, microbatches, stages_per_rank).simulate(costs)
    formula = (pp - 1) / (microbatches + pp - 1) if stages_per_rank == 1 else None
    estimated = _estimate(schedule, pp, stages_per_rank, microbatches)
    return {
        "measured_bubble": measured,
        "formula_bubble": formula,
        "simulated_bubble": simulated.bubble,
        "estimated_bubble": estimated.timeline.bubble,
        "estimated_step_s": estimated.step_s,
        "step_wall_s": min(max(r["wall_s"][i] for r in ranks) for i in range(steps)),
        "step_cpu_s": min(sum(r["cpu_s"][i] for r in ranks) for i in range(steps)),
        "action_s": costs,
    }


def _estimate(schedule: str, pp: int, stages_per_rank: int, microbatches: int):
    """``zerocc estimate`` of the same plan and model, for ``pp`` ranks."""
    from workload import workload

    from zerocc.compiler.plan import load_plan
    from zerocc.inspect.pipeline_estimate import estimate_pipeline

    work = workload(batch_size=2 * microbatches, **MODEL)
    plan = load_plan(_plan(schedule, pp, stages_per_rank, microbatches))
    return estimate_pipeline(plan, pp, work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: measure(name, args.pp, args.microbatches, args.steps) for name in SCHEDULES}
    print(f"pipeline of {args.pp} CPU ranks, {args.microbatches} micro-batches, GPT {MODEL}")
    print(f"{'schedule':18} {'measured':>9} {'formula':>8} {'simulated':>9} {'estimated':>9} "
          f"{'step wall s':>11} {'step cpu s':>10} {'estimated s':>11}")  # fmt: skip
    for name, r in results.items():
        formula = f"{r['formula_bubble']:.1%}" if r["formula_bubble"] is not None else "-"
        print(
            f"{name:18} {r['measured_bubble']:>9.1%} {formula:>8} "
            f"{r['simulated_bubble']:>9.1%} {r['estimated_bubble']:>9.1%} "
            f"{r['step_wall_s']:>11.3f} {r['step_cpu_s']:>10.3f} {r['estimated_step_s']:>11.3f}"
        )
    out = ROOT / "bench" / "results" / f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report = {**provenance(), "pp": args.pp, "microbatches": args.microbatches,
              "model": MODEL, "results": results}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
