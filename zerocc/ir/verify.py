"""The IR invariants of DESIGN.md, checked after every pass when ``ZEROCC_VERIFY=1``.

1. Every collective (and every offload copy) has exactly one start and one wait, in that order,
   on one stream, and nothing touches an in-place collective's tensor while it is in flight.
2. No use of a gathered parameter before its wait or after its free.
(3, every rank's program is identical, is checked by the runtime across ranks; 4, passes that
change numerics are opt-in, by the pass manager.)
"""

from __future__ import annotations

from torch import fx

from zerocc.errors import InvariantError
from zerocc.ir.kinds import OpKind
from zerocc.ir.nodes import GATHERED, alias_closure, info, op_kind, op_name


def _fail(after: str, node: fx.Node, problem: str) -> InvariantError:
    return InvariantError(
        f"after pass {after!r}: node {node.name!r} ({op_name(node.target)}): {problem}"
    )


def check_well_formed(gm: fx.GraphModule, after: str) -> None:
    """fx's own checks of ``gm``'s graph (each argument defined before its use, ...) as an
    :class:`InvariantError` naming the pass, without the printout of the whole graph that fx
    appends to its message (780 KB for a 7B GPT)."""
    try:
        gm.graph.lint()
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvariantError(f"after pass {after!r}: the graph is malformed: {first}") from None


def verify_program(gm: fx.GraphModule, after: str) -> None:
    """Raise :class:`InvariantError` naming the first node that breaks an invariant."""
    check_well_formed(gm, after)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if op_kind(node) in (OpKind.COLLECTIVE, OpKind.TRANSFER):
            _check_collective(node, order, after)
        if info(node).role == GATHERED:
            _check_gathered(node, order, after)


def _check_collective(start: fx.Node, order: dict[fx.Node, int], after: str) -> None:
    users = list(start.users)
    if len(users) != 1 or op_name(users[0].target) != "zerocc.wait":
        raise _fail(
            after,
            start,
            f"a collective needs exactly one wait as its only user, has {[u.name for u in users]}",
        )
    wait = users[0]
    if info(wait).stream != info(start).stream:
        raise _fail(
            after,
            wait,
            f"waits on stream {info(wait).stream!r} for a collective "
            f"started on {info(start).stream!r}",
        )
    schema_args = start.target._schema.arguments
    for arg, value in zip(schema_args, start.args, strict=False):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            for user in value.users:
                if user is not start and order[start] < order[user] < order[wait]:
                    raise _fail(
                        after,
                        user,
                        f"uses {value.name!r} while collective {start.name!r} writes it",
                    )


def _check_gathered(flat: fx.Node, order: dict[fx.Node, int], after: str) -> None:
    aliases = alias_closure(flat)
    frees = [u for a in aliases for u in a.users if op_kind(u) is OpKind.FREE]
    if len(frees) > 1:
        raise _fail(after, frees[1], f"frees {flat.name!r} a second time")
    if not frees:
        return
    free = frees[0]
    for alias in aliases:
        for user in alias.users:
            if user is not free and order[user] > order[free]:
                raise _fail(
                    after,
                    user,
                    f"uses gathered parameter {flat.name!r} after it was freed by {free.name!r}",
                )
