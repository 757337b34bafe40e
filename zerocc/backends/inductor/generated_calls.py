"""What the code Inductor generated calls, counted from its text: the kernels Inductor wrote
(C++ on a CPU, Triton on a GPU), the library kernels it calls (``extern_kernels``: the
matmuls), the ATen ops it left to ATen (fallback kernels: attention, an LSTM layer) and
zerocc's ops (the ``zerocc_lowered`` twins: collectives, waits, copies, updates).

What fused into what is read off the first count against the program's ops; the rest is what
no compiler shortens. Read from the module Inductor wrote and loaded (the one the dumps hold),
so it is what runs, cache hits included. The kernels' own sources (triple-quoted strings in
that module) are left out: only the calls of its Python code count.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from zerocc.backends.inductor.lowered_ops import NAMESPACE

_SOURCES = re.compile(r"('''|\"\"\").*?\1", re.DOTALL)  # the kernels' C++ or Triton sources
_CALL = re.compile(
    r"(?<![\w.])(?:"
    r"(?P<kernel>(?:cpp|triton)_\w+)(?:\.run)?"  # Inductor's own: cpp_fused_*, triton_poi_*
    r"|extern_kernels\.(?P<library>\w+)"
    r"|torch\.ops\.(?P<namespace>\w+)\.(?P<op>\w+)(?:\.\w+)?"
    r")\("
)


@dataclass(frozen=True)
class GeneratedCalls:
    """Calls in one generated module, by name (a call in a loop counts once)."""

    kernels: int = 0  # Inductor's kernels called (each module's its own)
    kernel_calls: int = 0  # their calls
    library: Counter[str] = field(default_factory=Counter)  # extern_kernels.<name>
    aten: Counter[str] = field(default_factory=Counter)  # ATen's ops left to ATen (others: ns.op)
    zerocc: Counter[str] = field(default_factory=Counter)  # zerocc's ops

    def __add__(self, other: GeneratedCalls) -> GeneratedCalls:
        return GeneratedCalls(
            self.kernels + other.kernels,
            self.kernel_calls + other.kernel_calls,
            self.library + other.library,
            self.aten + other.aten,
            self.zerocc + other.zerocc,
        )

    def totals(self) -> tuple[int, int, int, int]:
        """Calls of Inductor's kernels, the library's, ATen's and zerocc's."""
        return self.kernel_calls, self.library.total(), self.aten.total(), self.zerocc.total()

    def summary(self) -> str:
        """One line: Inductor's kernels (calls of how many kernels), then the calls of each
        other kind, e.g. ``79 calls of 29 generated kernels, 80 library, 48 ATen, 85 zerocc``."""
        kernel_calls, library, aten, zerocc = self.totals()
        return (
            f"{kernel_calls} calls of {self.kernels} generated kernels, {library} library, "
            f"{aten} ATen, {zerocc} zerocc"
        )

    def by_name(self) -> list[str]:
        """One line per kind: Inductor's kernels counted, the others' names by calls, most
        first."""
        kinds = {"library": self.library, "ATen": self.aten, "zerocc": self.zerocc}
        lines = [f"Inductor's kernels: {self.kernel_calls} calls of {self.kernels}"]
        for kind, calls in kinds.items():
            named = ", ".join(f"{name} {n}" for name, n in calls.most_common())
            lines.append(f"{kind}: {named or 'none'}")
        return lines


def calls_in(code: str) -> GeneratedCalls:
    """The calls of the Python module ``code`` Inductor generated (see the module's doc)."""
    kernels: Counter[str] = Counter()
    library: Counter[str] = Counter()
    aten: Counter[str] = Counter()
    zerocc: Counter[str] = Counter()
    for match in _CALL.finditer(_SOURCES.sub("", code)):
        if match["kernel"]:
            kernels[match["kernel"]] += 1
        elif match["library"]:
            library[match["library"]] += 1
        elif match["namespace"] == NAMESPACE:
            zerocc[match["op"]] += 1
        elif match["namespace"] == "aten":
            aten[match["op"]] += 1
        elif match["namespace"] != "inductor":  # (its own helpers: _alloc_from_pool)
            aten[f"{match['namespace']}.{match['op']}"] += 1
    return GeneratedCalls(len(kernels), kernels.total(), library, aten, zerocc)
