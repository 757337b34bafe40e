"""Ranks agree before they act: on the next micro-batch (its shapes and dtypes, or that there
is none left) and on every new program, so that a difference is an error on every rank, naming
each rank's view, and never a hang or a silent divergence.

An agreement all-gathers an 8-byte hash of what each rank is about to do, on the comm's gloo
control group; only when the hashes differ does it gather the full views, to say where they
differ. It is issued without waiting (:class:`Agreement`) and settled when its answer is
needed: the TrainStep settles the agreement on a micro-batch right before the first
collective of a program whose run writes nothing before that collective
(:func:`agrees_at_first_collective`), so the round trip runs behind the work before it.
:class:`RankAgreement` is what a step runner agrees on with its peers: how they start, each
micro-batch, each program.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from zerocc.compiler.materialize import WeightSource
from zerocc.compiler.plan import Plan
from zerocc.engine.comm import Comm, TorchComm
from zerocc.engine.watchdog import wait_watched
from zerocc.errors import DataExhaustedError, RankMismatchError, ZeroccError
from zerocc.ir.access import StorageRoots
from zerocc.ir.nodes import BATCH, info, op_name, placeholders
from zerocc.ir.ops import COLLECTIVE_STARTS
from zerocc.runtime.failures import RankHealth

END_OF_DATA = ("end of data",)  # what a rank with no batch left agrees on


def digest(text: str) -> str:
    """A hash of ``text`` (hex), the same on every rank."""
    return hashlib.sha256(text.encode()).hexdigest()


class Agreement:
    """One agreement in flight: every rank's 8-byte hash of ``what`` all-gathered on the
    control group of ``comm``, issued at construction without waiting. Every rank must settle
    its agreements (:meth:`views_if_they_differ`) in the order it issued them: a difference
    gathers the ranks' ``detail`` on the same group. Without peers there is nothing to agree
    on. A collective that fails (a peer that stopped answering, or left) is recorded on
    ``comm.failure`` and raised."""

    def __init__(
        self, comm: Comm, what: tuple, detail: str, within: tuple[int, str] | None = None
    ) -> None:
        self.comm, self.what, self.detail = comm, what, detail
        self.error: BaseException | None = None  # what settling it raised, set by its settler
        self.sharing = "tensor-parallel group"  # what the ranks of a ``within`` group are
        self._views: list[Any] | None = None
        self._work: dist.Work | None = None
        self._split: list[list[int]] = []
        if not has_peers(comm):
            return
        # ``within``: (group, content) that the ranks of one group must agree on as well (the
        # batch of a tensor-parallel group's or a pipeline's ranks); none: group -1. Every
        # agreement gathers as many bytes, whatever it is about: a rank making another call
        # than its peers' (an agreement with ``within`` against one without) is then told
        # so, not aborted by gloo for a collective of another size.
        group, content = (within[0], _hash(within[1])) if within is not None else (-1, 0)
        self._mine = torch.tensor([_hash(repr(what)), group, content], dtype=torch.int64)
        self._everyone = [torch.zeros_like(self._mine) for _ in range(comm.world_size)]
        comm.stats.log("agreement", 0)
        try:
            self._work = dist.all_gather(
                self._everyone, self._mine, group=comm.control_group, async_op=True
            )
        except Exception as exc:
            comm.failure = exc
            raise

    @property
    def settled(self) -> bool:
        """Whether its answer is known (or there was nothing to agree on)."""
        return self._work is None

    def views_if_they_differ(self) -> list[Any] | None:
        """Wait for the answer: None when every rank had the same ``what``, else every rank's
        ``detail``, by rank. Settled once; later calls give the same answer."""
        work, self._work = self._work, None
        if work is None:
            return self._views
        try:
            wait_watched(work, self.comm.heartbeat)
            if not all(torch.equal(t[:1], self._mine[:1]) for t in self._everyone):
                self._views = self.comm.all_gather_object(self.detail)
        except Exception as exc:
            self.comm.failure = exc
            raise
        if self._views is None:
            groups: dict[int, dict[int, list[int]]] = {}  # group -> content -> ranks
            for rank, (_, group, content) in enumerate(t.tolist() for t in self._everyone):
                if group >= 0:
                    groups.setdefault(group, {}).setdefault(content, []).append(rank)
            self._split = [
                [ranks for ranks in by_content.values()]
                for by_content in groups.values()
                if len(by_content) > 1
            ]
        return self._views

    def split_groups(self) -> list[list[list[int]]]:
        """After :meth:`views_if_they_differ`: the groups whose ranks disagree on ``within``'s
        content, each as its ranks by content (empty when every group agrees)."""
        return self._split


def has_peers(comm: Comm) -> bool:
    """Whether ``comm`` has ranks to agree with (a FakeComm's are simulated: it has none)."""
    return isinstance(comm, TorchComm) and comm.world_size > 1


def _hash(text: str) -> int:
    return int(digest(text)[:15], 16)


START_PROBLEM = (
    "the ranks do not start alike (each has its own torch, zerocc, plan, model and weight "
    "files: give every rank the same)"
)


def start_text(plan: Plan, source: WeightSource | None, model: nn.Module) -> str:
    """What every rank must start with alike, a line per fact: the torch and zerocc releases,
    the plan (but for the fields a host sets its own way, ``Plan.shared_lines``), the model's
    parameters and buffers (name, shape, dtype) and its weight source (files copied to each
    host that are not the same). Each rank has its own: a learning rate, a schedule or weight
    files that differ change no compiled program, so the model would train on from a mix of
    them, silently; a model built otherwise (another layer count) would block the first
    broadcast of its weights until the timeout. A difference names its first differing line."""
    weights = source.fingerprint() if source is not None else "the model's own values"
    tensors = [
        f"{kind} {name} {list(t.shape)} {t.dtype}"
        for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers))
        for name, t in named(remove_duplicate=False)
    ]
    return "\n".join([
        f"torch {torch.__version__}", f"zerocc {_zerocc_release()}", "plan:", plan.shared_lines(),
        "model:", *tensors, f"initial weights: {weights}",
    ])  # fmt: skip


