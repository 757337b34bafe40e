"""Context-parallel attention's block math, load balance, ring walk and all-to-all form
(zerocc/compiler/parallel/ring_attention.py, attention_blocks.py, ulysses_attention.py; issue
79): C ranks simulated in one process, one thread each, their outputs and gradients assembled
over the ranks against torch's scaled_dot_product_attention on the whole sequence. The
all-to-all form's cases are here because they share the simulated ranks and the reference."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from zerocc.compiler.parallel.ring_attention import (
    CpLayout,
    attention_flops,
    block_kind,
    ring_attention_backward,
    ring_attention_forward,
)
from zerocc.compiler.parallel.ulysses_attention import (
    ulysses_attention_backward,
    ulysses_attention_forward,
)
from zerocc.errors import PlanError

# fp32 against torch's sdpa in fp32: the ring sums each row's softmax in blocks and rescales by
# exp(lse differences), sdpa in one pass, so the two round differently. With 48 tokens, 4 heads
# and head_dim 16 they differ by at most 7.9e-7 of the largest value (measured over these
# cases, ring and all-to-all; one rank, where only the blocking differs, 4e-7). 1e-6 of the
# reference's largest magnitude leaves room for that and little more: a block left out is off
# by ~1e-1, and one block's merge weight off by one part in a million already fails 9 cases.
RELATIVE = 1e-6


class SimulatedRing:
    """C ranks' ``exchange`` in one process: each rank's call sends its tuple to rank+1 and
    returns rank-1's, once every rank has called (a barrier per shift), as a ring of
    send/recv would."""

    def __init__(self, cp: int) -> None:
        self.cp = cp
        self.slots: list[tuple[torch.Tensor, ...] | None] = [None] * cp
        self.barrier = threading.Barrier(cp)
        self.shifts = [0] * cp

    def exchange_of(self, rank: int) -> Callable[[tuple[torch.Tensor, ...]], tuple]:
        def exchange(sent: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            self.slots[rank] = tuple(t.clone() for t in sent)
            self.barrier.wait()
            received = self.slots[(rank - 1) % self.cp]
            self.barrier.wait()
            self.shifts[rank] += 1
            assert received is not None
            return received

        return exchange

    def all_to_all_of(self, rank: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        def all_to_all(sent: list[torch.Tensor]) -> list[torch.Tensor]:
            assert len(sent) == self.cp
            self.slots[rank] = tuple(t.clone() for t in sent)
            self.barrier.wait()
            received = [self.slots[s][rank] for s in range(self.cp)]  # type: ignore[index]
            self.barrier.wait()
            self.shifts[rank] += 1
            return received

        return all_to_all

    def run(self, work: Callable[[int, Callable], object]) -> list[object]:
        """``work(rank, exchange)`` on every rank at once; their results in rank order."""
        results: list[object] = [None] * self.cp
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = work(rank, self)
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if errors:
            raise errors[0]
        return results


def close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the expected tensor's largest magnitude."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def ring_vs_sdpa(
    cp: int,
    causal: bool,
    balanced: bool,
    key_keep: torch.Tensor | None = None,
    form: str = "ring",
) -> dict[str, float]:
    """The ring (or the all-to-all form) over ``cp`` simulated ranks against sdpa on the whole
    sequence: each of out, dq, dk, dv's relative difference."""
    torch.manual_seed(cp * 10 + causal)
    batch, heads, seq, dim = 2, 4, 48, 16
    q, k, v = (torch.randn(batch, heads, seq, dim, requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, heads, seq, dim)
    mask = None
    if key_keep is not None:
        mask = key_keep[:, None, None, :]
        if causal:
            mask = mask & torch.ones(seq, seq, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    ref.backward(dout)

    layout = CpLayout(seq, cp, balanced)

    def work(rank: int, ring: SimulatedRing) -> tuple[torch.Tensor, ...]:
        idx = layout.token_indices(rank)
        mine = [t.detach()[:, :, idx] for t in (q, k, v)]
        keep = None if key_keep is None else key_keep[:, idx]
        common = dict(layout=layout, causal=causal, key_keep=keep)
        if form == "alltoall":
            common["all_to_all"] = ring.all_to_all_of(rank)
            out, lse = ulysses_attention_forward(*mine, **common)
            grads = ulysses_attention_backward(*mine, out, lse, dout[:, :, idx], **common)
        else:
            common.update(rank=rank, exchange=ring.exchange_of(rank))
            out, lse = ring_attention_forward(*mine, **common)
            grads = ring_attention_backward(*mine, out, lse, dout[:, :, idx], **common)
        return (out, *grads)

    ring = SimulatedRing(cp)
    per_rank = ring.run(work)
    # ring: cp-1 shifts forward, cp backward (the last carries dK/dV home), none on one rank;
    # all-to-all: 4 forward (q, k, v to heads, out back), 8 backward (5 to heads, 3 back)
    shifts = 2 * cp - 1 if cp > 1 else 0
    if form == "alltoall":
        shifts = 12 + 2 * (key_keep is not None)
    assert ring.shifts == [shifts] * cp
    assembled = [torch.empty(batch, heads, seq, dim) for _ in range(4)]
    for rank, results in enumerate(per_rank):
        for whole, part in zip(assembled, results, strict=True):
            whole[:, :, layout.token_indices(rank)] = part
    expected = [ref.detach(), q.grad, k.grad, v.grad]
    return {
        name: close(a, e)
        for name, a, e in zip(("out", "dq", "dk", "dv"), assembled, expected, strict=True)
    }


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_equals_sdpa_on_the_whole_sequence(cp: int, causal: bool, balanced: bool) -> None:
    errors = ring_vs_sdpa(cp, causal, balanced)
    assert max(errors.values()) <= RELATIVE, errors


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_with_a_padding_mask_equals_sdpa(causal: bool) -> None:
    keep = torch.ones(2, 48, dtype=torch.bool)
    keep[0, 40:] = False  # the first sample's last 8 tokens are padding
    keep[1, 5:9] = False
    errors = ring_vs_sdpa(2, causal, True, keep)
    assert max(errors.values()) <= RELATIVE, errors


def test_one_rank_is_plain_attention() -> None:
    errors = ring_vs_sdpa(1, True, True)
    assert max(errors.values()) <= RELATIVE, errors


def test_balanced_layout_gives_each_rank_chunks_r_and_2c_minus_1_minus_r() -> None:
    layout = CpLayout(16, 4)
    assert layout.token_indices(0).tolist() == [0, 1, 14, 15]
    assert layout.token_indices(3).tolist() == [6, 7, 8, 9]
    every = torch.cat([layout.token_indices(r) for r in range(4)]).sort().values
    assert every.tolist() == list(range(16))
    assert CpLayout(16, 4, balanced=False).token_indices(1).tolist() == [4, 5, 6, 7]


def test_a_length_that_does_not_divide_is_refused() -> None:
    with pytest.raises(PlanError, match=r"4098 tokens cannot be cut into 8 equal chunks"):
        CpLayout(4098, 4)


def test_blocks_above_the_diagonal_are_skipped() -> None:
    assert block_kind((0, 4), (4, 4), causal=True) == "skip"
    assert block_kind((4, 4), (0, 4), causal=True) == "full"
    assert block_kind((4, 4), (4, 4), causal=True) == "diagonal"
    assert block_kind((0, 4), (4, 4), causal=False) == "full"
    # Causal work is about half the full square, not all of it.
    layout = CpLayout(4096, 4)
    causal = sum(attention_flops(layout, r, causal=True) for r in range(4))
    full = sum(attention_flops(layout, r, causal=False) for r in range(4))
    assert causal < 0.6 * full


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_ranks_do_within_5_percent_of_the_mean_work(cp: int) -> None:
    def spread(layout: CpLayout) -> float:
        flops = [attention_flops(layout, r, causal=True) for r in range(cp)]
        mean = sum(flops) / cp
        return max(abs(f - mean) / mean for f in flops)

    assert spread(CpLayout(4096, cp)) <= 0.05
    # Contiguous chunks: the last rank does ~2x the mean, which is what balancing fixes.
    assert spread(CpLayout(4096, cp, balanced=False)) > 0.3


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_all_to_all_equals_sdpa_on_the_whole_sequence(
    cp: int, causal: bool, balanced: bool
) -> None:
    errors = ring_vs_sdpa(cp, causal, balanced, form="alltoall")
    assert max(errors.values()) <= RELATIVE, errors


def test_all_to_all_with_a_padding_mask_equals_sdpa() -> None:
    keep = torch.ones(2, 48, dtype=torch.bool)
    keep[0, 40:] = False
    errors = ring_vs_sdpa(2, True, True, keep, form="alltoall")
    assert max(errors.values()) <= RELATIVE, errors


def test_all_to_all_refuses_heads_that_do_not_divide() -> None:
    q = torch.randn(1, 3, 8, 4)
    with pytest.raises(PlanError, match=r"3 attention heads do not divide over cp=2"):
        ulysses_attention_forward(
            q, q, q, layout=CpLayout(8, 2), causal=True, all_to_all=lambda parts: parts
        )
