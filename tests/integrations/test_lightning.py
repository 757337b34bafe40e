"""zerocc.integrations.lightning: a Lightning script on zerocc by one argument.

examples/lightning/train.py runs on two CPU ranks as users start it (``python
lightning_ranks.py``, whose ``Trainer(devices=2, accelerator="cpu")`` launches the second rank):
its byte-level GPT, 4 optimizer steps of 2 micro-batches of 2 rows per rank. Held: (a) the
module's weights after fit are one process's plain torch training on all ranks' micro-batches
(AdamW, the script's LambdaLR, clipping at 1.0), within tests/parity's tolerance; (b) what
training_step logged is each micro-batch's loss and its step's rate, and the validation loop's
loss is the reference's on the step's weights; (c) ModelCheckpoint's files hold the whole
model's state_dict (load_from_checkpoint reads it) beside the step's checkpoint, and (slow) a
fit resumed from one continues as one process would. What the step cannot honour is refused by
name, before anything is compiled (no ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason='needs Lightning: pip install -e ".[lightning]"')
import lightning.pytorch as pl  # noqa: E402
from lightning_ranks import ACCUMULATION, BATCH, STEPS, train  # noqa: E402

from zerocc.errors import NotSupportedError, PlanError  # noqa: E402
from zerocc.integrations.lightning import _refuse_unsupported  # noqa: E402
from zerocc.integrations.lightning_logs import LoggedInStep  # noqa: E402
from zerocc.integrations.lightning_plan import LightningRun, plan_for_lightning  # noqa: E402

TOL = 1e-5  # tests/parity's (fp32, 2 ranks against one process)
RANKS = Path(__file__).parent / "lightning_ranks.py"
WORLD, WARMUP = 2, 2
TinyGPT = train.TinyGPT


def _fit(out: Path, *options: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(RANKS), "--out", str(out), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=out)
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        "out": out,
        "weights": torch.load(out / "weights.pt"),
        "metrics": json.loads((out / "metrics.json").read_text()),
        "batches": [torch.load(out / f"batches-rank{r}.pt") for r in range(WORLD)],
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _fit(tmp_path_factory.mktemp("lightning"))


def warmup_decay(step: int) -> float:
    """The example's schedule for a run of STEPS steps."""
    if step < WARMUP:
        return step / WARMUP
    return max(0.0, (STEPS - step) / (STEPS - WARMUP))


def _reference(batches: list[list[torch.Tensor]]) -> dict:
    """One process on every rank's micro-batches, plain torch: the mean loss of a step's
    micro-batches, AdamW with the LambdaLR, clipped at 1.0. Returns rank 0's micro-batch
    losses, the rates, the weights after step 2 and the model after the last."""
    pl.seed_everything(0, verbose=False)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
    losses, rates, at_step_2 = [], [], None
    for step in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        total = 0.0
        for rank in range(WORLD):
            for tokens in batches[rank][step * ACCUMULATION : (step + 1) * ACCUMULATION]:
                loss = model.loss(tokens)
                if rank == 0:
                    losses.append(loss.item())
                total = total + loss
        (total / (WORLD * ACCUMULATION)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step == 1:
            at_step_2 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "rates": rates, "at_step_2": at_step_2, "model": model}


def _close(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=TOL, atol=TOL, msg=name)


def test_fit_trains_as_one_process_with_plain_torch(run):
    assert [len(b) for b in run["batches"]] == [STEPS * ACCUMULATION] * WORLD
    assert all(x.shape[0] == BATCH for b in run["batches"] for x in b)
    _close(run["weights"], _reference(run["batches"])["model"].state_dict())


