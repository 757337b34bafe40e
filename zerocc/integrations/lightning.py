"""Lightning on a zerocc step: ``Trainer(strategy=ZeroccStrategy("plan.yaml"))``.

The LightningModule's ``training_step`` (forward and loss) is captured into one compiled zerocc
step with its backward, communication and update: the same script, launched as before
(``devices=N`` with Lightning's launcher, or ``torchrun``), with ``strategy=ZeroccStrategy(plan)``
where ``strategy="deepspeed_stage_3"`` or ``"fsdp"`` was. ``plan`` is a YAML path, a dict, a
:class:`zerocc.Plan` or a DeepSpeed JSON.

What stays Lightning's: the loop, data loading (its distributed sampler), callbacks, logging
(``self.log`` of the loss ``training_step`` returns and of the learning rate, each step's own
value), the validation loop (``validation_step`` on the step's current weights, materialized
into the module for it), ``max_steps``/``max_epochs``, ``ModelCheckpoint`` and ``ckpt_path``
(the ``.ckpt`` file holds the whole model's ``state_dict``, which ``load_from_checkpoint``
reads; a zerocc checkpoint beside it, ``<file>.zerocc/``, holds the sharded optimizer state a
resume reads). What becomes the plan's: the optimizer and scheduler of
``configure_optimizers``, gradient clipping, ``accumulate_grad_batches`` and precision
(:mod:`zerocc.integrations.lightning_plan`, conflicts refused by name).

``training_step`` is captured once, on the first batch: what it computes on the host is
fixed then (its ``batch_idx`` included), as in any captured graph; it is run again for a batch
of new shapes only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

import zerocc
from zerocc.compiler.plan import Plan
from zerocc.errors import CheckpointError, NotSupportedError, PlanError
from zerocc.integrations.lightning_logs import LoggedInStep
from zerocc.integrations.lightning_plan import LightningRun, plan_for_lightning

__all__ = ["CHECKPOINT_SUFFIX", "ZeroccStrategy"]

# A .ckpt file's zerocc checkpoint (the sharded weights and optimizer state) is the folder
# beside it named so: epoch=0-step=4.ckpt.zerocc/.
CHECKPOINT_SUFFIX = ".zerocc"

# LightningModule hooks that read or change gradients, which live inside the compiled step:
# overridden, they would never run, so they are refused by name.
GRADIENT_HOOKS = (
    "optimizer_step",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "backward",
)


class ZeroccStrategy(DDPStrategy):
    """Lightning's strategy for a zerocc step: each optimizer step of ``training_step`` runs as
    one compiled zerocc step under ``plan`` (see :mod:`zerocc.integrations.lightning`).

    Its launching, process group and sampler are DDP's (it subclasses ``DDPStrategy``); the
    model is not wrapped in DistributedDataParallel: the step communicates itself.
    """

    strategy_name = "zerocc"

    def __init__(self, plan: str | os.PathLike | dict | Plan, **kwargs: Any) -> None:
        if plan is None:
            raise PlanError("ZeroccStrategy needs a plan: a plan YAML, a dict or a DeepSpeed JSON")
        super().__init__(**kwargs)
        self.zerocc_source = plan
        self.zerocc_plan: Plan | None = None
        self.zerocc_step: Any = None
        self._logged: LoggedInStep | None = None
        self._on_meta = False  # the module's weights are the step's (it sits on meta)

    # -- setup: the plan, then the step --------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        """The accelerator and precision as DDP's; when fitting, the optimizers of
        ``configure_optimizers`` read into the plan and the step compiled (the module's weights
        become the step's). Validating, testing or predicting alone run the module as it is."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._compile(trainer)
        self.setup_precision_plugin()

    def _compile(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        _refuse_unsupported(module, self.optimizers)
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # (what an epoch holds: its scheduler's steps)
        total = trainer.estimated_stepping_batches
        if total == float("inf") and self.lr_scheduler_configs:
            raise NotSupportedError(
                "configure_optimizers returned a scheduler for a run with no end (max_steps=-1, "
                "max_epochs=-1): zerocc's schedule is fixed in advance; set max_steps"
            )
        accumulation = trainer.accumulate_grad_batches
        batches = trainer.num_training_batches
        steps_per_epoch = max(1, int(batches) // accumulation) if batches != float("inf") else 1
        run = LightningRun(
            module=module,
            optimizer=self.optimizers[0],
            scheduler=self.lr_scheduler_configs[0] if self.lr_scheduler_configs else None,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            accumulate_grad_batches=accumulation,
            precision=str(trainer.precision),
            total_steps=int(total) if total != float("inf") else 1,
            steps_per_epoch=steps_per_epoch,
        )
        self.zerocc_plan = plan_for_lightning(self.zerocc_source, run)
        # The torch optimizer stays Lightning's (its scheduler moves its lr, which
        # LearningRateMonitor and self.optimizers() read, the plan's rates by construction)
        # but holds no parameter: the step updates them.
        for group in self.optimizers[0].param_groups:
            group["params"] = []
        self.optimizers[0].state.clear()
        self.optimizers[0]._opt_called = True  # (torch's scheduler warns until it steps)
        module.train()
        self._logged = LoggedInStep(module, self.optimizers[0], self.lr_scheduler_configs)
        self.zerocc_step = zerocc.compile(module, self.zerocc_plan, self._logged.loss_fn)
        self._on_meta = True
        _weights_to_meta(module, self.root_device)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A checkpoint loads into the compiled step, so after setup."""
        return True

    @property
    def handles_gradient_accumulation(self) -> bool:
        """Lightning counts the micro-batches (``accumulate_grad_batches``, the plan's
        ``grad_accumulation``); the step updates on the last of them."""
        return False

    # -- the step in Lightning's loop ----------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-batch through the step; its loss is what ``training_step`` returned (and
        what it logged, logged again with this batch's values)."""
        if self.zerocc_step is None:
            return super().training_step(*args, **kwargs)
        batch, batch_idx = (list(args) + list(kwargs.values()) + [0])[:2]
        assert self._logged is not None
        positional, named = self._logged.step_inputs(batch, batch_idx)
        loss = self.zerocc_step(*positional, **named)
        self._logged.replay(self.lightning_module, loss)
        return loss

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Nothing: the step ran the backward with its forward."""
        if self.zerocc_step is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return closure_loss

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """The optimizer step's last micro-batch (the closure), whose step call updates; the
        torch optimizer does not step (its scheduler, Lightning's, still does)."""
        if self.zerocc_step is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        step = self.zerocc_step
        accumulation = step.plan.grad_accumulation
        if step.micro_batches % accumulation:
            raise PlanError(
                f"accumulate_grad_batches: this optimizer step (the epoch's last) has "
                f"{step.micro_batches % accumulation} micro-batches, every step of the plan "
                f"has {accumulation}; give an epoch a multiple of {accumulation} batches per "
                "rank (DataLoader(drop_last=True), or limit_train_batches)"
            )
        return result

    # -- the module's weights: the step's, materialized to validate and after fitting --------

    def _materialize(self) -> None:
        """The step's current weights into the module (every rank: a collective)."""
        if self.zerocc_step is not None and self._on_meta:
            self.zerocc_step.materialize_model(self.root_device)
            self._on_meta = False

    def _back_to_meta(self) -> None:
        """Frees the module's copy of the weights again: the step keeps training its own."""
        module = self.lightning_module
        if self.zerocc_step is not None and not self._on_meta and module is not None:
            self._on_meta = True
            _weights_to_meta(module, self.root_device)

    def on_validation_start(self) -> None:
        """The module gets the step's weights for ``validation_step`` (the whole model on
        every rank for the validation loop)."""
        self._materialize()
        super().on_validation_start()

    def on_validation_end(self) -> None:
        """While fitting, the module's weights go back to the step."""
        super().on_validation_end()
        module = self.lightning_module
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            self._back_to_meta()

    def on_train_start(self) -> None:
        """After a resume, ModelCheckpoint would save again at the step it resumed from, on
        its first micro-batch (it does not keep the step it saved last): a zerocc checkpoint
        is taken after a step's last micro-batch only, and this one is on disk already."""
        super().on_train_start()
        module = self.lightning_module
        if self.zerocc_step is None or module is None or not module.trainer.global_step:
            return
        for callback in module.trainer.checkpoint_callbacks:
            if getattr(callback, "_last_global_step_saved", None) == 0:
                callback._last_global_step_saved = module.trainer.global_step

    def on_train_end(self) -> None:
        """The module holds the trained weights after ``fit``, as under DDP."""
        self._materialize()
        super().on_train_end()

    def teardown(self) -> None:
        """DDP's, but a module left on meta (a fit that failed) is not moved to the CPU: it
        has no data, and the error that stopped the fit is the one to see."""
        module = self.lightning_module
        if module is None or not self._on_meta:
            return super().teardown()
        module.__dict__["cpu"] = lambda: module  # (Strategy.teardown calls module.cpu())
        try:
            super().teardown()
        finally:
            del module.__dict__["cpu"]

    # -- checkpoints ---------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's weights (gathered from the step: every rank calls it), so that
        the ``.ckpt`` loads with ``LightningModule.load_from_checkpoint``."""
        if self.zerocc_step is None or not self._on_meta:
            return super().lightning_module_state_dict()
        return self.zerocc_step.full_state_dict()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """The ``.ckpt`` (rank 0) and, beside it, the step's own checkpoint (every rank
        writes its shards) that a resume reads."""
        if self.zerocc_step is not None:
            self.zerocc_step.save(_zerocc_folder(filepath), keep=1)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """The ``.ckpt`` and its zerocc folder (ModelCheckpoint's ``save_top_k``)."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(_zerocc_folder(filepath), ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        """The ``.ckpt``'s dict, and the step's weights and optimizer state from its zerocc
        folder (a ``.ckpt`` saved otherwise has none: refused, naming the folder)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.zerocc_step is not None:
            folder = _zerocc_folder(checkpoint_path)
            if not folder.is_dir():
                raise CheckpointError(
                    f"ckpt_path={checkpoint_path}: no {folder.name}/ beside it (saved without "
                    "ZeroccStrategy); resume from a .ckpt a ZeroccStrategy run saved, or load "
                    "its weights with load_from_checkpoint and start a new fit"
                )
            self.zerocc_step.load(folder)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing once compiled: the weights came with the step's checkpoint."""
        if self.zerocc_step is None:
            super().load_model_state_dict(checkpoint, strict)


def _weights_to_meta(module: pl.LightningModule, device: torch.device) -> None:
    """The module's ``device`` stays the rank's while its weights sit on meta: Lightning makes
    what ``self.log`` logs (and its running means) on ``module.device``."""
    torch.nn.Module.to(module, device="meta")  # (torch's, which leaves module.device be)
    module._device = device


def _zerocc_folder(filepath: Any) -> Path:
    return Path(str(filepath) + CHECKPOINT_SUFFIX)


def _refuse_unsupported(module: pl.LightningModule, optimizers: list) -> None:
    """What the step cannot honour, refused by name before anything is compiled."""
    if not module.automatic_optimization:
        raise NotSupportedError(
            "automatic_optimization=False (manual optimization): the step's update is compiled "
            "with its forward and backward; ZeroccStrategy needs training_step to return the "
            "loss, with automatic optimization"
        )
    if len(optimizers) != 1:
        raise NotSupportedError(
            f"configure_optimizers returned {len(optimizers)} optimizers; a zerocc step has "
            "one optimizer over every trainable parameter"
        )
    for hook in GRADIENT_HOOKS:
        if is_overridden(hook, module):
            raise NotSupportedError(
                f"{type(module).__name__}.{hook} is overridden; the gradients and the update "
                "live inside the compiled step, where Lightning's gradient hooks do not run: "
                "set clipping by the Trainer's gradient_clip_val (or the plan), and drop the "
                "override"
            )
