"""Draw a scheduled program as a Graphviz DOT graph: one node per op, one cluster per FSDP unit.

Forward ops are light-blue ellipses, backward ops light-green boxes, optimizer ops yellow
hexagons; collectives are filled orange (with the bytes they move) and ``zerocc.free`` grey
with a red border, whatever their phase, so the eye finds the communication and the memory
releases first. A legend cluster names the styles.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import torch
from torch import fx

from zerocc.ir.kinds import Stream
from zerocc.ir.nodes import info, op_name, val
from zerocc.ir.printing import describe_value
from zerocc.ir.quantities import human_bytes

GRAPHVIZ_HINT = (
    "install Graphviz (apt install graphviz / brew install graphviz / conda install graphviz) "
    "to render the .dot files as SVG"
)

# Node styles as DOT attributes; `_style` picks one per node.
FORWARD = {"shape": "ellipse", "fillcolor": "#d6eaf8", "color": "#2e86c1"}
BACKWARD = {"shape": "box", "fillcolor": "#d5f5e3", "color": "#239b56"}
OPTIMIZER = {"shape": "hexagon", "fillcolor": "#fcf3cf", "color": "#b7950b"}
INPUT = {"shape": "note", "fillcolor": "#ffffff", "color": "#566573"}
OTHER = {"shape": "plaintext", "fillcolor": "#ffffff", "color": "#566573"}
COLLECTIVE_FILL = "#f5b041"  # orange: anything on the comm stream
FREE_FILL = "#d5d8dc"  # grey, with a red border: zerocc.free
FREE_BORDER = "#c0392b"

_PHASE_STYLES = {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}
_LEGEND = {
    "forward op": FORWARD,
    "backward op": BACKWARD,
    "optimizer op": OPTIMIZER,
    "input (placeholder)": INPUT,
    "collective (comm stream)": {**FORWARD, "fillcolor": COLLECTIVE_FILL},
    "zerocc.free": {**FORWARD, "fillcolor": FREE_FILL, "color": FREE_BORDER, "penwidth": "2"},
}


def quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as ``\\n``."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n")
    return f'"{escaped}"'


def _attrs(attrs: dict[str, str]) -> str:
    return "[" + ", ".join(f"{key}={quote(value)}" for key, value in attrs.items()) + "]"


def _is_free(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) == "zerocc.free"


def _style(node: fx.Node) -> dict[str, str]:
    record = info(node)
    if node.op == "placeholder":
        style = dict(INPUT)
    else:
        style = dict(_PHASE_STYLES.get(record.phase or "", OTHER))
    if record.stream == Stream.COMM:
        style["fillcolor"] = COLLECTIVE_FILL
    elif _is_free(node):
        style.update(fillcolor=FREE_FILL, color=FREE_BORDER, penwidth="2")
    return style


def _label(node: fx.Node) -> str:
    record = info(node)
    what = op_name(node.target) if node.op == "call_function" else node.op
    lines = [node.name, what]
    value = val(node)
    if isinstance(value, torch.Tensor):
        lines.append(describe_value(value))
    if record.stream == Stream.COMM and record.bytes:
        lines.append(human_bytes(record.bytes))
    return "\n".join(lines)


def _tooltip(node: fx.Node) -> str:
    record = info(node)
    fields = (("unit", record.unit), ("phase", record.phase), ("role", record.role))
    text = " ".join(f"{key}={value}" for key, value in fields if value)
    return f"{text}: {record.note}" if record.note else text


def _node_line(node: fx.Node) -> str:
    attrs = {"label": _label(node), "tooltip": _tooltip(node), **_style(node)}
    return f"{quote(node.name)} {_attrs(attrs)};"


def _cluster_names(units: list[str]) -> dict[str, str]:
    """``cluster_<unit with non-alphanumerics as _>``, made unique (and never the legend's)."""
    taken = {"cluster_legend"}
    names = {}
    for unit in units:
        base = "cluster_" + "".join(c if c.isalnum() else "_" for c in unit)
        name, n = base, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        names[unit] = name
    return names


def _legend() -> list[str]:
    lines = ["  subgraph cluster_legend {", f"    label={quote('legend')};"]
    # Legend ids hold a space, which no fx node name does, so they never clash with the program.
    for text, style in _LEGEND.items():
        lines.append(f"    {quote('legend ' + text)} {_attrs({'label': text, **style})};")
    lines.append("  }")
    return lines


def program_to_dot(gm: fx.GraphModule, title: str, unit: str | None = None) -> str:
    """The program as Graphviz DOT, titled ``title``.

    One node per fx node (name, op, ``dtype[shape]`` of a tensor value, bytes of a collective),
    an edge per data dependency, and a ``subgraph cluster_<unit>`` per FSDP unit holding the
    unit's ops and placeholders. With ``unit``, only the nodes of that unit and the edges
    between them.
    """
    nodes = [n for n in gm.graph.nodes if unit is None or info(n).unit == unit]
    kept = set(nodes)
    by_unit: dict[str | None, list[fx.Node]] = {}
    for node in nodes:
        by_unit.setdefault(info(node).unit, []).append(node)
    units = [u for u in by_unit if u is not None]
    clusters = _cluster_names(units)

    lines = [
        "digraph program {",
        f"  label={quote(title)};",
        '  labelloc="t";',
        '  fontname="Helvetica";',
        '  node [style="filled", fontname="Helvetica", fontsize="10"];',
        '  edge [color="#7f8c8d", arrowsize="0.6"];',
    ]
    for node in by_unit.get(None, []):
        lines.append(f"  {_node_line(node)}")
    for name in units:
        lines.append(f"  subgraph {clusters[name]} {{")
        lines.append(f"    label={quote(name)};")
        lines.append('    style="rounded"; color="#85929e";')
        lines.extend(f"    {_node_line(node)}" for node in by_unit[name])
        lines.append("  }")
    for node in nodes:
        for source in node.all_input_nodes:
            if source in kept:
                lines.append(f"  {quote(source.name)} -> {quote(node.name)};")
    lines.extend(_legend())
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_text: str, path: Path) -> bool:
    """Render DOT text to an SVG file with Graphviz's ``dot``; False when ``dot`` is not
    installed (tell the user :data:`GRAPHVIZ_HINT`)."""
    dot = shutil.which("dot")
    if dot is None:
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([dot, "-Tsvg", "-o", str(path)], input=dot_text, text=True, check=True)
    return True
