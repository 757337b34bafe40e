"""A ZeroccTrainer run as tests/integrations/test_transformers.py launches it (`torchrun
--nproc_per_node 2`): a tiny Llama on 32 fixed-length token rows, 2 micro-batches of 2 rows
per optimizer step on each rank. Each rank writes the micro-batches it trained on in order;
rank 0 the Trainer's log history, the step's weights and the logits of its trained model on a
fixed input (beside the save_model() folder, model/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from zerocc.integrations.transformers import ZeroccTrainer

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
ROWS, LENGTH = 32, 16
PROBE = torch.arange(LENGTH).remainder(64).unsqueeze(0)  # the input the logits are taken on


def tiny_llama() -> LlamaForCausalLM:
    """The model every run (and the test's one-process reference) starts from."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def dataset() -> list[dict[str, torch.Tensor]]:
    """Rows of tokens that are their own labels (the model shifts them)."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 64, (ROWS, LENGTH), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


class Recording(ZeroccTrainer):
    """Keeps the micro-batches this rank trained on, in order."""

    seen: list[torch.Tensor]

    def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001, ANN201
        self.seen.append(inputs["input_ids"].clone())
        return super().training_step(model, inputs, num_items_in_batch)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--lr-scheduler", default="linear")
    options = parser.parse_args(argv)
    args = TrainingArguments(
        output_dir=str(options.out / "trainer"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=1e-2,
        warmup_steps=1,
        lr_scheduler_type=options.lr_scheduler,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if options.save_steps else "no",
        save_steps=options.save_steps or 500,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Recording(model=tiny_llama(), args=args, train_dataset=dataset(),
                        plan={"zero": {"stage": 3}})  # fmt: skip
    trainer.seen = []
    trainer.train(resume_from_checkpoint=options.resume)
    rank = trainer.args.process_index
    torch.save(trainer.seen, options.out / f"batches-rank{rank}.pt")
    trainer.save_model(str(options.out / "model"))
    weights = trainer.zerocc_step.full_state_dict()
    trained = trainer.zerocc_step.materialize_model()
    if rank == 0:
        with torch.no_grad():
            logits = trained(input_ids=PROBE).logits
        torch.save({"weights": weights, "logits": logits}, options.out / "trained.pt")
        history = trainer.state.log_history
        (options.out / "log.json").write_text(json.dumps(history))


if __name__ == "__main__":
    main(sys.argv[1:])
