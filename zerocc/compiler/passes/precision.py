"""precision: mixed precision on the sharded program (compute, reduce and master dtypes; loss
scaling).

Capture traced the step as the recipe runs it (see :class:`zerocc.compiler.capture.Casts`): each
parameter is cast to the compute dtype where the model reads it, and autograd of that cast
hands back gradients cast up to fp32. The shard pass laid the program out in the model's dtype
(fp32). This pass moves the casts to where they cost least:

- **Parameters**: ``param`` (the replicated flat, or stage 3's shard) becomes the compute-dtype
  copy, so every all-gather moves half the bytes, and the per-parameter casts after the gather
  vanish. The weights the optimizer updates move to new ``master`` placeholders (fp32), and
  the update writes both (see the optimizer pass).
- **Gradients**: the up-casts of the gradients are dropped; the per-unit pack casts straight to
  the ``reduce`` dtype, the full accumulators are kept in it (stages 0-1), so reductions move
  ``reduce``-dtype bytes; reduced shards are added into accumulators of ``precision.grad``
  (stages 2-3) and the update computes in fp32. Without accumulation the update reads the
  reduced gradient itself (at world size 1, backward's), cast to the kept gradient dtype only
  where that changes a value: a narrower ``grad`` rounds, and under loss scaling the in-place
  unscale runs in the kept dtype. A gradient the kept dtype holds exactly (bf16 in fp32) is
  read as it is: the update's arithmetic is fp32 either way.
- **Loss scaling** (the program that steps): every reduced gradient is unscaled in place by
  1/scale while looking for inf/NaN (one fused op); the flag is all-reduced when gradients are
  sharded, so every rank skips the same steps; the program returns it after the loss, and the
  optimizer pass passes it to each update, which then writes nothing.
"""

from __future__ import annotations

import torch
from torch import fx

from zerocc.compiler.parallel.dims import Spread
from zerocc.compiler.passes.spec import PassContext, register_pass
from zerocc.compiler.plan import PrecisionConfig, ZeroConfig
from zerocc.compiler.state import Dtypes, declare_params
from zerocc.errors import InvariantError
from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import (
    FOUND_INF,
    GATHERED,
    GRAD,
    GRAD_SHARD,
    LOSS_SCALE,
    MASTER,
    PARAM_FULL,
    PARAM_SHARD,
    alias_closure,
    emit,
    emit_collective,
    info,
    is_alias_op,
    nodes_with_role,
    placeholders,
    state_placeholder,
    val,
)
from zerocc.ir.ops import op

aten = torch.ops.aten


# Ops whose result has their first argument's dtype (besides views and in-place ops).
_KEEPS_DTYPE = (
    aten.clone.default,
    op("reduce_scatter_start"),
    op("reduce_scatter_quantized_start"),
)


def _retype(node: fx.Node, dtype: torch.dtype) -> None:
    fake = val(node)
    with fake.fake_mode:
        node.meta["val"] = torch.empty(fake.shape, dtype=dtype, device=fake.device)


def _is_cast(node: fx.Node) -> bool:
    """A dtype cast on the same device, as capture traces ``x.to(dtype)`` and autograd traces
    its backward (``_to_copy(g, dtype=..., layout=strided, device=<g's device>)``)."""
    if node.op != "call_function" or node.target is not aten._to_copy.default:
        return False
    kwargs = node.kwargs
    return (
        "dtype" in kwargs
        and set(kwargs) <= {"dtype", "layout", "device"}
        and kwargs.get("layout", torch.strided) == torch.strided
        and kwargs.get("device", val(node.args[0]).device) == val(node.args[0]).device
    )


