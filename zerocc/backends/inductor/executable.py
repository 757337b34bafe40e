"""The Inductor executable: the eager binding of a program, compiled whole or by region.

The program is bound as the eager backend binds it (zerocc's ops on the context's comm, copy
engine and kernels, handles keyed by node). Then, when the executable is made, before the
first run, on fake input values, TorchInductor compiles (Triton kernels on a GPU, C++ on a
CPU) either the whole program as one graph, zerocc's ops in it as kernels that keep their
place (:mod:`zerocc.backends.inductor.whole`), or, where it cannot be whole or is not asked
to be, every compute region between zerocc's ops (:mod:`zerocc.backends.inductor.regions`),
each run as one call between the collectives, copies, frees and updates the passes
scheduled. A region Inductor cannot compile runs eagerly. The executable says what it did
(:meth:`InductorExecutable.notes`). Inductor's caches (its FX graph cache, on disk) make a
graph or region compiled before, in this process or an earlier launch, cost a lookup.

``gm`` is the program as run op by op (the eager binding, its regions outlined): what
profiling and calibration interpret. Of a whole-compiled program that is the eager binding,
so they time zerocc's ops and ATen's one by one, not Inductor's code.

Numerics: random ops run by ATen, in the program's order (in the whole graph, chained by a
token, :mod:`zerocc.backends.inductor.random_ops`; by region, outside the regions), so dropout
masks, and recomputation's replay of them, are those of the eager backend;
:data:`EAGER_NUMERICS` keeps the rest close (16-bit values rounded where eager rounds them, on
releases whose Inductor drops some of it too: :mod:`zerocc.backends.inductor.eager_casts`).
Inductor fuses and reorders reductions, so results match eager within rounding, not to the
bit.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import fx, nn

from zerocc.backends.eager.executable import EagerExecutable
from zerocc.backends.inductor.eager_casts import mend_note, rounding_as_eager
from zerocc.backends.inductor.generated_calls import GeneratedCalls, calls_in
from zerocc.backends.inductor.lowered_ops import running
from zerocc.backends.inductor.region_keys import region_key
from zerocc.backends.inductor.regions import Region, find_regions, outline
from zerocc.backends.inductor.vec_isa import first_valid_isa_only
from zerocc.backends.inductor.whole import compile_whole, unsupported
from zerocc.engine import RuntimeContext
from zerocc.engine.failures import first_line
from zerocc.ir.nodes import info, placeholders, val
from zerocc.logs import FAKE_KERNELS, quiet


@dataclass
class RegionReport:
    """What happened to one region: compiled (and how long it took), or why it runs eagerly."""

    name: str
    phase: str | None
    ops: int
    seconds: float
    fallback: str | None = None  # "TypeError: ..." when Inductor could not compile it
    code: str | None = None  # the Python (and kernels) Inductor generated for it
    same_as: str | None = None  # the region of the same key whose compiled code it runs

    @functools.cached_property
    def calls(self) -> GeneratedCalls | None:
        """What its generated code calls (None where there is none: run eagerly)."""
        return calls_in(self.code) if self.code is not None else None


def example_inputs(values: list[Any]) -> list[Any]:
    """Fake example inputs for Inductor in a fake mode of their own with a shape environment
    (without one, Inductor's caches are bypassed: every launch would compile every region
    again), as shaped, strided and placed as ``values`` (the program's fake values), inputs
    that share storage there sharing it here (views of one flat parameter), so that what
    Inductor assumes of aliasing holds at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    examples = []
    with mode:
        for value in values:
            if not isinstance(value, torch.Tensor):
                examples.append(value)
                continue
            storage = value.untyped_storage()
            key = (storage._cdata, value.dtype)
            if key not in bases:
                size = storage.nbytes() // value.element_size()
                bases[key] = torch.empty(size, dtype=value.dtype, device=value.device)
            base = bases[key]
            examples.append(base.as_strided(value.shape, value.stride(), value.storage_offset()))
    return examples


WHOLE = "whole"  # the report's name for the whole program compiled as one graph

# Inductor options that keep eager's numerics: random ops on ATen's generator (dropout masks,
# and recomputation's replay of them, are eager's), low-precision results rounded where eager
# rounds them.
EAGER_NUMERICS = ("fallback_random", "emulate_precision_casts")


@contextlib.contextmanager
def loaded_modules() -> Iterator[list[str]]:
    """The files of the Python modules Inductor loads in the body: a region's generated code,
    compiled now or found in its cache, and on a GPU each Triton kernel's module too (none
    where this torch loads them otherwise)."""
    from torch._inductor.codecache import PyCodeCache

    loaded: list[str] = []
    real = getattr(PyCodeCache, "load_by_key_path", None)
    if real is None:
        yield loaded
        return

    def recording(key: str, path: str, *args: Any, **kwargs: Any) -> Any:
        loaded.append(path)
        return real(key, path, *args, **kwargs)

    with mock.patch.object(PyCodeCache, "load_by_key_path", recording):
        yield loaded


_LAUNCHER = re.compile(r"^\s*def call\(", re.MULTILINE)  # the wrapper's: def call(args)


def generated_code(loaded: list[str]) -> str | None:
    """The code Inductor generated for a graph: of the modules ``loaded``, the last that is
    its wrapper (the one defining ``call``, which runs the kernels). Not simply the last one
    loaded: on a GPU the wrapper, as it loads, loads each Triton kernel's module after itself,
    and the last of those holds one kernel and calls nothing (an H100 reported "1 calls of 1
    generated kernels, 0 library" for a whole GPT step)."""
    for path in reversed(loaded):
        code = Path(path).read_text()
        if _LAUNCHER.search(code):
            return code
    return None


def _numerics() -> dict[str, bool]:
    """:data:`EAGER_NUMERICS`, where this torch has the option (older releases lack some)."""
    from torch._inductor import config

    return {k: True for k in EAGER_NUMERICS if hasattr(config, k)}


class CompiledRegion(nn.Module):
    """A region's module, run as Inductor compiled it (or eagerly, when it could not).

    Each output is laid out as the program's fake value of it says: what reads it (the next
    region, compiled for those strides and checking them) relies on it, and Inductor does not
    always keep it. A GRU's gates are three views of one tensor, stride 12 each, made sigmoid
    in place (``sigmoid_``); Inductor returned them as tensors of their own, stride 4, and the
    backward region that read them stopped on its input check. Such an output is copied into
    its layout."""

    def __init__(self, region: fx.GraphModule, compiled: Any | None) -> None:
        super().__init__()
        self.region = region
        self.compiled = compiled
        (returned,) = (n.args[0] for n in region.graph.nodes if n.op == "output")
        values = [val(n) for n in returned]
        self.strides = [v.stride() if isinstance(v, torch.Tensor) else None for v in values]

    def forward(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.region(*args)
        outputs = self.compiled(*args)
        return tuple(map(_laid_out, outputs, self.strides))


def _laid_out(value: Any, stride: tuple[int, ...] | None) -> Any:
    """``value`` with ``stride``: itself where it has it (or is no tensor), else a copy."""
    if stride is None or value.stride() == stride:
        return value
    copy = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)
    return copy.copy_(value)


class InductorExecutable(EagerExecutable):
    """A program bound to a runtime context and compiled by Inductor: whole (one graph, zerocc's
    ops in it, :mod:`zerocc.backends.inductor.whole`) where it can be and ``whole`` is asked
    for, else region by region; runs, and tracks what is in flight, as the eager executable
    does."""

    def __init__(self, program: fx.GraphModule, ctx: RuntimeContext, whole: bool = True) -> None:
        super().__init__(program, ctx)
        self.reports: list[RegionReport] = []
        self.compiled_whole: Any | None = None  # the whole program compiled, when it was
        self.whole_note: str | None = None  # why it was not, when it was asked for
        self.mend_note = mend_note(program)  # the 16-bit rounding kept, where it was
        if whole:
            self.whole_note = unsupported(program)
            if self.whole_note is None:
                self._compile_whole(program)
        if self.compiled_whole is None:
            regions = find_regions(self.gm)
            by_key: dict[Hashable, tuple[str, Any, str | None]] = {}
            modules = [self._compile(self.gm, region, by_key) for region in regions]
            self.gm = outline(self.gm, regions, modules)

    @property
    def compilations(self) -> int:
        """How many graphs were handed to Inductor: 1 for the whole program, else one per
        distinct region (a repeated layer's copies share theirs), compiled or rejected."""
        return sum(r.same_as is None for r in self.reports)

    def __call__(self, *args: Any) -> Any:
        if self.compiled_whole is None:
            return self.gm(*args)
        # No autograd: the program holds its backward.
        with running(self.ops), torch.no_grad():
            return self.compiled_whole(*args)

    def _compile_whole(self, program: fx.GraphModule) -> None:
        example = example_inputs([val(n) for n in placeholders(program)])
        start = time.perf_counter()
        try:
            with (
                rounding_as_eager(),
                first_valid_isa_only(),
                quiet(FAKE_KERNELS),
                loaded_modules() as loaded,
            ):
                self.compiled_whole = compile_whole(program, example, _numerics())
        except Exception as exc:  # Inductor rejected it: compiled region by region instead
            self.whole_note = f"{type(exc).__name__}: {first_line(exc)[:200]}"
            return
        code = generated_code(loaded)
        ops = sum(n.op == "call_function" for n in program.graph.nodes)
        seconds = time.perf_counter() - start
        self.reports.append(RegionReport(WHOLE, None, ops, seconds, None, code))

    def _compile(
        self,
        root: fx.GraphModule,
        region: Region,
        by_key: dict[Hashable, tuple[str, Any, str | None]],
    ) -> CompiledRegion:
        """``region`` as a module run by Inductor's code: compiled now, or the code of an
        earlier region with its key (``by_key``: key -> that region's name, its compiled
        callable and fallback, filled here)."""
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        module = region.graph_module(root)
        phase = info(region.nodes[0]).phase
        start = time.perf_counter()
        key, named = region_key(module)
        if key in by_key:
            first, compiled, fallback = by_key[key]
            code = next(r.code for r in self.reports if r.name == first)
            seconds = time.perf_counter() - start
            report = RegionReport(region.name, phase, len(region.nodes), seconds, fallback, code)
            report.same_as = first
            self.reports.append(report)
            return CompiledRegion(module, compiled)
        example = example_inputs([node.meta["val"] for node in region.inputs])
        compiled, fallback = None, None
        try:
            with (
                config.patch(_numerics()),
                rounding_as_eager(),
                first_valid_isa_only(),
                quiet(FAKE_KERNELS),
                loaded_modules() as loaded,
            ):
                compiled = compile_fx(named, example)
        except Exception as exc:  # Inductor rejected it: the region runs eagerly
            fallback = f"{type(exc).__name__}: {first_line(exc)[:200]}"
        seconds = time.perf_counter() - start
        code = generated_code(loaded) if compiled is not None else None
        by_key[key] = (region.name, compiled, fallback)
        self.reports.append(
            RegionReport(region.name, phase, len(region.nodes), seconds, fallback, code)
        )
        return CompiledRegion(module, compiled)

    def lowering(self) -> str:
        """``inductor: whole``, or ``inductor: by region`` and the regions run eagerly."""
        if self.compiled_whole is not None:
            return "inductor: whole"
        eager = [r.name for r in self.reports if r.fallback is not None]
        return "inductor: by region" + (f", eagerly: {', '.join(eager)}" if eager else "")

    def notes(self) -> list[str]:
        """What the backend made of the program: compiled whole, or region by region (and why
        not whole, when it was asked for), with the time it took; then one line per reason
        regions run eagerly, naming them; and, on a torch that drops some of 16-bit casts'
        rounding, that zerocc kept it."""
        mended = [self.mend_note] if self.mend_note else []
        calls = self._calls()
        counted = f"{calls.summary()}; " if calls is not None else ""
        if self.compiled_whole is not None:
            (report,) = self.reports
            return [
                f"inductor: the whole program compiled as one graph ({report.ops} ops, "
                f"{counted}{report.seconds:.1f} s, from the cache included)",
                *mended,
            ]
        by_reason: dict[str, list[str]] = {}
        for report in self.reports:
            if report.fallback is not None:
                by_reason.setdefault(report.fallback, []).append(report.name)
        compiled = sum(r.fallback is None for r in self.reports)
        seconds = sum(r.seconds for r in self.reports)
        lines = []
        if self.whole_note is not None:
            lines.append(f"inductor: compiled region by region, not whole: {self.whole_note}")
        lines.append(
            f"inductor: {compiled} of {len(self.reports)} compute regions compiled as "
            f"{self.compilations} graphs (a repeated layer's copies share one) "
            f"({counted}{seconds:.1f} s, cached ones included)"
        )
        lines += [
            f"inductor: {len(names)} of {len(self.reports)} compute regions run eagerly "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): {reason}"
            for reason, names in by_reason.items()
        ]
        return lines + mended

    def _calls(self) -> GeneratedCalls | None:
        """What the generated code of every compiled region calls, together (None when no
        code was read: nothing compiled, or a torch that loads it otherwise)."""
        found = [r.calls for r in self.reports if r.calls is not None]
        return sum(found, GeneratedCalls()) if found else None

    def artifacts(self) -> dict[str, str]:
        """Files for the dumps: ``regions.txt`` (each region, or the whole program: phase, ops,
        the calls of its generated code by kind, compile time, how it runs, whose code it runs;
        then every call by name) and the code Inductor generated for each (``region_<i>.py``,
        ``whole.py``; a layer's copies' the same code)."""
        calls_header = "".join(f"{kind:>9}" for kind in ("kernels", "library", "ATen", "zerocc"))
        rows = [f"{'region':<12}{'phase':<10}{'ops':>5}{calls_header}{'compile s':>11}  runs"]
        for r in self.reports:
            counts = "".join(f"{n:>9}" for n in (r.calls.totals() if r.calls else "----"))
            runs = "compiled" if r.fallback is None else f"eagerly: {r.fallback}"
            if r.same_as is not None:  # (a row ends with how it runs)
                runs = f"as {r.same_as}: {runs}"
            head = f"{r.name:<12}{r.phase or '':<10}{r.ops:>5}{counts}{r.seconds:>11.2f}"
            rows.append(f"{head}  {runs}")
        calls = self._calls()
        if calls is not None:
            rows += ["", "calls of the generated code, all regions:"]
            rows += [f"  {line}" for line in calls.by_name()]
        files = {"regions.txt": "\n".join(rows) + "\n"}
        files.update({f"{r.name}.py": r.code for r in self.reports if r.code is not None})
        return files
