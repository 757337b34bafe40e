"""The pairwise feature sweep (issue 77): the plan's features (tests/sweep/feature_cells.py:
ZeRO stages 0-3, hybrid sharding, tensor, sequence, pipeline (each schedule) and expert
parallelism, recomputation, optimizer offload, bf16 and fp16, float8 matmuls, quantized
collectives, the secondary partition, keyed draws, accumulation, Inductor, background saves,
in-memory checkpoints and evaluation) on a GPT, a Hugging Face Llama and a Hugging Face
Mixtral with its router loss, crossed pairwise: every pair of two features' levels is refused
by plan check with a PlanError naming a field of each, or trained in a row of the covering
array for 2 steps on CPU ranks with parity to one process (tests/sweep/feature_rows.py).

Plan check of every pair (~10 s) and the cheapest rows run in the default run; the other
rows with ``--slow``. docs/feature-pairs.md is the table of the sweep, written by
``python tests/sweep/feature_table.py`` and held current here.
"""

from __future__ import annotations

import functools

import pytest
from feature_cells import LEVELS, case_of, level, pair_refusals, pairs, row_of
from feature_rows import assert_row_trained_alike, run_row
from feature_table import AVOID, KNOWN_FAILURES, TABLE, all_rows, cheap_rows, table

ROWS = all_rows()


def test_every_pair_of_levels_is_refused_or_in_a_trained_row():
    covered = set().union(*(row.covers() for row in ROWS))
    for key, why in pair_refusals().items():
        assert (why is None) == (key in covered), (key, why)
    assert len(pair_refusals()) == len(pairs()) > 300
    assert {lv.factor for lv in LEVELS} == {lv.factor for row in ROWS for lv in row.levels}


def test_every_accepted_pair_is_in_a_row_not_known_to_fail_unless_it_fails_itself():
    """The rows known to fail (xfail) leave no pair untested: each accepted pair lies in a
    passing row too, but the pairs of a known failing combination of two levels."""
    passing = [row for row in ROWS if str(row) not in KNOWN_FAILURES]
    covered = set().union(*(row.covers() for row in passing))
    orphans = {k for k, why in pair_refusals().items() if why is None and k not in covered}
    for pair in orphans:  # (the pair's row: an ep pair's model is the Mixtral)
        levels = row_of(map(level, pair)).levels
        names = {str(lv) for lv in levels} | {f"{lv.factor}=*" for lv in levels}
        assert any(c <= names for c in AVOID), f"{pair} is only in rows known to fail"


@pytest.mark.parametrize("pair", [k for k, why in pair_refusals().items() if why], ids="+".join)
def test_a_refused_pair_is_a_plan_error_naming_both_fields(pair):
    a, b = map(level, pair)
    why = pair_refusals()[pair]
    said = why + " " + why.replace(": ", ".")  # (a section's error: 'zero: replicate: 2 ...')
    for lv in (a, b):
        assert any(name in said for name in lv.names), f"{lv}: none of {lv.names} in: {why}"


@functools.cache
def _trained(index: int) -> list[dict]:
    return run_row(case_of(ROWS[index]))


def _marks(index: int) -> list:
    marks = [] if index in cheap_rows() else [pytest.mark.slow]
    if str(ROWS[index]) in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[str(ROWS[index])]))
    return marks


@pytest.mark.parametrize(
    "index", [pytest.param(i, marks=_marks(i), id=str(row)) for i, row in enumerate(ROWS)]
)
def test_a_row_trains_as_one_process_does(index):
    assert_row_trained_alike(_trained(index), case_of(ROWS[index]))


def test_the_table_in_the_docs_is_the_sweeps():
    assert TABLE.read_text() == table(), (
        "docs/feature-pairs.md is not the sweep's table: python tests/sweep/feature_table.py"
    )


def test_a_pair_alone_is_a_row_of_its_two_levels_and_the_base():
    a, b = LEVELS[0], LEVELS[-1]
    assert [str(lv) for lv in row_of((a, b)).levels] == ["stage=0", "model=gpt", "eval=on"]
