"""The kernels whose rate the calibration measures one by one, and which graph nodes run them.

The cost model counts an elementwise or reduction kernel as memory bound: the bytes it reads and writes over
``Hardware.memory_bandwidth``. A GPU's are. A CPU core's are not where each element takes transcendental
arithmetic or a random draw: one core of the development machine copied a 1 MiB tensor at 89 GB/s and
applied the erf GELU at 16, the tanh GELU at 4, softmax at 14 and drew a dropout mask at 0.7. On a CPU,
``Hardware.measure()`` times each kernel below, forward and backward, and keeps its rate in the cost
model's bytes (``Hardware.kernel_rates``); a node that runs one of them (``kernel_name``) is costed at that
rate, every other kernel at the memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["TIMED", "kernel_name"]

# name -> the forward on a [rows, width] tensor (the backward: autograd's of it)
TIMED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "exp": torch.exp,
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "dropout": lambda x: F.dropout(x, 0.1, training=True),
}

# aten ops that run one of them under another name (the rest are TIMED's names themselves)
_ALIASES = {
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "native_layer_norm": "layer_norm",
    "native_dropout": "dropout",
}


def kernel_name(node: fx.Node) -> str:
    """The name in ``TIMED`` of the kernel ``node`` runs ('' for any other): an aten op by its name, the GELU
    by its approximation, a dropout only where it draws a mask (training, p > 0)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return ""
    name = _ALIASES.get(target.overloadpacket.__name__, target.overloadpacket.__name__)
    if name not in TIMED:
        return ""
    if name == "gelu" and node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none") == "tanh":
        return "gelu_tanh"
    if name == "dropout":
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
        return name if p and train else ""
    return name