class _PrecisionRewriter:
    def __init__(
        self, gm: fx.GraphModule, ctx: PassContext, precision: PrecisionConfig, zero: ZeroConfig
    ) -> None:
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.precision = precision
        self.compute = precision.dtype("param")
        self.zero = zero
        # The dtype gradients are kept in for the update: reduce (stages 0-1) or grad (2-3).
        self.kept = Dtypes.of(ctx.units[0], precision).gradient(self.zero)

    def retype_state(self) -> None:
        """Give ``param``/``param_shard``/``grad`` placeholders their mixed-precision dtypes, and
        add the ``master`` weights the update reads (the program that steps)."""
        layout = self.ctx.layout  # as the pass declared it (`declare_params`)
        for node in placeholders(self.gm):
            spec = layout.get(info(node).key or "")
            if spec is not None and spec.dtype != val(node).dtype:
                _retype(node, spec.dtype)
        if self.ctx.boundary:
            like = val(next(iter(placeholders(self.gm))))
            for spec in layout:
                if spec.role == MASTER:
                    state_placeholder(self.graph, spec, like)

    def drop_param_casts(self) -> None:
        """The casts of parameter views to the compute dtype read a compute-dtype copy now."""
        # At world size 1 stage 3's shard is read directly (nothing is gathered).
        sources = [
            *placeholders(self.gm, PARAM_FULL),
            *placeholders(self.gm, PARAM_SHARD),
            *nodes_with_role(self.gm, GATHERED),
        ]
        for source in sources:
            for node in alias_closure(source):
                for user in list(node.users):
                    if _is_cast(user) and user.kwargs["dtype"] == self.compute:
                        user.replace_all_uses_with(node)
                        self.graph.erase_node(user)

    def reduce_in_reduce_dtype(self) -> None:
        """Gradients go into packs and accumulators in their compute dtype, not cast to fp32."""
        reduce = self.precision.dtype("reduce")
        accumulators = {n for g in placeholders(self.gm, GRAD) for n in alias_closure(g)}
        for node in list(self.graph.nodes):
            if node.target is op("pack"):
                tensors = [self._uncast(t) for t in node.args[0]]
                # A pack no collective reads (world size 1) holds the gradient the update reads.
                dtype = self.kept if info(node).role == GRAD_SHARD else reduce
                node.args = (tensors, node.args[1], node.args[2], dtype)
            elif node.target is aten.add_.Tensor and node.args[0] in accumulators:
                node.args = (node.args[0], self._uncast(node.args[1]), *node.args[2:])
            elif info(node).span is not None:  # a parameter's gradient, read in place
                self._read_uncast(node)

    def _uncast(self, grad: fx.Node | None) -> fx.Node | None:
        """The compute-dtype gradient under capture's up-cast of it (erased when unused)."""
        if grad is None or not _is_cast(grad):
            return grad
        source = grad.args[0]
        if len(grad.users) == 1:
            grad.replace_all_uses_with(source)
            self.graph.erase_node(grad)
        return source

    def _read_uncast(self, view: fx.Node) -> None:
        """A parameter's gradient the update reads where backward left it (world size 1): read
        it in the compute dtype, under capture's up-cast (and a contiguous copy of it)."""
        source = view.args[0]
        if source.target is aten.clone.default:
            source.args = (self._uncast(source.args[0]),)
        else:
            view.args = (self._uncast(source), *view.args[1:])

    def keep_gradients(self) -> None:
        """Without accumulation the update reads the reduced gradient (at world size 1,
        backward's): cast it to the kept dtype where that changes what the update sees: a
        narrower kept dtype rounds it, and the unscale of loss scaling writes it in place."""
        scaled = self.precision.scaling != "none"
        for node in nodes_with_role(self.gm, GRAD_SHARD):
            have = self._dtype_of(node)
            exact = self.kept == torch.float32  # fp32 holds every bf16 and fp16 value
            if have == self.kept or (exact and not scaled):
                continue
            with self.graph.inserting_after(node):
                cast = emit(
                    self.graph,
                    aten._to_copy.default,
                    (node,),
                    phase=info(node).phase,
                    unit=info(node).unit,
                    role=GRAD_SHARD,
                    no_grad=info(node).no_grad,
                    span=info(node).span,
                    note=f"the gradient kept in {str(self.kept).removeprefix('torch.')} for "
                    "the update",
                )
            cast.kwargs = {"dtype": self.kept}
            info(node).role, info(node).span = None, None

    def _dtype_of(self, node: fx.Node) -> torch.dtype:
        """The dtype ``node`` will hold once values are propagated again: placeholders are
        retyped already, a pack or a cast says its dtype, views, in-place ops, copies and
        collectives keep their input's, and what capture traced holds the recipe's."""
        if node.op == "placeholder":
            return val(node).dtype
        if node.target is op("pack"):
            return node.args[3]
        if node.target is aten._to_copy.default and "dtype" in node.kwargs:
            return node.kwargs["dtype"]
        if node.target in _KEEPS_DTYPE or is_alias_op(node):
            return self._dtype_of(node.args[0])
        return val(node).dtype

    def unscale(self) -> fx.Node:
        """Unscale every reduced gradient in place and find overflows (on any rank)."""
        scale = placeholders(self.gm, LOSS_SCALE)
        if not scale:
            raise InvariantError("loss scaling is on, but the program has no loss-scale input")
        grads = nodes_with_role(self.gm, GRAD_SHARD)
        output = next(n for n in self.graph.nodes if n.op == "output")
        where = {"phase": "optimizer"}
        with self.graph.inserting_before(output):
            inv = emit(self.graph, aten.reciprocal.default, (scale[0],), **where)
            found = emit(
                self.graph,
                op("unscale_check_"),
                (grads, inv),
                note="unscale the reduced gradients by 1/loss_scale; 1.0 if any is inf/NaN",
                **where,
            )
            for spread in _flag_groups(self.ctx, self.zero):
                found = emit_collective(
                    self.graph,
                    op("all_reduce_start"),
                    op("wait"),
                    (found, spread.group),
                    nbytes=2 * 4,
                    note=f"all-reduce the overflow flag ({spread.group}): every rank skips the "
                    "same steps",
                    **where,
                )
        info(found).role = FOUND_INF
        output.args = ((output.args[0], found),)
        return found