def test_training_step_logs_each_batch_loss_and_rate(run):
    reference = _reference(run["batches"])
    logged = [m["train_loss"] for m in run["metrics"]]
    assert logged == pytest.approx(reference["losses"], rel=TOL)
    # the rate each micro-batch trains at: its optimizer step's (fp32 as Lightning logs it)
    rates = [reference["rates"][i // ACCUMULATION] for i in range(STEPS * ACCUMULATION)]
    assert [m["lr"] for m in run["metrics"]] == pytest.approx(rates, rel=1e-6)
    assert rates[0] == 0 and max(rates) == TinyGPT().hparams.lr  # the warmup, then the decay


def test_validation_loop_runs_on_the_step_weights(run):
    """After step 2: val_loss (sync_dist: the ranks' mean) is the reference's weights' on
    each rank's two validation batches (rank r: rows r, r+2 | r+4, r+6)."""
    reference = _reference(run["batches"])
    model = TinyGPT()
    model.load_state_dict(reference["at_step_2"])
    rows = train.text_rows(Path(train.__file__), model.hparams.seq_len).tensors[0]
    with torch.no_grad():
        batches = [rows[[r + 4 * j, r + 4 * j + 2]] for r in range(WORLD) for j in range(2)]
        expected = torch.stack([model.loss(b) for b in batches]).mean()
    val = [m["val_loss"] for m in run["metrics"] if "val_loss" in m]
    assert val and val[0] == pytest.approx(expected.item(), rel=TOL)


def test_model_checkpoint_holds_the_whole_model_and_the_step_checkpoint(run):
    folder = run["out"] / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=2.ckpt.zerocc",
                     "epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.zerocc"]  # fmt: skip
    assert (folder / "epoch=0-step=2.ckpt.zerocc" / "step-00000002").is_dir()
    loaded = TinyGPT.load_from_checkpoint(folder / "epoch=0-step=2.ckpt")
    _close(loaded.state_dict(), _reference(run["batches"])["at_step_2"])
    last = torch.load(folder / "epoch=0-step=4.ckpt", weights_only=False)["state_dict"]
    for name, value in run["weights"].items():
        assert torch.equal(last[name], value), name


@pytest.mark.slow
def test_a_fit_resumed_from_a_checkpoint_continues_as_one_process(run, tmp_path):
    """ckpt_path= the step-2 checkpoint: the step's weights, optimizer state and rate come
    back (Lightning restarts the epoch's data loader, so steps 3-4 see its first batches)."""
    checkpoint = run["out"] / "checkpoints" / "epoch=0-step=2.ckpt"
    resumed = _fit(tmp_path, "--ckpt-path", str(checkpoint))
    done = 2 * ACCUMULATION
    batches = [run["batches"][r][:done] + resumed["batches"][r] for r in range(WORLD)]
    assert [len(b) for b in resumed["batches"]] == [done] * WORLD
    reference = _reference(batches)
    _close(resumed["weights"], reference["model"].state_dict())
    assert [m["lr"] for m in resumed["metrics"]] == pytest.approx(
        [reference["rates"][2 + i // ACCUMULATION] for i in range(done)], rel=1e-6
    )


# -- refused by name, before anything is compiled ---------------------------------------------


class Manual(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class Clipping(TinyGPT):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, algorithm=None):  # noqa: ANN001, ANN201, D102
        pass


@pytest.mark.parametrize(
    "module, optimizers, named",
    [
        (Manual(), [None], "automatic_optimization=False"),
        (TinyGPT(), [None, None], "returned 2 optimizers"),
        (Clipping(), [None], "Clipping.configure_gradient_clipping is overridden"),
    ],
)
def test_a_feature_the_step_cannot_honour_is_refused_by_name(module, optimizers, named):
    with pytest.raises(NotSupportedError, match=named):
        _refuse_unsupported(module, optimizers)


def _run(optimizer=None, scheduler=None, **settings) -> LightningRun:  # noqa: ANN001
    """A run of the test's module; ``optimizer`` makes the optimizer of its parameters."""
    module = TinyGPT()
    optimizer = (optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-2)))(module.parameters())
    config = None
    if scheduler is not None:
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        config = LRSchedulerConfig(scheduler(optimizer), interval=settings.pop("interval", "step"))
    fields = dict(gradient_clip_val=None, gradient_clip_algorithm=None, accumulate_grad_batches=1,
                  precision="32-true", total_steps=STEPS, steps_per_epoch=STEPS)  # fmt: skip
    return LightningRun(module, optimizer, config, **{**fields, **settings})


def _lambda(optimizer):  # noqa: ANN001, ANN202
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)