def _zerocc_release() -> str:
    """zerocc's installed version (its package metadata: the package root is a layer above)."""
    try:
        return importlib.metadata.version("zerocc")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from its source)"


def batch_digest(batch: tuple) -> str:
    """A hash of a batch's contents (its tensors' bytes, read on the host, and other values)."""
    h = hashlib.sha256()
    for b in batch:
        if isinstance(b, torch.Tensor):
            h.update(str((b.dtype, tuple(b.shape))).encode())
            h.update(b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(repr(b).encode())
    return h.hexdigest()


def views_if_they_differ(comm: Comm, what: tuple, detail: str) -> list[Any] | None:
    """None when every rank of ``comm`` has the same ``what``; else every rank's ``detail``, by
    rank: an :class:`Agreement` issued and settled at once."""
    return Agreement(comm, what, detail).views_if_they_differ()


def agrees_at_first_collective(gm: fx.GraphModule) -> bool:
    """Whether a run of ``gm`` may settle the ranks' agreement on it as late as right before its
    first collective: it has one, and nothing before it writes a tensor the runtime binds
    (weights, gradients, optimizer state, buffers such as batch norm's running statistics,
    counters). A run stopped there leaves the state as it was, so a disagreement is an error
    with nothing updated, as if it had been found before the run; and no rank has issued a
    collective that a peer that disagrees will never match."""
    roots = StorageRoots(gm)
    bound = {n for n in placeholders(gm) if info(n).role != BATCH}
    for node in gm.graph.nodes:
        if op_name(node.target).removeprefix("zerocc.") in COLLECTIVE_STARTS:
            return True
        if node.op == "call_function" and roots.access(node).writes & bound:
            return False
    return False


def batch_disagreement(views: list[Any], rank: int, step: int) -> ZeroccError:
    """The error of ranks that disagree on the next micro-batch: some have none left
    (DataExhaustedError), or their batches' shapes differ (RankMismatchError)."""
    ended = [r for r, v in enumerate(views) if v == repr(END_OF_DATA)]
    if ended:
        going = [r for r in range(len(views)) if r not in ended]
        return DataExhaustedError(
            f"rank {rank}, step {step}: rank(s) {_ranks(ended)} ran out of batches while "
            f"rank(s) {_ranks(going)} still had one. Every rank must train on the same number "
            "of batches (as under DDP): split the data evenly across ranks (drop the "
            "remainder), or stop every rank at the same step"
        )
    batches = all(str(v).startswith("('next batch'") for v in views)
    problem = (
        "the batch shapes differ across ranks"
        if batches
        else "the ranks are not at the same point (a rank in a step while another makes "
        "another call: every rank must train and call alike)"
    )
    return RankMismatchError(f"rank {rank}, step {step}: {problem}: " + first_difference(views))


def first_difference(views: list[Any]) -> str:
    """Name the first line where ranks' texts differ, with each rank's version of it."""
    lines = [str(v).splitlines() for v in views]
    for i in range(max(len(x) for x in lines)):
        at = [x[i] if i < len(x) else "<end>" for x in lines]
        if len(set(at)) > 1:
            return f"first difference at line {i + 1}: " + "; ".join(
                f"rank {r}: {text.strip()}" for r, text in enumerate(at)
            )
    return "texts differ"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class RankAgreement:
    """What a rank agrees on with its peers on ``health``'s comm, each an error on every rank
    when they differ, a RankStoppedError when a peer stops answering: how they start
    (:meth:`agree_on_start`), each micro-batch (:meth:`propose`, then :meth:`settle`) and
    anything else (:meth:`agree`, :meth:`views_if_they_differ`)."""

    def __init__(self, health: RankHealth) -> None:
        self.health, self.comm = health, health.comm

    def agree(self, what: tuple, problem: str, detail: str | None = None) -> None:
        """Raise on every rank when ranks disagree on ``what`` (8-byte hash compared first);
        ``detail``: the text whose first differing line the error names."""
        views = self.views_if_they_differ(what, detail if detail is not None else repr(what))
        if views is not None:
            raise RankMismatchError(f"rank {self.comm.rank}: {problem}: " + first_difference(views))

    def at_the_same_point(self, call: str, micro_batches: int) -> None:
        """Before a collective outside the step (``call``, after ``micro_batches``): every rank
        makes the same call after the same micro-batch. A rank a step ahead (in the step's
        agreement) or making another call gets a RankMismatchError on every rank, saying where
        each is, instead of a wait for the timeout in collectives that do not match."""
        if has_peers(self.comm):
            where = f"{call} after micro-batch {micro_batches}"
            self.agree(("call", where), "the ranks are not at the same point", where)

    def agree_on_start(self, plan: Plan, source: WeightSource | None, model: nn.Module) -> None:
        """Raise on every rank when the ranks do not start alike (:func:`start_text`)."""
        start = start_text(plan, source, model)
        self.agree(("start", digest(start)), START_PROBLEM, start)

    def views_if_they_differ(self, what: tuple, detail: str) -> list[Any] | None:
        """None when every rank has the same ``what``; else every rank's ``detail``, by rank."""
        try:
            return views_if_they_differ(self.comm, what, detail)
        except Exception as exc:  # a peer that stopped answering, or left
            raise self.health.peer_failure(exc, f"the ranks' agreement on the {what[0]}") from exc

    def propose(
        self,
        what: tuple,
        batch: tuple | None = None,
        tp_group: int | None = None,
        sharing: str = "tensor-parallel group",
    ) -> Agreement:
        """Issue the ranks' agreement on the next micro-batch (its signature, or that there is
        none) without waiting for it; :meth:`settle` waits. Under tensor or pipeline
        parallelism (``tp_group``: this rank's data-parallel rank, which the ranks of its tp
        group and its pipeline share; ``sharing``: what they are, for the error) those ranks
        agree on ``batch``'s contents too: they train on one batch, and different ones would
        train a wrong model without any other error."""
        within = None
        if tp_group is not None:
            within = (tp_group, batch_digest(batch) if batch is not None else "")
        try:
            agreement = Agreement(self.comm, what, repr(what), within)
        except Exception as exc:  # the group failed already
            raise self.health.peer_failure(exc, f"the ranks' agreement on the {what[0]}") from exc
        agreement.sharing = sharing
        return agreement

    def settle(self, agreement: Agreement) -> None:
        """Wait for the ranks' agreement on the next micro-batch; raise on every rank when they
        differ (RankMismatchError, DataExhaustedError) or a peer stopped answering
        (RankStoppedError). What it raises is kept as ``agreement.error``."""
        try:
            views = agreement.views_if_they_differ()
        except Exception as exc:  # a peer that stopped answering, or left
            where = f"the ranks' agreement on the {agreement.what[0]}"
            agreement.error = self.health.peer_failure(exc, where)
            raise agreement.error from exc
        step = self.health.step_number()
        if views is not None:
            agreement.error = batch_disagreement(views, self.comm.rank, step)
            raise agreement.error
        if split := agreement.split_groups():
            groups = "; ".join(
                " vs ".join(", ".join(map(str, ranks)) for ranks in group) for group in split
            )
            agreement.error = RankMismatchError(
                f"rank {self.comm.rank}, step {step}: the ranks of a "
                f"{agreement.sharing} were given different batches (ranks {groups}); they "
                "train on one batch: give each rank the batch of its data-parallel rank, "
                "step.data_rank of step.data_parallel"
            )
            raise agreement.error
