"""examples/lightning/train.py as tests/integrations/test_lightning.py runs it: ``python
lightning_ranks.py --out DIR [--ckpt-path CKPT]``, whose ``Trainer(devices=2,
accelerator="cpu")`` launcher starts the second rank (running this script again). 4 optimizer
steps of 2 micro-batches (accumulate_grad_batches) of 2 rows per rank, a validation and a
checkpoint every 2 steps. Each rank writes the micro-batches it trained on, in order; rank 0
what training_step logged at each batch, and the module's weights after fit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "lightning"))
import train  # noqa: E402  (examples/lightning/train.py)

STEPS, ACCUMULATION, BATCH, SAVE_EVERY = 4, 2, 2, 2
OPTIONS = ["--max-steps", str(STEPS), "--accumulate", str(ACCUMULATION), "--batch-size",
           str(BATCH), "--save-every", str(SAVE_EVERY)]  # fmt: skip


class Recorder(pl.Callback):
    """Keeps the micro-batches this rank trained on, and what was logged after each."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:  # noqa: ANN001, D102
        self.batches.append(batch[0].clone())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001, D102
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.metrics.append({"step": trainer.global_step, **metrics})


def main(argv: list[str]) -> None:
    out = Path(argv[argv.index("--out") + 1])
    recorder = Recorder()
    trainer, module = train.main([*OPTIONS, *argv], callbacks=[recorder])
    torch.save(recorder.batches, out / f"batches-rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        torch.save(weights, out / "weights.pt")
        (out / "metrics.json").write_text(json.dumps(recorder.metrics))


if __name__ == "__main__":
    main(sys.argv[1:])
