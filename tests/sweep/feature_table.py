"""docs/feature-pairs.md: the pairwise feature sweep's table (tests/sweep/test_feature_pairs.py),
written from the sweep itself: ``python tests/sweep/feature_table.py``. Also which rows run in
the default run (the cheap ones) and the rows known to fail, with why."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # (as a script: the tests' helper modules by name, as conftest.py)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples" / "gpt")]

from feature_cells import (  # noqa: E402
    STEPS,
    case_of,
    covering_rows,
    level,
    pair_refusals,
    repair_rows,
    row_of,
)

TABLE = ROOT / "docs" / "feature-pairs.md"

# Rows that fail, found by the sweep: row -> what fails (each an xfail(strict=True) case).
KNOWN_FAILURES: dict[str, str] = {
    "stage=0,model=mixtral,pp=interleaved-1f1b,recompute=all,precision=bf16,async_save=on,"
    "eval=on": "a pipeline of the Hugging Face Mixtral with recompute.units: all and "
    "precision.param: bf16 is refused after launch, by the stage cut: PlanError 'pipeline.split: "
    "lm.model.layers.3.input_layernorm (stage 3) reads the gradient _to_copy_176 of "
    "lm.model.layers.3.input_layernorm (stage 2)' (each pair alone trains; so does the GPT's "
    "pipeline with both, and 1f1b fails alike)",
    "stage=0,model=llama,pp=1f1b,recompute=all,precision=bf16,keyed=on,inductor=on": "the same "
    "with the Hugging Face Llama: a pipeline with recompute.units: all and precision.param: bf16 "
    "is refused after launch by the stage cut ('pipeline.split: lm.model.layers.2."
    "input_layernorm (stage 1) reads the gradient _to_copy_130 of ... (stage 0)')",
    "stage=0,model=gpt,pp=zero-bubble,recompute=all,precision=bf16,fp8=matmul,in_memory=on": "a "
    "zero-bubble pipeline of the GPT with recompute, bf16 and float8 matmuls fails in its first "
    "step with a raw KeyError: '_to_copy_155' (a stage program's binding, runtime/pipeline.py)",
    "stage=2,model=mixtral,tp=2,sp=on,fp8=matmul,async_save=on,eval=on": "precision.matmul: fp8 "
    "with parallel.tp on the Mixtral is refused after launch (compile: 'fp8 finds no linear layer "
    "to multiply in float8': tp splits every linear but the head, the experts are no nn.Linear); "
    "plan check's model check does not choose the float8 layers",
    "stage=0,model=gpt,pp=zero-bubble,fp8=matmul,in_memory=on": "a zero-bubble pipeline of the "
    "GPT with float8 matmuls trains its tied embedding (transformer.wte.weight) 5.65e-4 away "
    "from one process converted alike (bound 1e-5; its losses agree)",
    "stage=2,model=gpt,tp=2,sp=on,fp8=matmul,async_save=on,eval=on": "precision.matmul: fp8 with "
    "parallel.tp on the GPT is refused after launch, as on the Mixtral (tp splits every linear "
    "layer but the head: 'fp8 finds no linear layer to multiply in float8')",
    "stage=3,model=mixtral,tp=2,sp=on,ep=2": "parallel.sequence_parallel on the Mixtral with its "
    "router loss is refused after launch, at capture (CaptureError: the loss depends on a "
    "statistic of each tp rank's chunk of the sequence), not by plan check",
}

# Where rows are known to fail (the rows above and more): sets of levels no repair row holds
# (``pp=*``: any level of pp).
AVOID: tuple[frozenset[str], ...] = tuple(
    frozenset(text.split(","))
    for text in (
        "model=mixtral,pp=*,recompute=all,precision=bf16",
        "model=llama,pp=*,recompute=all,precision=bf16",
        "pp=zero-bubble,recompute=all,precision=bf16,fp8=matmul",
        "tp=*,fp8=matmul",
        "sp=*,fp8=matmul",
        "pp=zero-bubble,fp8=matmul",
        "model=mixtral,sp=*",
    )
)


def all_rows() -> tuple:
    """The covering array's rows, then the rows that cover again the pairs only failing rows
    cover (:func:`feature_cells.repair_rows`)."""
    rows = covering_rows()
    failing = tuple(row for row in rows if str(row) in KNOWN_FAILURES)
    rows += repair_rows(failing, AVOID)
    found = (row_of(map(level, text.split(","))) for text in KNOWN_FAILURES)
    return rows + tuple(row for row in found if row not in rows)  # (found in repair rows)


# The rows of the default run: a cheap handful across stages, models and features (~60 s on 2
# cores together); the others run with --slow.
CHEAP_ROWS: tuple[str, ...] = (
    "stage=0,model=gpt,fp8=matmul,accum=2,async_save=on,in_memory=on,eval=on",
    "stage=1,model=llama,tp=2,sp=on,recompute=all,offload=optimizer,precision=bf16",
    "stage=1,model=mixtral,pp=1f1b,ep=2,offload=optimizer,fp8=matmul,in_memory=on",
    "stage=2,model=gpt,pp=1f1b,precision=fp16,quantized=grads_int8,async_save=on,eval=on",
    "stage=3,model=gpt,quantized=weights_int8,secondary=2,accum=2,async_save=on,eval=on",
    "stage=3,model=mixtral,ep=2,recompute=all,precision=fp16,quantized=weights_int8,accum=2",
    "stage=3,model=gpt,pp=1f1b,quantized=weights_int8",
)


def cheap_rows() -> set[int]:
    """Indices of the rows the default run trains."""
    return {i for i, row in enumerate(all_rows()) if str(row) in CHEAP_ROWS}


def table() -> str:
    """The markdown of docs/feature-pairs.md."""
    rows = all_rows()
    refused = {k: why for k, why in pair_refusals().items() if why}
    lines = [
        "# Feature pairs: what trains with what",
        "",
        "Generated by `python tests/sweep/feature_table.py` from the sweep of",
        "tests/sweep/test_feature_pairs.py, which holds this file current. Every pair",
        "of two features' levels (a covering array's pairs, not the full product) is either",
        "refused by `zerocc plan check` with a PlanError naming both fields, or trained for",
        f"{STEPS} steps on CPU ranks within a row below, with parity to one process training on",
        "all ranks' batches (tests/parity's oracle and tolerances; a quantized collective's first",
        "step within 1e-3, its rounding alone, the next within 5e-2, as tests/engine/",
        "test_quantized.py holds them). Models: the example GPT, a Hugging Face Llama, a Hugging",
        "Face Mixtral with its router loss (4 layers in a pipeline row). `checkpoint.in_memory`",
        "acts under `zerocc train`'s launcher only: its cells hold that it changes nothing else.",
        "The default run trains the rows not marked --slow; `pytest --slow` trains them all.",
        "",
        "Rows known to fail are marked xfail with why; the pairs they alone would cover are",
        "covered again by repair rows that avoid the failing combinations (tests/sweep/",
        "feature_table.py, AVOID), so that each accepted pair but those of a failing",
        "combination of two (sequence parallelism on the Mixtral) also trains in a passing row.",
        "",
        f"## Trained cells ({len(rows)} rows covering {len(pair_refusals()) - len(refused)} pairs)",
        "",
        "| # | features | ranks | result |",
        "|---|---|---|---|",
    ]
    cheap = cheap_rows()
    for i, row in enumerate(rows):
        result = KNOWN_FAILURES.get(str(row))
        said = f"fails (xfail): {result}" if result else "ok"
        where = "" if i in cheap else " (--slow)"
        features = ", ".join(str(lv) for lv in row.levels)
        lines.append(f"| {i} | {features} | {case_of(row)['world']} | {said}{where} |")
    lines += [
        "",
        f"## Refused pairs ({len(refused)})",
        "",
        "| pair | plan check says |",
        "|---|---|",
    ]
    for (a, b), why in sorted(refused.items()):
        lines.append(f"| {a} + {b} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    TABLE.write_text(table())
    print(f"wrote {TABLE.relative_to(ROOT)}")
