"""zerocc.integrations.transformers: a Hugging Face Trainer script on zerocc by one argument.

Two gloo ranks under torchrun (as users launch it) run tests/integrations/trainer_ranks.py: a
tiny Llama, 2 micro-batches of 2 rows per rank and optimizer step, the Trainer's linear
schedule with warmup and clipping mapped onto the plan. Held: (a) the Trainer's logged losses
and the final weights are one process's training on all ranks' micro-batches with
torch.optim.AdamW and the Trainer's own scheduler, within tests/parity's tolerance; (b) the
save_model() folder loads with AutoModelForCausalLM.from_pretrained and gives the run's
logits; (c) resume_from_checkpoint from checkpoint-2 continues bit for bit; (d) arguments that
conflict with the plan are refused by name, before any rank trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_ranks import PROBE, dataset, tiny_llama

pytest.importorskip("accelerate", reason='the Trainer needs accelerate: pip install -e ".[dev]"')
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from zerocc.errors import PlanError  # noqa: E402
from zerocc.integrations.transformers import ZeroccTrainer  # noqa: E402

TOL = 1e-5  # tests/parity's (fp32, 2 ranks against one process)
RANKS = Path(__file__).parent / "trainer_ranks.py"
STEPS, ACCUMULATION, WORLD = 4, 2, 2


def _torchrun(out: Path, *options: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
               "--standalone", str(RANKS), "--out", str(out), *options]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    trained = torch.load(out / "trained.pt")
    return {
        "log": [e for e in json.loads((out / "log.json").read_text()) if "loss" in e],
        "batches": [torch.load(out / f"batches-rank{r}.pt") for r in range(WORLD)],
        **trained,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The run, saving at step 2 (its checkpoint-2 is what (c) resumes from)."""
    out = tmp_path_factory.mktemp("trainer")
    return {"out": out, **_torchrun(out, "--save-steps", "2")}


def _reference(batches: list[list[torch.Tensor]]) -> tuple[list[float], dict]:
    """One process on every rank's micro-batches: the mean loss per optimizer step, AdamW at
    the Trainer's arguments, its linear schedule (warmup 1), clipped at 1.0."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, 1, STEPS)
    losses = []
    for step in range(STEPS):
        micro = [b[step * ACCUMULATION + i] for b in batches for i in range(ACCUMULATION)]
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in micro) / len(micro)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_trainer_trains_as_one_process_with_adamw(run):
    losses, state = _reference(run["batches"])
    logged = [e["loss"] for e in run["log"]]
    assert len(logged) == STEPS and [e["step"] for e in run["log"]] == [1, 2, 3, 4]
    for step, (ours, theirs) in enumerate(zip(logged, losses, strict=True)):
        assert abs(ours - theirs) <= TOL * abs(theirs), f"step {step + 1}: {ours} vs {theirs}"
    assert [e["learning_rate"] for e in run["log"]] == pytest.approx(
        [0.0, 1e-2, 2e-2 / 3, 1e-2 / 3]
    )
    assert set(run["weights"]) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(run["weights"][name], value, rtol=TOL, atol=TOL, msg=name)


def test_save_model_folder_loads_with_from_pretrained(run):
    loaded = AutoModelForCausalLM.from_pretrained(run["out"] / "model")
    with torch.no_grad():
        logits = loaded(input_ids=PROBE).logits
    assert torch.equal(logits, run["logits"])
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, run["weights"][name]), name


def test_resume_from_checkpoint_continues_bit_identically(run, tmp_path):
    checkpoint = run["out"] / "trainer" / "checkpoint-2"
    assert (checkpoint / "zerocc" / "step-00000002").is_dir()
    resumed = _torchrun(tmp_path, "--resume", str(checkpoint))
    # (the log history starts with the checkpoint's: steps 1 and 2)
    assert resumed["log"][:2] == run["log"][:2]
    assert [e["step"] for e in resumed["log"]] == [1, 2, 3, 4]
    assert [e["loss"] for e in resumed["log"]] == [e["loss"] for e in run["log"]]
    for rank in range(WORLD):  # the same micro-batches, from the third step's
        done = run["batches"][rank][2 * ACCUMULATION :]
        assert all(torch.equal(a, b) for a, b in zip(resumed["batches"][rank], done, strict=True))
    for name, value in run["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


def _trainer(plan: dict | None = None, **arguments) -> ZeroccTrainer:
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **arguments)
    return ZeroccTrainer(model=tiny_llama(), args=args, train_dataset=dataset(),
                         plan=plan or {"zero": {"stage": 3}})  # fmt: skip


@pytest.mark.parametrize(
    "plan, arguments, named",
    [
        (None, {"fsdp": "full_shard"}, "fsdp="),
        (None, {"optim": "adafactor"}, "optim='adafactor'"),
        (None, {"lr_scheduler_type": "polynomial"}, "lr_scheduler_type='polynomial'"),
        ({"precision": {"param": "fp32"}}, {"bf16": True}, "bf16=True"),
        ({"optimizer": {"lr": 3e-4}}, {"learning_rate": 1e-3}, "learning_rate"),
        ({"grad_accumulation": 4}, {"gradient_accumulation_steps": 2},
         "gradient_accumulation_steps=2"),
        (None, {"weight_decay": 0.1}, "weight_decay=0.1"),
        (None, {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
         "load_best_model_at_end"),
    ],
)  # fmt: skip
def test_a_conflicting_argument_is_refused_by_name(plan, arguments, named):
    with pytest.raises(PlanError, match=r"^TrainingArguments\." + named):
        _trainer(plan, **arguments)


def test_the_arguments_become_the_plan():
    trainer = _trainer(None, learning_rate=3e-3, adam_beta2=0.95, max_grad_norm=0.5,
                       gradient_accumulation_steps=2, bf16=True,
                       gradient_checkpointing=True)  # fmt: skip
    plan = trainer.zerocc_plan
    assert (plan.optimizer.lr, plan.optimizer.betas, plan.optimizer.grad_clip) == (
        3e-3, (0.9, 0.95), 0.5)  # fmt: skip
    assert plan.grad_accumulation == 2 and plan.precision.param == "bf16"
    assert plan.recompute.units == "all"
