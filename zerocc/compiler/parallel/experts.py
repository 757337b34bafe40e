"""Expert parallelism: each experts module's experts split over the ``ep`` ranks, its tokens
sent to the ranks holding their experts and the results sent back.

An experts module (transformers' ``MixtralExperts``, ``Qwen2MoeExperts``,
``DeepseekV3Experts``, ...) holds every expert's weights stacked along dim 0 and is called as
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])`` by its MoE block,
after the router. Under ``parallel.ep: E`` each of ``E`` consecutive data-parallel ranks holds
``num_experts / E`` of them (a :class:`~.tensor_parallel.Split` along dim 0 on the ``ep``
group), and every call is traced as ops of the program:

1. the call's ``T × K`` (token, expert) pairs sorted by expert, so that each rank's pairs are
   one run, and their count per expert exchanged (``all_to_all_start``: ``num_experts``
   integers);
2. each pair's hidden state sent to the rank holding its expert (``all_to_all_experts_start``);
3. the module's own forward (its ``experts_implementation``) run there on what arrived, with
   its local experts (``experts_forward``);
4. the results sent back (``all_to_all_tokens_start``), each weighted by its router weight, and
   each token's summed in expert order, as the module does on one rank.

How many rows a rank receives depends on the routing, and a program's shapes are fixed when
it is traced: the rows received (and the experts' results) are no values of the program but
payloads the runtime keeps (:mod:`zerocc.engine.payloads`), which the ops name by key and
order by a one-element ticket. Every other value is shaped as usual: the rows sent and the rows
that come back are a call's ``T × K``. So the exchanges are collectives like the others:
printed, counted, costed on the communication stream, and waited on where their result is
first read (the overlap pass moves each wait down: the results' return runs beside what
follows that does not read it, a shared expert).

In backward the results' gradients go to the experts' ranks, the experts' backward runs there
(``experts_backward``: their forward again with autograd, on the rows kept since forward, so
nothing inside them is kept) and the rows' gradients come back: 4 row exchanges per call and
step. A rank that receives no token for its experts still takes part in every exchange, and
its experts' gradients are zeros. Tokens are never dropped: the modules' semantics (no
capacity) are kept.

The experts' parameters are not sharded over ``dp``: every experts module is an FSDP unit of its
own, sharded over the ``edp`` ranks (those holding the same experts), which also reduce its
gradients (a rank's gradient already sums every ``ep`` rank's tokens routed to its experts).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from zerocc.compiler.capture import ModelInfo
from zerocc.compiler.opaque import region_of
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.sequence import gradient_summed
from zerocc.compiler.parallel.tensor_parallel import Split
from zerocc.compiler.plan import Plan
from zerocc.compiler.plan.parallelism import AUTO_EXPERTS
from zerocc.compiler.units import ExpertUnits
from zerocc.errors import PlanError
from zerocc.ir import expert_calls
from zerocc.ir.expert_calls import results_grad_key, results_key, rows_grad_key, rows_key
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import info, op_name, tag, val
from zerocc.ir.ops import EP_GROUP, TO_EXPERTS, TO_TOKENS
from zerocc.ir.ops import op as zerocc_op

EP = EP_GROUP
# What the experts modules' classes are called, for experts: auto.
EXPERTS_SUFFIX = "Experts"


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
        sequence_parallel: bool = False,
    ) -> None:
        self.parts = parts
        self.modules = modules  # FQN -> module
        self.splits = splits  # parameter FQN (every alias) -> split along the experts
        self._fqn_of = fqn_of  # id of each experts module -> its FQN
        # Each tp rank's chunk of the tokens exchanged: the experts' gradients summed over tp
        self.sequence_parallel = sequence_parallel

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
        return ExpertParallel(
            parallel.ep, modules, _with_aliases(info, splits), fqn_of, parallel.sequence_parallel
        )

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

    def forwards(self, training: bool) -> dict[str, Callable[..., torch.Tensor]]:
        """What each experts module runs in place of its forward while the step is traced
        (for capture): its tokens exchanged by the program's own all-to-alls. ``training``:
        the step has a backward, for which each call keeps the rows it received."""
        exchanged = functools.partial(self._exchanged, training=training)
        return dict.fromkeys(self.modules, exchanged)

    def _exchanged(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *,
        training: bool,
    ) -> torch.Tensor:
        """The experts module's output for this rank's tokens, computed by the ranks holding
        their experts (see the module's doc), traced as ops of the program."""
        fqn = self._fqn_of[id(module)]
        experts = self.modules[fqn].experts
        call = f"{fqn}#{next(_calls)}"
        names, state = zip(*module.named_parameters(), strict=True)  # (checked: it has some)
        forward = functools.partial(_on_local_experts, names=names, parts=self.parts)
        expert_calls.register(call, module, forward)
        k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)  # each rank's pairs one run, experts ascending
        tokens = order // k
        sent = torch.zeros(experts, dtype=torch.long, device=ids.device)
        sent = sent.index_add(0, ids, torch.ones_like(ids))
        got = zerocc_op("wait")(zerocc_op("all_to_all_start")(sent, EP))
        if self.sequence_parallel:  # (the ops inside _Exchanged are no operands of the capture)
            state = [gradient_summed(t) for t in state]
        rows = hidden_states[tokens]
        # Kept for the experts' backward where it runs (no backward: the rows are dropped once
        # the experts have run on them)
        keep = training and any(t.requires_grad for t in (rows, *state))
        back = _Exchanged.apply(call, keep, sent, got, rows, *state)
        weighted = (back * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, tokens, weighted)


