"""ATen ops Inductor lowers wrongly, which the Inductor backend leaves to ATen.

An LSTM layer on a CPU is ``aten.mkldnn_rnn_layer`` (oneDNN). Inductor's CPU lowering of it is
inference's: it gives the fourth output, the workspace, one element, where in training the
kernel returns the workspace its backward reads (28672 bytes for a 4-wide layer over 5 steps
of 2 sequences), so the generated code's size check stopped the first run (torch 2.11 and
2.13). The layer's backward reads that workspace, whose size no fake value knows (the meta
kernel's is empty). ``torch.compile`` never meets either: Dynamo breaks its graph at every RNN
module (``torch._dynamo.config.allow_rnn`` is off by default).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

# The training flag's index in aten.mkldnn_rnn_layer's arguments.
_RNN_TRAIN = 15


def unlowerable(node: fx.Node) -> str | None:
    """Why Inductor must not compile ``node`` (None when it may)."""
    if node.target is aten.mkldnn_rnn_layer.default and node.args[_RNN_TRAIN]:
        return (
            "aten.mkldnn_rnn_layer in training (an LSTM on a CPU), whose workspace Inductor's "
            "lowering sizes as inference's"
        )
    if node.target is aten.mkldnn_rnn_layer_backward.default:
        return "aten.mkldnn_rnn_layer_backward, whose workspace input no fake value sizes"
    return None
