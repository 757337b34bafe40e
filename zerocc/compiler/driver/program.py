"""Compile one program: capture the step, then run the plan's pass list over it.

The TrainStep compiles this way before running, and the inspection tools (``zerocc inspect``,
``zerocc estimate``) compile this way without running anything: capture works on fake tensors
and passes never touch data, so a model on the ``meta`` device of any size compiles in seconds
for any world size.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from zerocc.compat import LazyGraphModule
from zerocc.compiler.capture import Casts, LossFn, ModelInfo, capture
from zerocc.compiler.driver.pass_manager import PassContext, PassList, PassRecord, run_passes
from zerocc.compiler.opaque import regions_in
from zerocc.compiler.parallel.experts import ExpertParallel, tag_exchanges
from zerocc.compiler.parallel.mesh import Mesh
from zerocc.compiler.parallel.split_draws import (
    draws_outside_regions,
    take_parts_of_whole_draws,
    whole_draws,
)
from zerocc.compiler.parallel.tensor_parallel import TensorParallel, tag_collectives
from zerocc.compiler.plan import Plan
from zerocc.compiler.state import NVME, StateLayout
from zerocc.compiler.units import Unit
from zerocc.errors import InvariantError
from zerocc.ir.keyed_draws import key_draws
from zerocc.ir.nodes import BUFFER, STATE_ROLES, count_ops, info, val


@dataclass
class CompiledProgram:
    """A scheduled program, what each pass did to it, the units it was built with and the
    persistent state its passes laid out (which its state placeholders bind)."""

    gm: fx.GraphModule
    records: list[PassRecord]  # the captured graph first ("capture"), then one per pass
    units: list[Unit]
    layout: StateLayout


class CapturedSteps:
    """Captured steps kept for programs that differ only in what the passes do (the
    candidates of a plan search: other stages, recomputation, offload), by what a capture
    depends on: the model, the batch's layout, the precision's casts, the layers split and the
    capture's options. Each program gets its own copy of the captured graph."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, tuple[fx.GraphModule, str]] = {}

    @staticmethod
    def key(
        model: nn.Module, loss_fn: LossFn | None, plan: Plan, batch: Sequence[Any], training: bool
    ) -> tuple:
        layout = tuple(
            (tuple(b.shape), b.dtype, b.device) if isinstance(b, torch.Tensor) else repr(b)
            for b in batch
        )
        sections = (plan.precision, plan.parallel, plan.capture)
        return (id(model), id(loss_fn), layout, training, *(s.model_dump_json() for s in sections))

    def get(self, key: tuple) -> tuple[fx.GraphModule, str] | None:
        """A copy of the graph captured under ``key`` and its description, if there is one."""
        kept = self._graphs.get(key)
        return None if kept is None else (_copied(kept[0]), kept[1])

    def put(self, key: tuple, gm: fx.GraphModule, described: str) -> None:
        self._graphs[key] = (_copied(gm), described)


def _copied(gm: fx.GraphModule) -> fx.GraphModule:
    copy = snapshot(gm)
    copy.meta.update(gm.meta)
    return copy


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the body. Compiling makes millions of objects
    that live until it ends (nodes, fake tensors, their records) and little garbage: the
    collector's passes over them were a sixth of a 7.5B model's compile time."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@collection_paused()