_calls = itertools.count()


def _on_local_experts(
    module: nn.Module,
    rows: torch.Tensor,
    got: torch.Tensor,
    state: Sequence[torch.Tensor],
    *,
    names: Sequence[str],
    parts: int,
) -> torch.Tensor:
    """The experts module's own forward (its ``experts_implementation``) on the ``rows`` this
    rank received, with its local experts (``state``, in ``names``' order): ``got`` counts the
    rows from each rank for each of them, in that order, each row weighted 1."""
    local = module.num_experts // parts
    expert_of_row = torch.repeat_interleave(
        torch.arange(local, device=rows.device).repeat(parts), got
    )
    ones = rows.new_ones((rows.shape[0], 1))
    held = module.num_experts
    module.num_experts = local
    try:
        return torch.func.functional_call(
            module, dict(zip(names, state, strict=True)), (rows, expert_of_row[:, None], ones)
        )
    finally:
        module.num_experts = held


class _Exchanged(torch.autograd.Function):
    """An experts call's rows sent to the ranks holding their experts, computed there and sent
    back (3 ops of the program and their waits); in backward the results' gradients go the same
    way, the experts' backward runs where they are and the rows' gradients come back."""

    @staticmethod
    def forward(
        ctx: Any,
        call: str,
        keep: bool,
        sent: torch.Tensor,
        got: torch.Tensor,
        rows: torch.Tensor,
        *state: torch.Tensor,
    ) -> torch.Tensor:
        ctx.call, ctx.shape, ctx.dtype = call, list(rows.shape), rows.dtype
        ctx.save_for_backward(sent, got, *state)
        wait = zerocc_op("wait")
        ticket = wait(zerocc_op("all_to_all_experts_start")(rows, sent, got, rows_key(call), EP))
        done = zerocc_op("experts_forward")(ticket, got, list(state), keep, call)
        return wait(zerocc_op("all_to_all_tokens_start")(
            done, sent, got, ctx.shape, ctx.dtype, results_key(call), EP
        ))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sent, got, *state = ctx.saved_tensors
        call, wait = ctx.call, zerocc_op("wait")
        ticket = wait(zerocc_op("all_to_all_experts_start")(
            grad, sent, got, results_grad_key(call), EP
        ))  # fmt: skip
        wanted = ctx.needs_input_grad[4]  # (the same on every rank: one program)
        done, *state_grads = zerocc_op("experts_backward")(ticket, got, state, wanted, call)
        if not wanted:
            return None, None, None, None, None, *state_grads
        rows_grad = wait(zerocc_op("all_to_all_tokens_start")(
            done, sent, got, ctx.shape, ctx.dtype, rows_grad_key(call), EP
        ))  # fmt: skip
        return None, None, None, None, rows_grad, *state_grads


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


# The all-to-alls an expert-parallel step holds: each call's count of rows per expert, then its
# rows to the ranks of their experts and back (in forward its tokens and their results, in
# backward the results' gradients and the rows').
COUNTS = "zerocc.all_to_all_start"
EXPERTS_FORWARD, EXPERTS_BACKWARD = "zerocc.experts_forward", "zerocc.experts_backward"
_NOTES = {
    COUNTS: "expert parallelism: the count of this call's rows for each expert, exchanged",
    TO_EXPERTS: (
        "expert parallelism: rows to the ranks holding their experts (as many arrive as the "
        "routing sends; bytes counted as the rows sent)"
    ),
    TO_TOKENS: "expert parallelism: the experts' rows back to the ranks of their tokens",
}


def tag_exchanges(gm: fx.GraphModule) -> None:
    """Give the all-to-alls capture recorded what the passes and the cost model read of a
    collective: the comm stream, the bytes it moves (a call's rows, which the routing shares
    out between the ranks: the cost model takes it as uniform) and why it is there."""
    for node in gm.graph.nodes:
        name = op_name(node.target)
        if name not in _NOTES:
            continue
        moved = val(node.args[0]) if name == TO_EXPERTS else val(node)
        tag(node, stream=Stream.COMM, bytes=moved.numel() * moved.element_size(),
            note=_NOTES[name])  # fmt: skip
        for user in node.users:
            tag(user, stream=Stream.COMM)