def _flag_groups(ctx: PassContext, zero: ZeroConfig) -> tuple[Spread, ...]:
    """The groups the overflow flag is agreed over, as the mesh says where each unit's
    gradient lies (:meth:`~zerocc.compiler.parallel.mesh.Mesh.gradient_groups`): each rank
    checked its part of it (its shards, its tp slices, an experts unit's experts or shards on
    the other ep ranks or replicas) and of the units it holds (its pipeline stages). The
    groups every unit's gradient lies over in parts first, then those of some units only,
    then those whose ranks hold other units, each once: the order every rank emits them."""
    spreads = [ctx.mesh.gradient_groups(u.group, zero.shards_optimizer) for u in ctx.units]
    every = [s for s in dict.fromkeys(s for spread in spreads for s in spread)]
    common = [s for s in every if all(s in spread for spread in spreads)]
    parts = [s for s in common if s.holds == "parts"]
    some = [s for s in every if s not in common]
    return (*parts, *some, *(s for s in common if s.holds == "units"))


def _rescale_collective_bytes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Collectives now move tensors of other dtypes: scale their recorded bytes."""
    units = {u.name: u for u in ctx.units}
    for node in gm.graph.nodes:
        unit = units.get(info(node).unit or "")
        if info(node).stream != Stream.COMM or not info(node).bytes or unit is None:
            continue
        moved = next(a for a in node.args if isinstance(a, fx.Node))
        if node.target is op("all_gather_into_start"):
            moved = node.args[0]
        # Placeholders are retyped already; a pack says its dtype (values propagate later).
        dtype = moved.args[3] if moved.target is op("pack") else val(moved).dtype
        itemsize = dtype.itemsize
        info(node).bytes = info(node).bytes // unit.dtype.itemsize * itemsize


@register_pass(
    "precision",
    requires=("sharded_params", "grad_shards"),
    provides=("mixed_precision",),
    forbids=("optimizer_update",),
    changes_numerics=True,
    options=lambda plan: {
        "precision": plan.precision,
        "zero": plan.zero,
        "grad_accumulation": plan.grad_accumulation,
    },
    enabled=lambda plan: plan.precision.mixed,
    when="the precision section leaves fp32",
    off_because="the precision section keeps fp32 everywhere",
    turn_on="set precision.param: bf16 (or fp16)",
    declares=lambda layout, units, plan: declare_params(layout, units, plan, plan.precision),
)
def precision(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    precision: PrecisionConfig,
    zero: ZeroConfig,
    grad_accumulation: int,
) -> fx.GraphModule:
    """Compute in ``precision.param``, reduce in ``precision.reduce``, keep ``master`` weights,
    and unscale + overflow-check gradients when the loss is scaled."""
    rewriter = _PrecisionRewriter(gm, ctx, precision, zero)
    rewriter.retype_state()
    rewriter.drop_param_casts()
    rewriter.reduce_in_reduce_dtype()
    if grad_accumulation == 1:
        rewriter.keep_gradients()
    if precision.scaling != "none" and ctx.boundary:
        rewriter.unscale()
    _rescale_collective_bytes(gm, ctx)
    return gm
