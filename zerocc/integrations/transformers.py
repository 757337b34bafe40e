"""Hugging Face ``Trainer`` (and TRL's trainers, which are one) on a zerocc step.

``ZeroccTrainer(model, args, ..., plan="plan.yaml")`` is the Trainer with each optimizer step
run as one compiled zerocc step (forward, backward, communication, update): the same script,
launched as before (``torchrun``), with ``plan=`` where ``--deepspeed`` was. ``plan`` is a YAML
path, a dict, a :class:`zerocc.Plan` or the script's DeepSpeed JSON.

What stays the Trainer's: data loading (its samplers and collator), the loop and its callbacks,
logging (loss, learning rate), evaluation (each batch's loss by ``step.evaluate``),
``save_steps`` and ``resume_from_checkpoint`` (a zerocc checkpoint in ``zerocc/`` inside each
``checkpoint-N`` folder, beside the model's files and the Trainer's state) and ``save_model()``
(a Hugging Face folder ``from_pretrained`` loads). What becomes the plan's: the optimizer, its
schedule and clipping, gradient accumulation and precision (the arguments mapped by
:mod:`zerocc.integrations.trainer_args`, conflicts refused by name).

A trainer of another class takes the mixin first: ``class MySFT(ZeroccTrainerMixin,
SFTTrainer)``; ``MySFT(..., plan=...)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch import nn
from transformers import Trainer

import zerocc
from zerocc.compiler.plan import Plan
from zerocc.compiler.schedule import lr_at
from zerocc.errors import NotSupportedError, PlanError
from zerocc.integrations.trainer_args import (
    merged_plan,
    no_decay_parameters,
    plan_for_training,
    refuse_unsupported,
)

# The Trainer's loop this module hooks into (its _clip_grad_norm, _get_grad_norm, _wrap_model
# and checkpoint methods) is transformers 5's; 5.25 is the release tested.
if int(transformers.__version__.split(".")[0]) < 5:
    raise NotSupportedError(
        f"zerocc.integrations.transformers needs transformers 5 or later (installed: "
        f"{transformers.__version__}): pip install -U transformers"
    )

# The folder inside each of the Trainer's checkpoint-N folders that holds zerocc's checkpoint.
CHECKPOINT_FOLDER = "zerocc"

__all__ = ["CHECKPOINT_FOLDER", "ZeroccTrainer", "ZeroccTrainerMixin"]


class StepOptimizer(torch.optim.Optimizer):
    """What the Trainer holds as its optimizer: the update runs inside the zerocc step (on
    the step's last micro-batch), so ``step()`` and ``zero_grad()`` do nothing. Its one group's
    ``lr`` is the rate of the last update, for callbacks that read it."""

    def __init__(self, step: Any) -> None:
        # torch's Optimizer wants a parameter; the model's are the step's (on meta).
        super().__init__([torch.zeros(1, requires_grad=True)], {"lr": step.lr})
        self.zerocc_step = step

    def step(self, closure: Any = None) -> None:  # noqa: D102 (the update ran in the step)
        self.param_groups[0]["lr"] = last_lr(self.zerocc_step)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102 (the step zeroes)
        pass


class StepSchedule:
    """What the Trainer holds as its scheduler: the rate is the plan's ``optimizer.schedule``
    at the step's count of applied updates, which zerocc's checkpoints keep."""

    def __init__(self, step: Any) -> None:
        self.zerocc_step = step

    def step(self) -> None:
        """Nothing: the step advances its own schedule with each applied update."""

    def get_last_lr(self) -> list[float]:
        """The rate of the last update (the first's before any)."""
        return [last_lr(self.zerocc_step)]

    def state_dict(self) -> dict[str, Any]:
        """Empty: the position is the step's, in its checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`)."""


def last_lr(step: Any) -> float:
    """The learning rate of ``step``'s last applied update (of its first, before any)."""
    return lr_at(step.plan.optimizer, max(step.steps - 1, 0))


class CompiledModel(nn.Module):
    """The model as the Trainer's loop sees it once compiled: the step owns the weights (the
    model it was given sits on ``meta``), so nothing calls it; the Trainer wraps, moves and
    prepares nothing of it (no DDP: the step communicates itself)."""

    def __init__(self, model: nn.Module, step: Any) -> None:
        super().__init__()
        self.module = model
        self.zerocc_step = step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the weights are the step's; evaluate with ``step.evaluate``."""
        raise NotSupportedError(
            "the model is compiled into a zerocc step: evaluate through trainer.evaluate() "
            "(step.evaluate) or trainer.zerocc_step.materialize_model()"
        )


def _trainer_args(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The TrainingArguments a Trainer is being built with (its second argument)."""
    return kwargs.get("args", args[1] if len(args) > 1 else None)


class ZeroccTrainerMixin:
    """Makes a ``transformers.Trainer`` class (``Trainer``, TRL's ``SFTTrainer``, ...) run its
    optimizer steps as zerocc steps; put it first among the bases. Takes ``plan=`` beside the
    Trainer's own arguments. See :mod:`zerocc.integrations.transformers`."""

    zerocc_step: Any = None

    def __init__(
        self, *args: Any, plan: str | os.PathLike | dict | Plan | None = None, **kwargs: Any
    ) -> None:
        if plan is None:
            raise PlanError("ZeroccTrainer needs plan=: a plan YAML, a dict or a DeepSpeed JSON")
        training_args = _trainer_args(args, kwargs)
        if training_args is not None:
            refuse_unsupported(training_args)  # before the Trainer sets any of it up
        if kwargs.get("compute_loss_func") is not None:
            raise PlanError(
                "Trainer(compute_loss_func=...) is not used with zerocc: the step's loss is the "
                "model's (its .loss); compile a loss into the model instead"
            )
        super().__init__(*args, **kwargs)
        refuse_unsupported(self.args)
        decayed = self.get_decay_parameter_names(self.model)
        self.zerocc_plan = merged_plan(plan, self.args, no_decay_parameters(self.model, decayed))
        # Activation checkpointing became the plan's recompute: the Trainer must not also turn
        # on the model's own (torch.utils.checkpoint inside the captured step).
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            if getattr(self.args, name, False):
                setattr(self.args, name, False)
        self._compiled_model: CompiledModel | None = None

    # -- the step in the Trainer's loop --------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Compile the step (the Trainer's step count known now: the schedule's length) and
        hand the Trainer a stand-in optimizer."""
        if self.zerocc_step is None:
            plan = plan_for_training(self.zerocc_plan, self.args, self.state.max_steps)
            self.model.train()
            self.zerocc_step = zerocc.compile(self.model, plan)
            self._compiled_model = CompiledModel(self.model, self.zerocc_step)
        if self.optimizer is None:
            self.optimizer = StepOptimizer(self.zerocc_step)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> StepSchedule:
        """The stand-in scheduler: the plan's schedule, run by the step."""
        if self.lr_scheduler is None:
            self.lr_scheduler = StepSchedule(self.zerocc_step)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        if self._compiled_model is None:
            return super()._wrap_model(model, training, dataloader)
        return self._compiled_model

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-batch through the step (it updates on the plan's last micro-batch of the
        optimizer step); returns its loss over the Trainer's accumulation, for its logs."""
        step = self.zerocc_step
        if self.current_gradient_accumulation_steps != step.plan.grad_accumulation:
            raise PlanError(
                f"gradient_accumulation_steps: this optimizer step (the epoch's last) has "
                f"{self.current_gradient_accumulation_steps} micro-batches, every step of the "
                f"plan has {step.plan.grad_accumulation}; give an epoch a multiple of "
                "per_device_train_batch_size x gradient_accumulation_steps x ranks rows "
                "(dataloader_drop_last=True drops a last short batch)"
            )
        loss = step(**self._prepare_inputs(inputs))
        return loss.detach() / self.current_gradient_accumulation_steps

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the step clips (optimizer.grad_clip); its norm is not read out

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # not logged rather than a wrong 0 (the step keeps the norm inside)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The batch's loss under the step's weights (``step.evaluate``, every rank)."""
        if self.zerocc_step is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise NotSupportedError(
                "evaluation with compute_metrics (or prediction_loss_only=False) needs the "
                "logits; a zerocc step evaluates the loss only: drop compute_metrics, or "
                "evaluate trainer.zerocc_step.materialize_model() yourself"
            )
        loss = self.zerocc_step.evaluate(**self._prepare_inputs(inputs))
        return loss.detach(), None, None

    # -- saving and resuming -------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder of the step's weights (``from_pretrained`` loads it); every
        rank calls it (the weights are gathered), rank 0 writes."""
        if self.zerocc_step is None:
            return super().save_model(output_dir, _internal_call)
        trained = self.zerocc_step.materialize_model()
        compiled, self.model = self.model, trained
        try:
            self._save(output_dir if output_dir is not None else self.args.output_dir)
        finally:
            self.model = compiled

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.zerocc_step is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.zerocc_step.save(os.path.join(output_dir, CHECKPOINT_FOLDER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights come with the optimizer's state, from zerocc's checkpoint, once the step
        # is compiled (_load_optimizer_and_scheduler); here only that it is there.
        folder = os.path.join(resume_from_checkpoint, CHECKPOINT_FOLDER)
        if not os.path.isdir(folder):
            raise PlanError(
                f"resume_from_checkpoint: {resume_from_checkpoint} has no {CHECKPOINT_FOLDER}/ "
                "folder (it was not saved by a ZeroccTrainer, or with save_only_model=True); "
                "resume from a checkpoint-N folder a ZeroccTrainer saved"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.zerocc_step is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.zerocc_step.load(os.path.join(checkpoint, CHECKPOINT_FOLDER))


class ZeroccTrainer(ZeroccTrainerMixin, Trainer):
    """``transformers.Trainer`` whose optimizer steps are zerocc steps: ``plan=`` beside the
    Trainer's arguments (see :mod:`zerocc.integrations.transformers`)."""