def payloads(gm: fx.GraphModule) -> list[tuple[fx.Node | None, fx.Node | None, int]]:
    """What the runtime keeps for ``gm``'s experts calls (the rows an exchange received, the
    experts' results, and their gradients in backward): the node that puts each, the node that
    takes it and its bytes, a call's rows (the share of a uniform routing). None where another
    program puts or takes it: a pipeline stage's backward takes the rows its forward kept."""
    spans: list[tuple[fx.Node | None, fx.Node | None, int]] = []
    held: dict[str, tuple[fx.Node, int]] = {}

    def take(key: str, node: fx.Node, nbytes: int) -> None:
        made, size = held.pop(key, (None, nbytes))
        spans.append((made, node, size))

    for node in gm.graph.nodes:
        name = op_name(node.target)
        if name == TO_EXPERTS:
            held[node.args[3]] = (node, _nbytes(val(node.args[0])))
        elif name == EXPERTS_FORWARD:
            call, nbytes = node.args[4], _nbytes(_rows_of(node))
            if not node.args[3]:  # (not kept for a backward)
                take(rows_key(call), node, nbytes)
            held[results_key(call)] = (node, nbytes)
        elif name == EXPERTS_BACKWARD:
            call, nbytes = node.args[4], _nbytes(_rows_of(node))
            take(rows_key(call), node, nbytes)
            take(results_grad_key(call), node, nbytes)
            if node.args[3]:
                held[rows_grad_key(call)] = (node, nbytes)
        elif name == TO_TOKENS:
            take(node.args[5], node, _nbytes(val(node)))
    return spans + [(made, None, nbytes) for made, nbytes in held.values()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows_of(node: fx.Node) -> torch.Tensor:
    """The rows an experts node's exchange sent (its ticket's wait, that wait's start)."""
    start = node.args[0].args[0]
    return val(start.args[0])


def experts_flops(node: fx.Node) -> tuple[float, torch.dtype] | None:
    """FLOPs of ``node``, and their dtype (the rows'), if it runs an experts module: on the rows
    an exchange brought (expert parallelism: taken as a call's ``tokens × top-k``, the share
    of a uniform routing) or in a region kept opaque for its routing. Every stacked expert
    weight ``[experts, a, b]`` is applied to each row (``2·a·b`` FLOPs a row; which expert a
    row meets does not change its count), in forward; 3 times that in backward (the forward
    recomputed, then the gradients of its inputs and of the weights). None for other nodes."""
    name = op_name(node.target)
    if name in (EXPERTS_FORWARD, EXPERTS_BACKWARD):
        rows = _rows_of(node)
        weights = [val(t) for t in node.args[2]]
        times = 1 if name == EXPERTS_FORWARD else 3
        return _flops(rows.shape[0], weights) * times, rows.dtype
    found = region_of(node)
    if found is None or not found[0].kind.endswith(EXPERTS_SUFFIX):
        return None
    region, forward = found
    tensors = node.args[1] if forward else node.args[2]  # (backward: key, wanted, tensors, …)
    split = len(tensors) - len(region.state)  # (the call's tensors, then the module's state)
    call, state = tensors[:split], tensors[split:]
    if len(call) < 2:
        return None
    hidden, index = val(call[0]), val(call[1])
    if index.dim() != 2 or index.dtype.is_floating_point:  # (not called as (hidden, top_k, …))
        return None
    rows = hidden.shape[0] * index.shape[-1]
    weights = [val(t) for t in state]
    return _flops(rows, weights) * (1 if forward else 3), hidden.dtype


def _flops(rows: int, weights: Sequence[torch.Tensor]) -> float:
    return float(rows * sum(2 * w.shape[1] * w.shape[2] for w in weights if w.dim() == 3))


def exchange_lines(programs: Iterable[fx.GraphModule], parts: int) -> list[str]:
    """A line on the experts' all-to-alls the programs make (none without expert parallelism):
    bytes a rank sends per step, with the routing taken as uniform (``(ep - 1) / ep`` of each
    call's ``tokens × top-k`` rows leave the rank), since the real sizes depend on the data."""
    sent, calls = 0.0, 0
    for gm in programs:
        for node in gm.graph.nodes:
            name = op_name(node.target)
            if name in _NOTES:
                sent += info(node).bytes * (parts - 1) / parts
            calls += name == EXPERTS_FORWARD
    if not calls:
        return []
    return [
        f"all-to-all (ep {parts}): ~{sent / 2**20:,.2f} MiB sent per rank per step, routing "
        f"taken as uniform ({calls} call{'s' * (calls != 1)} of experts, each a count of rows "
        "per expert and 4 row exchanges: tokens out and results back in forward, the results' "
        "gradients out and the rows' back in backward); ops of the program on the "
        "communication stream, each waited on where its result is first read. The rows a call "
        "receives are kept from its forward to its backward (as an activation would be)"
    ]