def compile_program(
    model: nn.Module,
    model_info: ModelInfo,
    plan: Plan,
    pass_list: PassList,
    batch: Sequence[Any],
    *,
    loss_fn: LossFn | None,
    device: torch.device,
    mesh: Mesh,
    boundary: bool,
    units: list[Unit] | None = None,
    keep_graphs: bool = False,
    training: bool = True,
    tensor_parallel: TensorParallel | None = None,
    expert_parallel: ExpertParallel | None = None,
    captured: CapturedSteps | None = None,
) -> CompiledProgram:
    """Capture ``model``'s step on ``batch`` and run ``pass_list`` for the ranks of ``mesh``
    (the session's); ``boundary``: the program ends with the optimizer step. ``units``: the
    FSDP units the caller's state is laid out in (the partition pass assigns them when there
    are none).
    ``keep_graphs`` keeps a copy of the graph after every pass in its record (for
    inspection). ``training=False``: a forward-only program that returns the loss (evaluation;
    the passes find no gradient, so it gathers what forward needs and updates nothing).
    ``tensor_parallel``: the layers the plan splits (``model_info`` then gives each split
    parameter's slice), captured in their tensor-parallel form; ``expert_parallel``: the
    experts modules it splits, each call captured as a region exchanging its tokens.
    ``captured``: steps captured before, reused where this one was (see
    :class:`CapturedSteps`)."""
    start = time.perf_counter()
    tp, ep = tensor_parallel, expert_parallel
    key = CapturedSteps.key(model, loss_fn, plan, batch, training)
    kept = captured.get(key) if captured is not None else None
    if kept is not None:
        (gm, described), how = kept, "copied from an earlier capture"
    else:
        gm = capture_split(model, model_info, plan, loss_fn, batch, device, training, tp, ep)
        how = "Captured by make_fx"
        described = (
            (f"; {tp.describe()}" if tp else "")
            + (f"; {ep.describe()}" if ep else "")
            + "".join(f"; {r.fqn} ({r.kind}) as an opaque region" for r in regions_in(gm))
            + (f"; {gm.meta['repeated_layers']}" if gm.meta["repeated_layers"] else "")
        )
        if captured is not None:
            captured.put(key, gm, described)
    seconds = time.perf_counter() - start
    record = PassRecord(
        "capture",
        seconds,
        f"{how} (took {seconds * 1e3:.1f} ms){described}",
        0,
        len(gm.graph.nodes),
        count_ops(gm.graph.nodes),
        {},
    )
    if keep_graphs:
        record.gm = snapshot(gm)
    ctx = PassContext(
        plan,
        mesh,
        model_info,
        boundary=boundary and training,
        units=list(units or []),
        tensor_parallel=tp,
        expert_parallel=ep,
    )
    gm, records = run_passes(gm, ctx, pass_list, snapshot if keep_graphs else None)
    check_bindings(gm, ctx.layout, model_info)
    return CompiledProgram(gm, [record, *records], ctx.units, ctx.layout)


def capture_split(
    model: nn.Module,
    model_info: ModelInfo,
    plan: Plan,
    loss_fn: LossFn | None,
    batch: Sequence[Any],
    device: torch.device,
    training: bool = True,
    tensor_parallel: TensorParallel | None = None,
    expert_parallel: ExpertParallel | None = None,
) -> fx.GraphModule:
    """The step captured as a rank runs it, under the plan's precision and capture options:
    the layers tensor parallelism splits in their split form (``model_info``: each split
    parameter's slice), their collectives tagged; each call of an experts module expert
    parallelism splits as a region exchanging its tokens. Under ``capture.draws: keyed`` each
    random op draws from its own seed (:mod:`zerocc.ir.keyed_draws`)."""
    tp, ep = tensor_parallel, expert_parallel
    with tp.applied(model) if tp is not None else contextlib.nullcontext():
        gm = capture(
            model,
            model_info,
            loss_fn,
            batch,
            device,
            Casts.of(plan.precision),
            gradients=training,
            loss_check=tp.check_loss if tp is not None else None,
            tensor_status=tp.tensor_status() if tp is not None else None,
            forwards=ep.forwards(training) if ep is not None else None,
            repeated_layers=plan.capture.repeated_layers,
        )
    if tp is not None:
        tag_collectives(gm)
    if ep is not None:
        tag_exchanges(gm)
    if plan.capture.draws == "keyed":
        if tp is not None and draws_outside_regions(gm):
            whole = whole_draws(model, tp.whole_info(model_info), loss_fn, batch, device,
                                Casts.of(plan.precision), gm, ep)  # fmt: skip
            take_parts_of_whole_draws(gm, whole, tp.parts)
        key_draws(gm)
    return gm


def check_bindings(
    gm: fx.GraphModule, layout: StateLayout, model_info: ModelInfo | None = None
) -> None:
    """Every state placeholder of ``gm`` binds a state of ``layout`` that the runtime holds in
    memory (not one placed on NVMe, which the program reads through its store), of its shape
    and dtype (what the runtime allocated from the layout), and with ``model_info``, every
    buffer placeholder a buffer of the model, of its shape and dtype: raises InvariantError
    naming the first that does not."""
    buffers = {b.fqn: b for b in model_info.buffers} if model_info is not None else None
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        role, key, value = info(node).role, info(node).key or "", val(node)
        if role == BUFFER and buffers is not None:
            held = buffers.get(key)
            found = None if held is None else (held.shape, held.dtype)
            what = "no buffer of the model" if held is None else f"buffer {held.shape} {held.dtype}"
        elif role in STATE_ROLES:
            spec = layout.get(key)
            found = None if spec is None or spec.location == NVME else (spec.shape, spec.dtype)
            what = spec if spec is not None else "no state of key " + repr(key)
        else:
            continue
        if found != (tuple(value.shape), value.dtype):
            raise InvariantError(
                f"placeholder {node.name} ({role}, {tuple(value.shape)} {value.dtype}) binds no "
                f"state of the layout its passes declared, held in memory ({what})"
            )


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes (and their zerocc records) later passes cannot change."""
    from zerocc.ir.nodes import copy_node

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = copy_node(graph, node, env.__getitem__)
    return LazyGraphModule(gm, graph)