def test_the_optimizer_scheduler_and_trainer_settings_become_the_plan():
    plan = plan_for_lightning({"zero": {"stage": 3}}, _run(scheduler=_lambda, gradient_clip_val=0.5,
                              accumulate_grad_batches=2, precision="bf16-mixed"))  # fmt: skip
    assert (plan.optimizer.name, plan.optimizer.lr, plan.optimizer.grad_clip) == (
        "adamw",
        1e-2,
        0.5,
    )
    schedule = plan.optimizer.schedule
    assert (schedule.name, schedule.warmup_steps, schedule.total_steps) == ("linear", WARMUP, STEPS)
    assert plan.grad_accumulation == 2 and plan.precision.param == "bf16"
    sgd = plan_for_lightning({}, _run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))
    assert (sgd.optimizer.name, sgd.optimizer.lr, sgd.optimizer.momentum) == ("sgd", 0.1, 0.9)
    assert sgd.optimizer.schedule.name == "constant"


def _one_cycle(optimizer):  # noqa: ANN001, ANN202
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, 1e-2, total_steps=STEPS, cycle_momentum=False
    )


@pytest.mark.parametrize(
    "plan, settings, error, named",
    [
        ({}, {"optimizer": lambda p: torch.optim.Adam(p)}, NotSupportedError,
         r"torch\.optim\.Adam;"),
        ({}, {"scheduler": _one_cycle}, NotSupportedError, "OneCycleLR gives rates no plan"),
        ({}, {"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 1)}, NotSupportedError,
         "StepLR gives rates no plan"),
        ({}, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, NotSupportedError,
         "gradient_clip_algorithm='value'"),
        ({"grad_accumulation": 4}, {"accumulate_grad_batches": 2}, PlanError,
         r"Trainer\(accumulate_grad_batches\)=2 conflicts with the plan's grad_accumulation: 4"),
        ({}, {"precision": "bf16-true"}, NotSupportedError, "precision='bf16-true'"),
        ({"precision": {"param": "fp16"}}, {"precision": "bf16-mixed"}, PlanError,
         r"precision='bf16-mixed'\) conflicts"),
        ({"optimizer": {"lr": 3e-4}}, {}, PlanError, r"AdamW\(lr=\.\.\.\)=0\.01 conflicts"),
        ({"parallel": {"pp": 2}}, {}, NotSupportedError, "parallel.pp: 2 under ZeroccStrategy"),
    ],
)  # fmt: skip
def test_a_setting_the_plan_cannot_honour_is_refused_by_name(plan, settings, error, named):
    with pytest.raises(error, match=named):
        plan_for_lightning(plan, _run(**settings))


class LogsAnAccuracy(TinyGPT):
    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201, D102
        loss = self.loss(batch[0])
        self.log("train_loss", loss)
        self.log("accuracy", (loss < 1).float())
        return loss


def test_a_logged_value_the_step_does_not_return_is_refused_by_name():
    """training_step is captured once: an accuracy it logs would be the capture's at every
    step. (Here training_step runs eagerly, as the capture runs it.)"""
    module = LogsAnAccuracy()
    optimizer = torch.optim.AdamW(module.parameters())
    logged = LoggedInStep(module, optimizer, [])
    tokens = torch.zeros(2, 9, dtype=torch.long)
    parts, named = logged.step_inputs([tokens], 0)
    loss = logged.loss_fn(module, *parts, **named)
    with pytest.raises(
        NotSupportedError, match=r"^self\.log\('accuracy', \.\.\.\) in training_step"
    ):
        logged.replay(module, loss)
