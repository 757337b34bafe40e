"""TRL's SFTTrainer on a zerocc step through ZeroccTrainerMixin (docs/integrations.md): one
process, the tiny Llama of trainer_ranks.py on its token rows. SFTConfig turns activation
checkpointing on by default: it becomes the plan's recompute of every unit. The first step's
loss is the model's in bf16 (SFTConfig's default) on the first batch TRL's collator gives;
the rates are its schedule's."""

from __future__ import annotations

import pytest
import torch
from trainer_ranks import dataset, tiny_llama

pytest.importorskip("trl", reason='TRL is tested with it installed: pip install -e ".[dev]"')
from datasets import Dataset  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from zerocc.integrations.transformers import ZeroccTrainerMixin  # noqa: E402
from zerocc.integrations.transformers import __file__ as integration  # noqa: E402

TOKENIZER = __import__("pathlib").Path(integration).parents[2] / "examples/huggingface/tokenizer"
PLAN = {"zero": {"stage": 3}}
SAME = dict(per_device_train_batch_size=2, max_steps=3, logging_steps=1, learning_rate=1e-2,
            report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")  # fmt: skip


class ZeroccSFTTrainer(ZeroccTrainerMixin, SFTTrainer):
    """The mixin in front of TRL's trainer, as the docs show it (keeping its batches)."""

    def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001, ANN201
        self.batches = [*getattr(self, "batches", []), dict(inputs)]
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> ZeroccSFTTrainer:
    """TRL's trainer through the mixin, 3 steps at SFTConfig's defaults."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    tokenizer.pad_token = tokenizer.eos_token
    rows = [{"input_ids": r["input_ids"].tolist()} for r in dataset()]
    out = tmp_path_factory.mktemp("sft")
    config = SFTConfig(output_dir=str(out), max_length=16, **SAME)
    assert config.gradient_checkpointing  # TRL's default
    trainer = ZeroccSFTTrainer(model=tiny_llama(), args=config, processing_class=tokenizer,
                               train_dataset=Dataset.from_list(rows), plan=PLAN)  # fmt: skip
    trainer.train()
    return trainer


def test_sft_trainer_trains_through_the_mixin(sft):
    assert sft.zerocc_plan.recompute.units == "all"
    logged = [e for e in sft.state.log_history if "loss" in e]
    assert len(logged) == 3 and all(0 < e["loss"] < 10 for e in logged)
    assert [e["learning_rate"] for e in logged] == pytest.approx([1e-2, 2e-2 / 3, 1e-2 / 3])


def test_sft_first_loss_is_the_models_on_its_first_batch_in_bf16(sft):
    # SFTConfig trains in bf16 by default (bf16=True): the plan's precision.param, whose
    # forward is the model's own with its weights cast to bf16 (the fp32 model's loss is
    # 1.2e-5 relative away here). 1e-6: the same bf16 computation, logged through the
    # Trainer's fp32 sums.
    assert sft.args.bf16 and sft.zerocc_plan.precision.param == "bf16"
    with torch.no_grad():  # the model's loss on the first batch TRL's collator gave
        expected = tiny_llama().to(torch.bfloat16)(**sft.batches[0]).loss.float().item()
    first = next(e["loss"] for e in sft.state.log_history if "loss" in e)
    assert abs(first - expected) <= 1e-6 * expected
