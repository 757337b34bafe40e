"""Keyed draws: every random op of a step draws from a generator seeded by where it is.

By default a program's random ops (dropout) draw from the device's generator in program order,
as eager PyTorch does: what a draw gets depends on every draw before it on that rank. Cut the
step into pipeline stages, or the batch over more ranks, and the draws move: no run on another
layout, and no one-process reference, draws the same masks. Under ``capture.draws: keyed``
each random op is preceded by ``zerocc.seed_draw(index, device)``, which seeds its device's
generator from a :class:`DrawKey` and the op's ``index`` (its place among the captured step's
random ops, in forward order). The key is the plan's seed, the step (0-based, skipped steps
included) and the micro-batch's place in the step's global batch (``data_rank * M + m`` for
``M`` micro-batches per rank and step: gradient accumulation's or a pipeline's). So a draw
depends on what it is for, not on when a rank runs it:

- a pipeline's stages draw what one process draws for the same micro-batch;
- a recomputed op replays its forward's draw (recompute's saved state is taken after the seed);
- a resumed run draws what the uninterrupted one would have (the key is in the checkpoint's
  step counter), on any number of ranks whose micro-batches are the same rows;
- the ranks of a tensor-parallel group hold one key, so a tensor they all hold gets one mask.

The runtime sets the key around each program run (:func:`drawing_under`), saving the device
generator's state before and setting it back after: the user's own draws between steps are
what they would have been without zerocc. :func:`keyed_draws` makes an eager model draw the
same way, for a reference to compare a run with. A region kept opaque (a module whose shapes
depend on the data) is seeded as one draw: what it draws inside follows that seed, and an
eager reference draws differently there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.library import Library
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerocc.ir.nodes import emit, info
from zerocc.ir.ops import fake, implements
from zerocc.ir.rng import call_argument, draws

_lib = Library("zerocc", "FRAGMENT")
_lib.define("seed_draw(int index, Device device) -> ()")

_MASK = 2**64 - 1
_OPAQUE_FORWARD = "zerocc_opaque::region_forward"


@dataclass(frozen=True)
class DrawKey:
    """Where a micro-batch's draws come from: the plan's seed, the 0-based step, and the
    micro-batch's place in the step's global batch."""

    seed: int
    step: int
    microbatch: int

    def seed_of(self, index: int) -> int:
        """The seed of the ``index``-th random op (0 to 2^63 - 1, what generators take):
        splitmix64 over the key's fields and the index, so that neighbouring keys and
        indices give unrelated streams."""
        x = 0
        for part in (self.seed, self.step, self.microbatch, index):
            x = ((x ^ (part & _MASK)) + 0x9E3779B97F4A7C15) & _MASK
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
            x ^= x >> 31
        return x >> 1


_current: DrawKey | None = None


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (what a random op without one draws from)."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


@contextlib.contextmanager
def drawing_under(key: DrawKey, device: torch.device) -> Iterator[None]:
    """Run the body's ``seed_draw`` ops under ``key``; ``device``'s generator (and the CPU's)
    is set back to its state before the body when it ends."""
    global _current
    devices = [device] if device.type != "cpu" else []
    outer, _current = _current, key
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            yield
    finally:
        _current = outer


@implements("seed_draw", _lib)
def _seed_draw(index: int, device: torch.device) -> None:
    if _current is None:
        raise RuntimeError(
            "zerocc.seed_draw ran with no draw key set: a program captured with "
            "capture.draws: keyed runs under a step runner, which sets the key of each "
            "micro-batch (zerocc.ir.keyed_draws.drawing_under)"
        )
    default_generator(device).manual_seed(_current.seed_of(index))


@fake("seed_draw")
def _(index, device):
    return None


SEED_DRAW = torch.ops.zerocc.seed_draw.default
torch.fx.node.has_side_effect(SEED_DRAW)


def default_draw(op: object, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``op`` draws from its device's default generator: a random op not
    given a generator of its own (whose draws the key cannot reach)."""
    return draws(op, args, kwargs) and call_argument(op, args, kwargs, "generator") is None


def is_opaque_forward(op: object) -> bool:
    """Whether ``op`` runs an opaque region's forward (which may draw inside: one draw here)."""
    return isinstance(op, torch._ops.OpOverload) and op.name() == _OPAQUE_FORWARD


def draws_from(node: fx.Node) -> torch.device | None:
    """The device whose generator ``node`` draws from (None: it draws nothing): a random op's
    or an opaque region's (which may draw inside), read from its result."""
    target = node.target
    if not (is_opaque_forward(target) or default_draw(target, node.args, node.kwargs)):
        return None
    # (an opaque region's last result is its generator state, a CPU tensor: its first is on
    # its device)
    tensors = [t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def key_draws(gm: fx.GraphModule) -> int:
    """Put a ``seed_draw`` before each random op (and opaque region) of captured step ``gm``,
    numbered in program order; returns how many."""
    index = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or (device := draws_from(node)) is None:
            continue
        with gm.graph.inserting_before(node):
            emit(
                gm.graph,
                SEED_DRAW,
                (index, device),
                phase=info(node).phase,
                module=info(node).module,
                note=f"{node.name} draws from the key's seed for draw {index}",
            )
        index += 1
    return index


class _Keyed(TorchDispatchMode):
    """Seeds each random op's generator as ``seed_draw`` would, counting them in the order
    they run."""

    def __init__(self, key: DrawKey) -> None:
        super().__init__()
        self.key, self.index = key, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if default_draw(func, args, kwargs):
            device = next(
                (t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                kwargs.get("device") or torch.device("cpu"),
            )
            default_generator(torch.device(device)).manual_seed(self.key.seed_of(self.index))
            self.index += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def keyed_draws(seed: int, step: int, microbatch: int) -> Iterator[Any]:
    """Eager code in the body draws as a program captured with ``capture.draws: keyed`` does
    for micro-batch ``microbatch`` of step ``step`` (both 0-based; see the module docs): the
    reference for a run with dropout. Run each micro-batch's forward under its own key; the
    generators are set back after the body."""
    key = DrawKey(seed, step, microbatch)
    with torch.random.fork_rng(), _Keyed(key) as mode:
        yield mode
