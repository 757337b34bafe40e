"""Pipeline schedules as data (zerocc/compiler/parallel/pipeline_schedule.py): every schedule
runs each stage's forward and backward of each micro-batch once, on the stage's rank, without
deadlock; the simulated bubble is the textbook one where there is a formula; bad arguments are
plan errors naming the field."""

from __future__ import annotations

import pytest

from zerocc.compiler.parallel.pipeline_schedule import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    pipeline_schedule,
)
from zerocc.errors import PlanError

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8), (4, 4), (3, 6)])
def test_every_stage_runs_every_microbatch_once_without_deadlock(name, pp, microbatches):
    schedule = pipeline_schedule(name, pp, microbatches, STAGES_PER_RANK[name])
    schedule.check()  # (pipeline_schedule checked it too: here it must not raise either)
    backward = {"I", "W"} if name == "zero-bubble" else {"B"}
    for stage in range(schedule.stages):
        rank = schedule.rank_of(stage)
        mine = [a for a in schedule.actions[rank] if a.stage == stage]
        assert sorted((a.microbatch, a.kind) for a in mine) == sorted(
            (m, kind) for m in range(microbatches) for kind in {"F", *backward}
        )


def test_what_crosses_to_another_rank_arrives_after_its_transfer():
    """One micro-batch over 2 ranks (F 1, B 2): stage 1's forward starts when stage 0's
    activation has arrived, stage 0's backward when stage 1's gradient has: each transfer
    (0.5 here) is on the critical path once. Within a rank (a stage's backward after its own
    forward) nothing travels."""
    schedule = pipeline_schedule("1f1b", 2, 1)
    asked = []

    def transfer(dependency, action):
        asked.append((dependency, str(action)))
        return 0.5

    timeline = schedule.simulate(transfer=transfer)
    assert schedule.simulate().makespan == 6.0
    assert timeline.makespan == 7.0
    assert sorted(asked) == [(("B", 1, 0), "0B0"), (("F", 0, 0), "1F0")]
    starts = {str(a): start for rank in timeline.spans for a, start, _ in rank}
    assert starts == {"0F0": 0.0, "1F0": 1.5, "1B0": 2.5, "0B0": 5.0}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 1), (2, 4), (4, 8), (4, 3), (8, 32)])
def test_the_bubble_of_gpipe_and_1f1b_is_the_textbook_one(name, pp, microbatches):
    """(pp - 1) / (M + pp - 1) of each rank's time, with a backward twice a forward."""
    bubble = pipeline_schedule(name, pp, microbatches).simulate().bubble
    assert bubble == pytest.approx((pp - 1) / (microbatches + pp - 1), rel=1e-12)


def test_1f1b_holds_fewer_microbatches_in_flight_than_gpipe():
    """A rank holds a micro-batch's activations from its forward to its backward: GPipe all M
    of them at once, 1F1B at most as many as stages from it to the last."""

    def most_in_flight(actions: tuple[Action, ...]) -> int:
        held = most = 0
        for a in actions:
            held += 1 if a.kind == "F" else -1
            most = max(most, held)
        return most

    pp, microbatches = 4, 8
    gpipe = pipeline_schedule("gpipe", pp, microbatches)
    one_f_one_b = pipeline_schedule("1f1b", pp, microbatches)
    assert [most_in_flight(a) for a in gpipe.actions] == [microbatches] * pp
    assert [most_in_flight(a) for a in one_f_one_b.actions] == [4, 3, 2, 1]


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    """At equal work per rank (a stage of V per rank does 1/V of a rank's layers), interleaved
    1F1B idles less than 1F1B, and the zero-bubble schedule less again."""
    pp, microbatches = 4, 8
    one_f_one_b = pipeline_schedule("1f1b", pp, microbatches).simulate().bubble
    halves = {kind: cost / 2 for kind, cost in {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}.items()}
    interleaved = pipeline_schedule("interleaved-1f1b", pp, microbatches, 2).simulate(halves)
    zero_bubble = pipeline_schedule("zero-bubble", pp, microbatches, 2).simulate(halves)
    assert zero_bubble.bubble < interleaved.bubble < one_f_one_b


def test_a_deadlocked_order_is_named():
    """Rank 1 waits for a forward that rank 0 runs after a backward waiting on rank 1."""
    bad = PipelineSchedule(
        "hand-made",
        2,
        1,
        1,
        ((Action("B", 0, 0), Action("F", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0))),
    )
    with pytest.raises(ValueError, match=r"wait for each other at \['0B0', '1F0'\]"):
        bad.check()


def test_a_missing_action_is_named():
    bad = PipelineSchedule("hand-made", 2, 1, 1, ((Action("F", 0, 0),), (Action("F", 1, 0),)))
    with pytest.raises(ValueError, match="0B0 never runs"):
        bad.check()


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("pipedream", 2, 4, 1), "pipeline.schedule"),
        (("1f1b", 1, 4, 1), "parallel.pp"),
        (("1f1b", 2, 0, 1), "pipeline.microbatches"),
        (("1f1b", 2, 4, 2), "pipeline.stages_per_rank: 1f1b runs 1 stage"),
        (("interleaved-1f1b", 2, 4, 1), "pipeline.stages_per_rank: interleaved-1f1b runs 2 or"),
        (("zero-bubble", 2, 4, 3), "pipeline.stages_per_rank: zero-bubble runs 2 stage"),
    ],
)
def test_bad_arguments_are_plan_errors_naming_the_field(args, field):
    with pytest.raises(PlanError, match=field):
        pipeline_schedule(*args)


def test_the_printed_schedule_shows_each_rank_and_the_bubble():
    text = pipeline_schedule("1f1b", 2, 2).format()
    assert text.splitlines()[:2] == ["rank 0: 0F0 0F1 0B0 0B1", "rank 1: 1F0 1B0 1F1 1B1"]
    assert "bubble 33.3%" in text
