"""Random ops in the whole Inductor graph (zerocc/backends/inductor/random_ops.py): every op that
draws from, reads or sets the generator becomes a twin chained to the one before it by a token,
so a graph compiled whole draws exactly what the graph run op by op draws, replays included.

Held bit for bit: the draws are ATen's own kernels, called by the twins in the program's order,
so a mask or a noise tensor is either the same one or another one, never close.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import zerocc.ir.rng  # noqa: F401  (registers zerocc.rng_state / zerocc.set_rng_state)
from zerocc.backends.inductor.random_ops import (
    DRAW,
    describe,
    thread_generator,
    touches_generator,
    unsupported,
)

RNG_STATE = torch.ops.zerocc.rng_state.default
SET_RNG_STATE = torch.ops.zerocc.set_rng_state.default


def draws_and_replays(x: torch.Tensor) -> list[torch.Tensor]:
    """Every kind of draw the twins carry: an in-place fill of a new tensor (dropout's
    decomposition), an in-place fill of a tensor with values, an op with several results, one
    with keyword arguments (a dtype), and recomputation's replay of a draw."""
    saved = RNG_STATE(x)
    mask = torch.empty_like(x).bernoulli_(0.9)  # fills a new tensor
    noisy = (x * 2).uniform_(-1, 1)  # fills a tensor that has values
    dropped, kept = torch.ops.aten.native_dropout.default(x, 0.5, True)  # two results
    uniform = torch.rand_like(x, dtype=torch.float64)  # a keyword argument
    now = RNG_STATE(x)
    SET_RNG_STATE(saved, x)
    replayed = torch.empty_like(x).bernoulli_(0.9)  # the first mask again
    SET_RNG_STATE(now, x)
    after = torch.rand_like(x)  # what it would have been without the replay
    return [mask, noisy, dropped, kept, uniform, replayed, after, mask.sum() + x]


def _graph() -> fx.GraphModule:
    return make_fx(draws_and_replays)(torch.randn(64, 32))


def _run(fn, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(3)
    return list(fn(x))


def _threaded(graph: fx.GraphModule) -> fx.GraphModule:
    threaded = fx.Graph()
    threaded.output(threaded.graph_copy(graph.graph, {}))
    thread_generator(threaded)
    return fx.GraphModule(graph, threaded)


def _assert_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i}"


def test_the_twins_draw_what_the_ops_draw():
    x = torch.randn(64, 32)
    graph = _graph()
    expected = _run(draws_and_replays, x)
    assert torch.equal(expected[0], expected[5])  # the replay replays
    threaded = _threaded(graph)
    assert not [n for n in threaded.graph.nodes if touches_generator(n)]
    _assert_equal(_run(threaded, x), expected)


def test_the_twins_are_chained_in_program_order():
    threaded = _threaded(_graph()).graph
    twins = [n for n in threaded.nodes if str(n.target).startswith("zerocc_lowered.")]
    assert len(twins) == 10  # two state reads, two sets, six draws
    for before, after in zip(twins, twins[1:], strict=False):
        token = after.args[-1]  # the token ``before`` returned (alone, or last of several)
        assert token is before or token.args == (before, len(before.users) - 1), after.name


def test_a_graph_compiled_whole_draws_what_it_draws_op_by_op():
    """Inductor, free to reorder what data does not order, keeps the chain: the masks, the
    replay and the draws after it are the eager ones (a chain broken, every twin taking the
    first token, made recomputation's replay draw other numbers in the dropout GPT)."""
    from torch._inductor.compile_fx import compile_fx

    x = torch.randn(64, 32)
    graph = _graph()
    compiled = compile_fx(_threaded(graph), [x])
    ours = _run(compiled, x)
    expected = _run(draws_and_replays, x)
    _assert_equal(ours[:7], expected[:7])
    torch.testing.assert_close(ours[7], expected[7])  # a reduction: Inductor's own order


def test_the_filled_tensor_is_read_from_the_draw_after_the_fill():
    threaded = _threaded(_graph()).graph
    draws = [n for n in threaded.nodes if n.target is DRAW]
    empty = draws[0].args[0][0]
    assert empty.target is torch.ops.aten.empty_like.default
    # Before its fill it is read by the state read's twin (its device); after, by nothing.
    users = [u for u in empty.users if u is not draws[0]]
    assert all(str(u.target) == "zerocc_lowered.rng_state.default" for u in users)


def test_a_fill_of_a_new_tensor_reads_nothing_and_of_one_with_values_copies_it():
    graph = _graph()
    in_place = (torch.ops.aten.bernoulli_.float, torch.ops.aten.uniform_.default)
    fills = [n for n in graph.graph.nodes if n.target in in_place]
    fresh = [describe(n)[0] for n in fills]
    assert ['"fresh": true' in c for c in fresh] == [True, False, True]


def test_a_draw_it_cannot_describe_is_named():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    generator = torch.Generator()
    drawn = graph.call_function(torch.ops.aten.bernoulli.p, (x, 0.5), {"generator": generator})
    graph.output(drawn)
    assert unsupported(graph) == (
        "it draws random numbers with aten.bernoulli (an argument of type Generator)"
    )


def test_a_fill_of_the_programs_input_is_named():
    """The twin fills a new tensor, so an input filled in place would no longer change: such a
    program is compiled by region."""
    graph = make_fx(lambda x: x.uniform_())(torch.randn(4)).graph
    assert unsupported(graph) == (
        "it draws random numbers with aten.uniform_ (filling the program's input x_1 in place)"
    )
