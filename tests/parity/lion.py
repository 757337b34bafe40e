"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2) as a
torch.optim optimizer: the reference of zerocc's Lion, which torch.optim has not."""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """The paper's update, per parameter: the sign of beta1's interpolation of the momentum and
    the gradient, decoupled weight decay, then the momentum's update with beta2."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in (p for p in group["params"] if p.grad is not None):
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(torch.sign(beta1 * m + (1 - beta1) * p.grad), alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
