"""Tensor parallelism (Megatron-style): the layers a plan splits over the ``tp`` ranks, how each
parameter is split, and the step those layers run.

A ``colwise`` Linear holds a slice of its output features: its input enters the tensor-parallel
region unchanged and its input gradient is all-reduced in backward. A ``rowwise`` Linear holds
a slice of its input features (the output of a colwise layer, already split): its partial
outputs are all-reduced in forward, then its bias added once. A ``vocab`` Embedding holds a
slice of the vocabulary: each rank looks up the tokens it holds, zeros the others, and the
lookups are all-reduced; a ``vocab`` output head (a Linear over the vocabulary) computes its
slice of the logits, and its cross-entropy runs on the slices (:mod:`.capture_mode`). The
pairs (q/k/v and the MLP's up-projection colwise, the attention's and MLP's output
projections rowwise) need one all-reduce each way per block.

The split is applied where the step is captured: for the capture only, each named layer's
forward is its tensor-parallel form, and the captured graph computes with each rank's slice of
the weights and holds the collectives (on the ``tp`` group) as zerocc's start/wait ops; the rest
of the model (views that split heads, attention, norms, the loss) traces as written, with the
shapes the slices give. Rewriting an already captured graph instead would mean re-deriving the
shape of every op downstream of a split output (the head views above all), a sharding rule per
op; re-tracing gets them right for any model whose code derives head counts from its inputs'
shapes (``view(B, T, -1, head_dim)``, as Hugging Face's Llama does). The forwards and the
collectives they issue are :mod:`.capture_mode`'s; sequence parallelism, :mod:`.sequence`.

Every other parameter is replicated over the ``tp`` ranks, and its gradient is the same on each
(every tp rank computes it from the same activations; under sequence parallelism, summed over
them where it was computed from a rank's tokens), so ZeRO shards each rank's parameters over
the ``dp`` group of ranks holding the same slice, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.names import GLOB_RULE, glob_matches
from zerocc.compiler.parallel.capture_mode import FORWARDS, CaptureMode, Region
from zerocc.compiler.parallel.collectives import NOTE
from zerocc.compiler.parallel.sequence import SequenceSplit
from zerocc.compiler.plan import Plan, TpLayer
from zerocc.compiler.units import Unit
from zerocc.errors import PlanError
from zerocc.ir.kinds import OpKind, Stream
from zerocc.ir.nodes import op_kind, op_name, tag, val
from zerocc.ir.ops import TP_GROUP

TP = TP_GROUP
# The model config attributes that count attention heads: a colwise split must keep heads whole.
HEAD_COUNTS = ("n_head", "num_attention_heads", "num_key_value_heads", "num_heads")


@dataclass(frozen=True)
class Split:
    """How one parameter is split over ``parts`` ranks (the mesh's ``group``: ``tp``, or
    ``ep`` for experts): along ``dim``, in ``blocks`` equal blocks side by side (a fused q/k/v
    weight: 3), each block split alike."""

    dim: int
    parts: int
    blocks: int = 1
    group: str = TP

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        local = list(shape)
        local[self.dim] //= self.parts
        return tuple(local)

    def whole_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        """The shape of the whole value whose slice has shape ``local``."""
        whole = list(local)
        whole[self.dim] *= self.parts
        return tuple(whole)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the full value (a copy, contiguous)."""
        blocks = full.unflatten(self.dim, (self.blocks, self.parts, -1))
        return blocks.select(self.dim + 1, rank).flatten(self.dim, self.dim + 1).contiguous()

    def row(self, local: Sequence[int]) -> int:
        """Elements of one row of a rank's slice (of shape ``local``): its flattened elements
        are rows of this many, each contiguous in the whole tensor too, and consecutive rows
        lie ``parts`` rows apart there (the other ranks' rows between them)."""
        return local[self.dim] // self.blocks * math.prod(local[self.dim + 1 :])

    def to_whole(self, index, rank: int, row: int):
        """Where elements ``index`` (an int, or a tensor of them) of rank ``rank``'s
        flattened slice lie in the whole tensor's flattened elements (``row``: :meth:`row`)."""
        return (index // row * self.parts + rank) * row + index % row

    def runs(self, start: int, stop: int, rank: int, row: int) -> list[tuple[int, int, int, int]]:
        """Elements ``[start, stop)`` of rank ``rank``'s flattened slice as runs of the whole
        tensor, ``parts × row`` apart: (first element in the slice, first in the whole
        tensor, run length, runs) for a partial first row, the whole rows, a partial last."""
        whole_from = min(stop, -(-start // row) * row)  # the first whole row
        whole_to = max(whole_from, stop // row * row)  # the end of the last whole row
        out = []
        for lo, hi, whole in ((start, whole_from, False), (whole_from, whole_to, True),
                              (whole_to, stop, False)):  # fmt: skip
            if lo < hi:
                length, count = (row, (hi - lo) // row) if whole else (hi - lo, 1)
                out.append((lo, self.to_whole(lo, rank, row), length, count))
        return out

    def join(self, slices: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full value from every rank's slice, in rank order."""
        blocks = [s.unflatten(self.dim, (self.blocks, -1)) for s in slices]
        return torch.stack(blocks, self.dim + 1).flatten(self.dim, self.dim + 2)


def local_info(info: ModelInfo, splits: dict[str, Split]) -> ModelInfo:
    """``info`` with the shape of each parameter ``splits`` names that of one rank's slice
    (tensor parallelism's layers, expert parallelism's experts)."""
    params = tuple(
        dataclasses.replace(p, shape=splits[p.fqn].local_shape(p.shape)) if p.fqn in splits else p
        for p in info.params
    )
    return dataclasses.replace(info, params=params)


@dataclass(frozen=True)
class SplitLayer:
    """One module the plan splits: its FQN, style and (colwise) fused blocks."""

    fqn: str
    style: str
    fused: int = 1

    def splits(self, module: nn.Module, parts: int) -> dict[str, Split]:
        """The split of each of the module's own parameters (by local name)."""
        if isinstance(module, nn.Embedding):
            return {"weight": Split(0, parts)}
        if self.style == "rowwise":
            return {"weight": Split(1, parts)}
        splits = {"weight": Split(0, parts, self.fused)}  # colwise, or a vocab-parallel head
        return splits | ({"bias": Split(0, parts, self.fused)} if module.bias is not None else {})


class TensorParallel:
    """The plan's tensor-parallel layers, resolved against one model (:meth:`of`)."""

    def __init__(
        self,
        parts: int,
        layers: dict[str, SplitLayer],
        splits: dict[str, Split],
        sequence_dim: int | None = None,
    ) -> None:
        self.parts = parts
        self.layers = layers  # module FQN -> layer
        self.splits = splits  # parameter FQN (every alias) -> split
        self.sequence_dim = sequence_dim  # sequence parallelism's (from the end), or None
        self._capturing: Region | None = None  # the split layers of the capture in progress

    @staticmethod
    def of(model: nn.Module, info: ModelInfo, plan: Plan) -> TensorParallel | None:
        """The layers ``plan.parallel`` splits in ``model``, checked (None without tensor
        parallelism). PlanError for a glob that matches nothing, a module of another kind, a
        shape ``tp`` does not divide, attention heads it would split, and a tied parameter
        split in one of its modules but not in another."""
        parallel = plan.parallel
        if parallel.tp == 1:
            return None
        modules = dict(model.named_modules())
        layers: dict[str, SplitLayer] = {}
        for glob, layer in parallel.layers().items():
            matched = [fqn for fqn in modules if fqn and glob_matches(fqn, glob)]
            if not matched:
                raise PlanError(_matches_nothing(glob, modules))
            for fqn in matched:
                layers[fqn] = _checked(fqn, modules[fqn], layer, parallel.tp)
        _check_heads(model, parallel.tp)
        splits: dict[str, Split] = {}
        for fqn, layer in layers.items():
            for name, split in layer.splits(modules[fqn], parallel.tp).items():
                splits[f"{fqn}.{name}" if fqn else name] = split
        _check_ties(info, splits)
        sequence = parallel.sequence_dim if parallel.sequence_parallel else None
        return TensorParallel(parallel.tp, layers, splits, sequence)

    def describe(self) -> str:
        """What the capture split, for its pass record: ``6 layers split over tp 2 (…)``."""
        styles = Counter(layer.style for layer in self.layers.values())
        counts = ", ".join(f"{n} {style}" for style, n in styles.items())
        return f"{len(self.layers)} layers split over tp {self.parts} ({counts})"

    def local_info(self, info: ModelInfo) -> ModelInfo:
        """``info`` with each split parameter's shape that of one rank's slice."""
        return local_info(info, self.splits)

    def whole_info(self, info: ModelInfo) -> ModelInfo:
        """``info`` (:meth:`local_info`'s) with each split parameter's whole shape again."""
        params = tuple(
            dataclasses.replace(p, shape=self.splits[p.fqn].whole_shape(p.shape))
            if p.fqn in self.splits
            else p
            for p in info.params
        )
        return dataclasses.replace(info, params=params)

    def shared_ranges(self, unit: Unit) -> list[int]:
        """(offset, numel) pairs of ``unit``'s flat buffer that every tp rank holds alike (the
        parameters no layer splits), flattened as the ``sum_squares_tp`` op reads them."""
        return [x for p in unit.params if p.fqn not in self.splits for x in (p.offset, p.numel)]

    def tensor_status(self) -> SequenceSplit | None:
        """In :meth:`applied`'s body, what capture gives a repeated layer's template and copies
        of what sequence parallelism knows of each tensor (None without it)."""
        region = self._capturing
        return region.sequence if region is not None else None

    def check_loss(self, loss: torch.Tensor) -> None:
        """Called by capture with the loss it traced in :meth:`applied`'s body: under sequence
        parallelism, a CaptureError for a loss that holds a statistic of one rank's chunk of
        the sequence (:meth:`SequenceSplit.check_loss`)."""
        region = self._capturing
        if region is not None and region.sequence is not None:
            region.sequence.check_loss(loss)

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """Every split layer of ``model`` runs its tensor-parallel forward in the body (the
        capture), as written after."""
        sequence = SequenceSplit(self.sequence_dim, self.parts) if self.sequence_dim else None
        region = self._capturing = Region(self.parts, sequence)
        modules = dict(model.named_modules())
        for fqn, layer in self.layers.items():
            module = modules[fqn]
            forward = FORWARDS[(_kind(module), layer.style)]
            module.forward = _SplitForward(module, forward, region, f"{layer.style} {fqn}")
        hooks = []
        if sequence is not None:  # the sequence is gathered where the colwise layers' module
            # begins (attention and MLP modules read its length)
            parents = {f.rpartition(".")[0] for f, x in self.layers.items() if x.style == "colwise"}
            hooks = [
                modules[p].register_forward_pre_hook(region.gather_inputs(p), with_kwargs=True)
                for p in sorted(parents)
            ]
        heads = any(
            isinstance(modules[fqn], nn.Linear) and layer.style == "vocab"
            for fqn, layer in self.layers.items()
        )
        try:
            with CaptureMode(region) if heads or sequence else contextlib.nullcontext():
                yield
        finally:
            self._capturing = None
            for fqn in self.layers:
                del modules[fqn].forward
            for hook in hooks:
                hook.remove()


class _SplitForward:
    """A split layer's forward while the step is captured: ``forward(module, x, region,
    layer)``. Alike for every layer of one kind and style, its name in the notes apart: a
    repeated block's copies may stand for its calls (:meth:`repeat_key`,
    :class:`zerocc.compiler.twins.RepeatKeyed`)."""

    def __init__(
        self, module: nn.Module, forward: Callable[..., torch.Tensor], region: Region, layer: str
    ) -> None:
        self.module, self.forward, self.region, self.layer = module, forward, region, layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(self.module, x, self.region, self.layer)

    def repeat_key(self) -> Callable[..., torch.Tensor]:
        return self.forward


# -- checks --------------------------------------------------------------------------------------


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    return "embedding" if isinstance(module, nn.Embedding) else type(module).__name__


def _checked(fqn: str, module: nn.Module, layer: TpLayer, parts: int) -> SplitLayer:
    """The layer ``fqn`` as the plan splits it; PlanError when it cannot be split so."""
    kind, style = _kind(module), layer.style
    where = f"parallel.tp_layers: {fqn} ({type(module).__name__})"
    if (kind, style) not in FORWARDS:
        allowed = "colwise, rowwise or vocab for a Linear; vocab for an Embedding"
        raise PlanError(f"{where}: cannot be split {style}; allowed: {allowed}")
    base = nn.Linear if kind == "linear" else nn.Embedding
    if type(module).forward is not base.forward:
        raise PlanError(
            f"{where}: its class overrides {base.__name__}.forward, and a tensor-parallel "
            f"style replaces {base.__name__}'s own; split the layers inside it instead"
        )
    if kind == "embedding" and (module.max_norm is not None or module.sparse):
        raise PlanError(f"{where}: max_norm and sparse embeddings cannot be split")
    if kind == "embedding":
        size, what = module.num_embeddings, "vocabulary (num_embeddings)"
    elif style == "rowwise":
        size, what = module.in_features, "input features"
    else:
        size, what = module.out_features, "output features"
    if size % (parts * layer.fused):
        blocks = f" in {layer.fused} fused blocks" if layer.fused > 1 else ""
        raise PlanError(
            f"{where}: {size} {what}{blocks} cannot be split over tp {parts} ranks; allowed: "
            f"a tp dividing {size // layer.fused}, or another style for this layer"
        )
    return SplitLayer(fqn, style, layer.fused)


def _check_heads(model: nn.Module, parts: int) -> None:
    """Attention heads stay whole: every head count the model's config gives is a multiple of
    ``parts``."""
    config = getattr(model, "config", None)
    for name in HEAD_COUNTS:
        count = getattr(config, name, None)
        if isinstance(count, int) and count % parts:
            raise PlanError(
                f"parallel.tp: {parts} does not divide the model's {name} ({count}): every "
                f"tp rank must hold whole attention heads; allowed: a divisor of {count}"
            )


def _check_ties(info: ModelInfo, splits: dict[str, Split]) -> None:
    """A tied parameter is split alike in every module that holds it (an embedding and the
    output head sharing one weight: both vocab)."""
    for p in info.params:
        held = {alias: splits.get(alias) for alias in p.aliases}
        if len(set(held.values())) > 1:
            plain = [a.rpartition(".")[0] for a, s in held.items() if s is None]
            raise PlanError(
                f"parallel.tp_layers: {p.fqn} is tied ({', '.join(p.aliases)}) and split "
                f"differently in its modules ({', '.join(plain) or 'another style'} "
                "unlike the others); name every module that holds it, with matching styles"
            )


def _matches_nothing(glob: str, modules: dict[str, nn.Module]) -> str:
    linear = [f for f, m in modules.items() if isinstance(m, nn.Linear | nn.Embedding)]
    shown = ", ".join(linear[:6]) + (f", … ({len(linear)} in all)" if len(linear) > 6 else "")
    return (
        f"parallel.tp_layers: {glob!r} matches no module of the model ({GLOB_RULE}); its "
        f"Linear and Embedding modules are: {shown or 'none'}"
    )


# -- the captured graph --------------------------------------------------------------------------


def tag_collectives(gm: fx.GraphModule) -> None:
    """Give the tp collectives capture recorded what the passes and the cost model read of a
    collective: the comm stream, the bytes it moves and why it is there (the note its
    forward gave it)."""
    for node in gm.graph.nodes:
        if op_kind(node) is not OpKind.COLLECTIVE or node.args[-1] != TP:
            continue
        # Logical bytes, as the comm counts them: a gather's output, a reduce-scatter's input,
        # an all-reduce's size twice.
        kind = op_name(node.target).removeprefix("zerocc.")
        moved = val(node.args[0]) if kind == "reduce_scatter_start" else val(node)
        nbytes = moved.numel() * moved.element_size() * (2 if kind == "all_reduce_start" else 1)
        note = node.meta.get("custom", {}).get(NOTE, "a collective of tensor parallelism (tp)")
        tag(node, stream=Stream.COMM, bytes=nbytes, note=note)
        for user in node.users:
            if op_name(user.target) == "zerocc.wait":
                tag(user, stream=Stream.COMM)
