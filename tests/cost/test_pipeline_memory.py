"""A pipeline rank's memory walked over its schedule (zerocc.cost.pipeline_memory) against the
runtime's: the bytes kept for backward, each rank's most at any time, as predicted and as the
rank held them walking the same schedule in one process. Exact: both count each kept storage
once per micro-batch, from its forward until its backward (or weight-gradient half) ran."""

from __future__ import annotations

import pytest
from models import _gpt_batch
from staging import SCHEDULE_CASES, blocks, captured, gpt, walked

from zerocc.compiler.parallel.pipeline_schedule import pipeline_schedule
from zerocc.compiler.parallel.stage_cut import cut_stages
from zerocc.compiler.parallel.stage_programs import split_backward, stage_model, step_form
from zerocc.cost.pipeline_memory import kept_bytes, predict_pipeline_memory

MICROBATCHES = 4
STATES = 1000  # model states of a rank: any number, held throughout


def _programs(staged, info, schedule, rank):
    """Rank ``rank``'s programs in step form (their keep ops), by (stage, kind)."""
    programs = {}
    for s in schedule.stages_of(rank):
        stage = staged.stages[s]
        held = stage_model(info, stage)
        kinds = {"F": stage.forward}
        if schedule.splits_backward:
            kinds["I"], kinds["W"] = split_backward(stage.backward)
        else:
            kinds["B"] = stage.backward
        programs.update({(s, k): step_form(p, held) for k, p in kinds.items()})
    return programs


@pytest.mark.parametrize(("name", "pp", "stages_per_rank"), SCHEDULE_CASES)
def test_the_predicted_kept_bytes_are_what_each_rank_holds(name, pp, stages_per_rank):
    w = walked(name, pp, stages_per_rank, MICROBATCHES)
    for r, ran in enumerate(w.ranks):
        programs = _programs(w.staged, w.info, w.schedule, r)
        predicted = predict_pipeline_memory(w.schedule.actions[r], programs, STATES)
        assert ran.rank.most_kept > 0
        assert predicted.most_kept == ran.rank.most_kept, r
        assert ran.rank.kept_bytes == 0  # all released by the step's end
        assert predicted.peak >= STATES + predicted.kept


def test_the_schedule_sets_how_many_microbatches_are_kept():
    """GPipe runs every forward before any backward: the first rank keeps all M micro-batches'
    tensors; 1F1B starts backward after pp forwards: it keeps pp."""
    model = gpt(4)
    gm, info = captured(model, _gpt_batch(0, 0))
    staged = cut_stages(gm, info, blocks(4, 2))
    kept = {}
    for name in ("gpipe", "1f1b"):
        schedule = pipeline_schedule(name, 2, 8, 1)
        programs = _programs(staged, info, schedule, 0)
        kept[name] = predict_pipeline_memory(schedule.actions[0], programs, 0)
    per_microbatch = kept_bytes(programs[0, "F"])
    assert per_microbatch > 0
    assert kept["gpipe"].most_kept == 8 * per_microbatch
    assert kept["1f1b"].most_kept == 2 * per_microbatch
    assert kept["gpipe"].peak > kept["1f1b"].peak
