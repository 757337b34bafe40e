"""What a kernel set is: the interface every set of zerocc's kernels implements
(:mod:`zerocc.backends.kernels` has the sets and picks one; the :class:`RuntimeContext
<zerocc.engine.RuntimeContext>` an executable is bound to carries it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class AdamWHyper:
    """The scalars of one AdamW update of one shard, as ``torch.optim.AdamW`` names them, with
    the factor the gradient is scaled by first: every kernel set's ``adamw_`` takes them as
    one record (they were ten positional floats after the tensors, in five signatures)."""

    lr: float  # this step's rate (the schedule's, read from the program's lr input)
    beta1: float
    beta2: float
    eps: float
    weight_decay: float  # decoupled: the weights shrink by lr * weight_decay first
    grad_scale: float = 1.0  # the gradient is multiplied by it (1 / the loss scale, 1 / the
    # micro-batches' count) before the update reads it


class KernelSet(Protocol):
    """What a kernel set provides: the optimizer updates on one flat shard, the gradient checks
    and the bucket packing the programs call, and whether it runs on a device. The updates
    skip the step when ``found_inf`` is set (copying the shard into ``param_copy`` still),
    scale the gradient by ``grad_scale`` (AdamW's in its :class:`AdamWHyper`; and by
    ``grad_coef``, the clip), and write the updated
    shard's compute copy into ``param_copy`` when given; :mod:`.reference` says the arithmetic
    of each."""

    def runs_on(self, device_type: str) -> bool:
        """Whether this set's kernels run on ``device_type`` in this process."""
        ...

    def adamw_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: torch.Tensor,
        grad_coef: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        param_copy: torch.Tensor | None,
        hyper: AdamWHyper,
    ) -> None:
        """AdamW on one flat shard, as ``torch.optim.AdamW``."""
        ...

    def sgd_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        momentum_buffer: torch.Tensor | None,
        grad_coef: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        param_copy: torch.Tensor | None,
        grad_scale: float,
        lr: float,
        momentum: float,
        weight_decay: float,
    ) -> None:
        """SGD on one flat shard, as ``torch.optim.SGD`` (no dampening, no Nesterov)."""
        ...

    def unscale_check_(self, grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
        """Every gradient times ``inv_scale``, in place; a 0-dim flag, 1.0 if any was not
        finite."""
        ...

    def nonfinite_flags(
        self, grads: list[torch.Tensor], scale: float, sum_squares: bool
    ) -> torch.Tensor:
        """Per gradient, 1.0 if any element is not finite; with ``sum_squares``, one more entry:
        the sum of ``(g * scale)**2`` over every gradient."""
        ...

    def pack(
        self,
        tensors: list[torch.Tensor | None],
        numels: list[int],
        numel: int,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """One flat buffer of ``numel`` elements holding ``tensors`` in order (zeros where one
        is None, and in the padding), each ``numels[i]`` long, in ``dtype`` (else the
        tensors')."""
        ...
