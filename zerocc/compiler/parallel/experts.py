"""Expert parallelism: each experts module's experts split over the ``ep`` ranks, its tokens
sent to the ranks holding their experts and the results sent back.

An experts module (transformers' ``MixtralExperts``, ``Qwen2MoeExperts``,
``DeepseekV3Experts``, ...) holds every expert's weights stacked along dim 0 and is called as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])`` by its MoE block,
after the router. Under ``parallel.ep: E`` each of ``E`` consecutive data-parallel ranks holds
``num_experts / E`` of them (a :class:`~.tensor_parallel.Split` along dim 0 on the ``ep``
group), and every call runs as an opaque region (:mod:`zerocc.compiler.opaque`) whose body:

1. sorts the call's ``T × K`` (token, expert) pairs by expert, so that each rank's pairs are
   one run, and exchanges the count per expert (an all-to-all of ``num_experts`` integers);
2. sends each pair's hidden state to the rank holding its expert (an all-to-all whose sizes
   the counts give: they depend on the routing, which is why this is a region and not ops of
   the graph);
3. runs the module's own forward (its ``experts_implementation``) on what it received, with
   its local experts;
4. sends the results back (the reverse all-to-all), weights each by its router weight and sums
   each token's in expert order, as the module does on one rank.

A rank that receives no token for its experts still takes part in every exchange, in backward
too (its results are tied to what it received and to its experts' weights even then). The region's
backward runs the body again with autograd (the all-to-alls are differentiable: each one's
gradient is the reverse exchange), so a step makes 3 exchanges in forward and 5 in backward
per MoE layer. Tokens are never dropped: the modules' semantics (no capacity) are kept.

The experts' parameters are not sharded over ``dp``: every experts module is an FSDP unit of its
own, sharded over the ``edp`` ranks (those holding the same experts), which also reduce its
gradients (a rank's gradient already sums every ``ep`` rank's tokens routed to its experts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.opaque import Body, region_of
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.tensor_parallel import Split
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.parallelism import AUTO_EXPERTS
from zerocc.compiler.units import ExpertUnits
from zerocc.errors import PlanError
from zerocc.ir.nodes import val
from zerocc.ir.ops import EP_GROUP

EP = EP_GROUP
# What the experts modules' classes are called, for experts: auto.
EXPERTS_SUFFIX = "Experts"


class Exchange(Protocol):
    """What the body needs of the ranks' ``ep`` group (the runtime's comm on it)."""

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Any:
        """Send rows ``in_splits[i]`` of ``inp`` to rank ``i`` of the group and receive rank
        ``i``'s ``out_splits[i]`` rows into ``out``, in rank order; returns a work to wait."""


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module the plan splits: its FQN, class and number of experts."""

    fqn: str
    kind: str
    experts: int


class ExpertParallel:
    """The plan's experts modules, resolved against one model (:meth:`of`), and the ``ep``
    group their bodies exchange tokens over (:meth:`bind`, by the runtime)."""

    def __init__(
        self,
        parts: int,
        modules: dict[str, ExpertsModule],
        splits: dict[str, Split],
        fqn_of: dict[int, str],
    ) -> None:
        self.parts = parts
        self.modules = modules  # FQN -> module
        self.splits = splits  # parameter FQN (every alias) -> split along the experts
        self._fqn_of = fqn_of  # id of each experts module -> its FQN
        self.exchange: Exchange | None = None

    @staticmethod
    def holds_experts(model: nn.Module, plan: Plan) -> bool:
        """Whether ``model`` has a module ``plan.parallel.experts`` names (by class, or any
        ``*Experts`` class under ``auto``): what expert parallelism could split."""
        classes = set(plan.parallel.experts)
        auto = AUTO_EXPERTS in classes
        return any(
            type(m).__name__ in classes or (auto and type(m).__name__.endswith(EXPERTS_SUFFIX))
            for m in model.modules()
        )

    @staticmethod
    def of(model: nn.Module, info: ModelInfo, plan: Plan) -> ExpertParallel | None:
        """The experts modules ``plan.parallel`` splits in ``model``, checked (None without
        expert parallelism). PlanError for a model without experts modules, a class the plan
        names that the model lacks, and a number of experts ``ep`` does not divide."""
        parallel = plan.parallel
        if parallel.ep == 1:
            return None
        classes = set(parallel.experts) - {AUTO_EXPERTS}
        auto = AUTO_EXPERTS in parallel.experts
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(classes - present)
        if missing:
            raise PlanError(
                f"parallel.experts: no module of class {missing[0]!r} in the model; its "
                f"classes are: {', '.join(sorted(present))}"
            )
        modules: dict[str, ExpertsModule] = {}
        splits: dict[str, Split] = {}
        fqn_of: dict[int, str] = {}
        for fqn, module in model.named_modules():
            kind = type(module).__name__
            if kind not in classes and not (auto and kind.endswith(EXPERTS_SUFFIX)):
                continue
            modules[fqn] = _checked(fqn, module, parallel.ep)
            fqn_of[id(module)] = fqn
            for name, _ in module.named_parameters(remove_duplicate=False):
                splits[f"{fqn}.{name}" if fqn else name] = Split(0, parallel.ep, group=EP)
        if not modules:
            raise PlanError(
                f"parallel.ep: {parallel.ep} splits the experts of a mixture-of-experts model, "
                f"and this model has no experts module (parallel.experts: "
                f"{parallel.experts}: classes named *{EXPERTS_SUFFIX}, or the names given); "
                "set parallel.ep: 1 for a dense model, or name its experts classes"
            )
        return ExpertParallel(parallel.ep, modules, _with_aliases(info, splits), fqn_of)

    def describe(self) -> str:
        """What the capture split, for its pass record and explain()."""
        kinds = sorted({m.kind for m in self.modules.values()})
        experts = sorted({m.experts for m in self.modules.values()})
        per_rank = "/".join(str(e // self.parts) for e in experts)
        return (
            f"{len(self.modules)} experts modules ({', '.join(kinds)}) split over ep "
            f"{self.parts}: {per_rank} experts per rank, tokens exchanged by all-to-all"
        )

    def units(self, mesh: Mesh) -> ExpertUnits:
        """The experts modules as units of their own, sharded over the ``edp`` ranks."""
        return ExpertUnits(frozenset(self.modules), mesh.expert_shard_size)

    def bind(self, exchange: Exchange | None) -> None:
        """The runtime's ``ep`` group, which every call's body exchanges tokens over (None:
        unbound, after the step is closed)."""
        self.exchange = exchange

    def bodies(self) -> dict[str, Body]:
        """What each experts module runs as its opaque region (for capture)."""
        reason = f"expert parallelism: its tokens exchanged with the ep {self.parts} ranks"
        return {fqn: Body(reason, self._dispatched) for fqn in self.modules}

    def _dispatched(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The experts module's output for this rank's tokens, computed by the ranks holding
        their experts (see the module's doc); on fake tensors (capture) its shape alone."""
        if isinstance(hidden_states, FakeTensor) or hidden_states.device.type == "meta":
            return torch.zeros_like(hidden_states)
        if self.exchange is None:
            raise RuntimeError(
                "zerocc: an expert-parallel step ran without its ep group: it runs through "
                "zerocc.compile (a TrainStep), which binds it"
            )
        exchange, parts = self.exchange, self.parts
        experts = self.modules[self._fqn_of[id(module)]].experts
        local = experts // parts
        k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)  # each rank's pairs one run, experts ascending
        tokens = order // k
        counts = torch.bincount(ids, minlength=experts)
        received = torch.empty_like(counts)
        exchange.all_to_all(received, counts, [local] * parts, [local] * parts).wait()
        sent_rows = counts.view(parts, local).sum(1).tolist()
        got_rows = received.view(parts, local).sum(1).tolist()
        rows = _AllToAll.apply(hidden_states[tokens], exchange, got_rows, sent_rows)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=ids.device).repeat(parts), received
        )
        ones = rows.new_ones((rows.shape[0], 1), dtype=top_k_weights.dtype)
        held = module.num_experts
        module.num_experts = local  # (the module's own forward, over its local experts)
        try:
            done = type(module).forward(module, rows, expert_of_row[:, None], ones)
        finally:
            module.num_experts = held
        # Backward exchanges on every rank, also one whose experts received no token (whose
        # results would depend on neither the rows nor the weights): empty slices' sums, 0.
        for tensor in (rows, *module.parameters()):
            done = done + tensor[:0].sum()
        back = _AllToAll.apply(done, exchange, sent_rows, got_rows)
        weighted = (back * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, tokens, weighted)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over the ``ep`` group; the gradient goes back the reverse way."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, exchange: Exchange, got: list[int], sent: list[int]
    ) -> torch.Tensor:
        ctx.exchange, ctx.got, ctx.sent = exchange, got, sent
        return _exchanged(rows, exchange, got, sent)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchanged(grad, ctx.exchange, ctx.sent, ctx.got), None, None, None


