"""A Hugging Face Trainer script on zerocc: the script users already have, with ``plan=``
where ``--deepspeed`` was (docs/integrations.md shows the one-line change).

A small Llama-style model built from a config (fresh weights; ``--model DIR`` loads a local
folder instead), the byte-level tokenizer and the JSONL documents beside this file, read through
``datasets`` where it is installed (else a plain list), packed into rows of ``--seq-len`` tokens
(one shape: the step compiles once). Launch as usual:

    torchrun --nproc_per_node 2 examples/huggingface/trainer_sft.py --max-steps 10 --out run/

``--plan`` takes a plan YAML or the DeepSpeed JSON the script was run with.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    TrainingArguments,
    default_data_collator,
)

from zerocc.integrations.transformers import ZeroccTrainer

HERE = Path(__file__).parent
PLAN = {"zero": {"stage": 3}, "units": {"classes": ["LlamaDecoderLayer"]}}  # or a YAML / DS JSON


def documents(path: Path) -> list[str]:
    """The documents' texts, through ``datasets`` when installed."""
    try:
        from datasets import load_dataset
    except ImportError:
        return [json.loads(line)["text"] for line in path.read_text().splitlines() if line]
    return list(load_dataset("json", data_files=str(path), split="train")["text"])


def packed(texts: list[str], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> list[dict]:
    """The documents' tokens end to end (an end-of-text between them), cut into rows of
    ``seq_len`` that are their own labels (the model shifts them)."""
    ids = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    rows = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default=None, help="a plan YAML or DeepSpeed JSON")
    parser.add_argument("--model", default=None, help="a local model folder (default: a config)")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default="trainer_sft_out")
    options = parser.parse_args()

    tokenizer = PreTrainedTokenizerFast.from_pretrained(HERE / "tokenizer")
    if options.model:
        model = AutoModelForCausalLM.from_pretrained(options.model)
    else:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128)  # fmt: skip
        model = AutoModelForCausalLM.from_config(config)
    rows = packed(documents(HERE / "data.jsonl"), tokenizer, options.seq_len)
    held_out = max(1, len(rows) // 10)
    # Every optimizer step of a zerocc plan has its grad_accumulation micro-batches: the rows
    # of an epoch are a multiple of a step's on all ranks (the Trainer would end an epoch on
    # a shorter step).
    per_step = 4 * 2 * int(os.environ.get("WORLD_SIZE", 1))
    train_rows = rows[:-held_out][: (len(rows) - held_out) // per_step * per_step]
    args = TrainingArguments(
        output_dir=options.out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=options.max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=options.max_steps,
        save_steps=options.max_steps,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),  # gloo ranks on a machine without GPUs
    )
    trainer = ZeroccTrainer(
        model=model,
        args=args,
        train_dataset=train_rows,
        eval_dataset=rows[-held_out:],
        processing_class=tokenizer,
        data_collator=default_data_collator,  # rows of one length: nothing to pad
        plan=options.plan or PLAN,  # was: TrainingArguments(..., deepspeed="ds_config.json")
    )
    trainer.train()
    trainer.save_model(str(Path(options.out) / "final"))


if __name__ == "__main__":
    main()