def _exchanged(
    rows: torch.Tensor, exchange: Exchange, got: Sequence[int], sent: Sequence[int]
) -> torch.Tensor:
    out = rows.new_empty((sum(got), *rows.shape[1:]))
    exchange.all_to_all(out, rows.contiguous(), list(got), list(sent)).wait()
    return out


def _checked(fqn: str, module: nn.Module, parts: int) -> ExpertsModule:
    """The experts module ``fqn``; PlanError when its experts cannot be split over ``parts``
    ranks."""
    kind = type(module).__name__
    where = f"parallel.experts: {fqn} ({kind})"
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int):
        raise PlanError(
            f"{where}: has no num_experts; an experts module holds its experts' weights stacked "
            "along dim 0 and says how many in num_experts (as transformers' do)"
        )
    own = list(module.named_parameters(recurse=False))
    wrong = [name for name, p in own if p.dim() == 0 or p.shape[0] != experts]
    if not own or wrong or len(own) != len(list(module.parameters())):
        raise PlanError(
            f"{where}: every parameter must be its own, stacked by expert along dim 0 "
            f"({experts} experts){'; ' + ', '.join(wrong) + ' are not' if wrong else ''}"
        )
    if experts % parts:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise PlanError(
            f"parallel.ep: {parts} does not divide {fqn}'s {experts} experts; allowed: "
            f"{', '.join(map(str, divisors))}"
        )
    return ExpertsModule(fqn, kind, experts)


def _with_aliases(info: ModelInfo, splits: dict[str, Split]) -> dict[str, Split]:
    """``splits`` under every alias of each parameter (a tied one is held under several)."""
    out = dict(splits)
    for p in info.params:
        found = next((splits[a] for a in p.aliases if a in splits), None)
        if found is not None:
            out.update(dict.fromkeys((p.fqn, *p.aliases), found))
    return out


# Row exchanges per call of an experts module in a training step: forward's 2 (tokens out,
# results back), backward's recompute of them, and their gradients' 2 the reverse way.
FORWARD_EXCHANGES, BACKWARD_EXCHANGES = 2, 4
EXCHANGES_PER_CALL = FORWARD_EXCHANGES + BACKWARD_EXCHANGES


@dataclass(frozen=True)
class Exchanges:
    """The all-to-alls one node of a program makes for an experts module: ``count`` of them,
    each of ``nbytes`` (the call's ``tokens × top-k`` rows, every rank's share of which the
    routing decides: taken as uniform), over the ``parts`` ranks of ``ep``."""

    count: int
    nbytes: int
    parts: int

    @property
    def sent(self) -> float:
        """Bytes this rank sends in all: ``(ep - 1) / ep`` of each exchange's rows."""
        return self.count * self.nbytes * (self.parts - 1) / self.parts


def exchanges_of(node: fx.Node) -> Exchanges | None:
    """What ``node`` exchanges if it runs an experts module's region split by expert
    parallelism (its forward: 2 exchanges, its backward: 4); None for any other node."""
    found = region_of(node)
    ep = getattr(found[0].body, "__self__", None) if found is not None else None
    if not isinstance(ep, ExpertParallel):
        return None
    forward = found[1]
    tensors = node.args[1] if forward else node.args[2]  # (backward: key, wanted, tensors, …)
    hidden, index = (val(t) for t in tensors[:2])
    rows = hidden.shape[0] * index.shape[-1]
    count = FORWARD_EXCHANGES if forward else BACKWARD_EXCHANGES
    return Exchanges(count, rows * hidden.shape[-1] * hidden.element_size(), ep.parts)


def experts_flops(node: fx.Node) -> tuple[float, torch.dtype] | None:
    """FLOPs of ``node``, and their dtype (the hidden states'), if it runs an experts module's
    region (split by expert parallelism or kept opaque for its routing), else None: every
    stacked expert weight ``[experts, a, b]`` applied to each of the call's ``tokens × top-k``
    rows (``2·a·b`` FLOPs a row; which expert a row meets does not change its count), in
    forward; 3 times that in backward (the forward recomputed, then the gradients of its
    inputs and of the weights)."""
    found = region_of(node)
    if found is None or not type(found[0].module).__name__.endswith(EXPERTS_SUFFIX):
        return None
    region, forward = found
    tensors = node.args[1] if forward else node.args[2]  # (backward: key, wanted, tensors, …)
    if len(tensors) < 2:
        return None
    hidden, index = val(tensors[0]), val(tensors[1])
    if index.dim() != 2 or index.dtype.is_floating_point:  # (not called as (hidden, top_k, …))
        return None
    per_row = sum(2 * p.shape[1] * p.shape[2] for p in region.module.parameters() if p.dim() == 3)
    rows = hidden.shape[0] * index.shape[-1]
    return float(rows * per_row * (1 if forward else 3)), hidden.dtype


def exchange_lines(programs: Iterable[fx.GraphModule]) -> list[str]:
    """A line on the experts' all-to-alls the programs make (none without expert parallelism):
    bytes a rank sends per step, with the routing taken as uniform (``(ep - 1) / ep`` of each
    call's ``tokens × top-k`` rows leave the rank), since the real sizes depend on the data."""
    sent, calls, parts = 0.0, 0, 0
    for gm in programs:
        for node in gm.graph.nodes:
            exchanges = exchanges_of(node)
            if exchanges is not None:
                sent += exchanges.sent
                calls += node.target is torch.ops.zerocc_opaque.region_forward.default
                parts = exchanges.parts
    if not calls:
        return []
    return [
        f"all-to-all (ep {parts}): ~{sent / 2**20:,.2f} MiB sent per rank per step, routing "
        f"taken as uniform ({calls} call{'s' * (calls != 1)} of experts, "
        f"{EXCHANGES_PER_CALL} row exchanges each: "
        "tokens out and results back in forward, again in backward's recompute, and their "
        "gradients); each call runs them inside its opaque region, on the compute stream: "
        "the predicted step waits for them"
    ]
