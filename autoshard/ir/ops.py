"""The ATen op sets that passes and the runtime share, kept in one place.

Sharding rules have their own registry (autoshard.sharding); everything else that asks "is
this op a view", "does it draw random numbers" or "does it behave differently in training" reads
the sets here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

__all__ = [
    "ALIASING",
    "WRAPPERS",
    "GRAD_PATH_ELEMENTWISE",
    "RANDOM",
    "SHARD_PRESERVING",
    "TRAINING_ARGS",
    "attention_dropout",
    "packet",
    "returns_its_input",
    "runs",
    "storage_root",
]

aten = torch.ops.aten


def packet(target: object) -> object:
    """An overload's packet (``aten.view`` for ``aten.view.default``), or the target itself."""
    return getattr(target, "overloadpacket", target)


# Runtime functions that run an ATen op with context in front of its arguments (tp.sharded_random:
# the tp rank's own random stream; masks.dropout: a single-device mask): function -> how to read the op
# and its own arguments off the node's. Each runtime module registers its wrappers here.
WRAPPERS: dict[object, Callable[[tuple], tuple[object, tuple]]] = {}


# Runtime attention functions whose (batch, heads, tokens, dim) output is laid out token-major, as the fused
# kernels' is (graph_ops/ring_attention.py registers its own): swapping heads and tokens after them is a view.
TOKEN_MAJOR: set[object] = set()


def runs(node: fx.Node) -> tuple[object, tuple]:
    """The ATen op a call node runs and that op's arguments, looking through the runtime's wrappers."""
    unwrap = WRAPPERS.get(node.target)
    return unwrap(node.args) if unwrap is not None else (node.target, node.args)


# Op packets whose output aliases an input: they allocate no activation memory, and a parameter read
# through them is still that parameter (ZeRO-3's last use looks through them).
ALIASING = frozenset(
    {
        aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.transpose, aten.t,
        aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.chunk,
        aten.unbind, aten.alias, aten.detach, aten.as_strided, aten.unflatten, aten.flatten, aten.contiguous,
        aten.to, aten._assert_tensor_metadata, aten.sym_size,
    }
)  # fmt: skip

# Overloads a column shard passes through unchanged (the TP search walks back through them).
SHARD_PRESERVING = frozenset(
    {
        aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
        aten.permute.default, aten.unsqueeze.default, aten.expand.default, aten.slice.Tensor,
        aten.to.dtype, aten.to.dtype_layout, aten.contiguous.default, aten.clone.default,
    }
)  # fmt: skip

# Elementwise overloads on the gradient path between a linear and a value that wants it sharded.
GRAD_PATH_ELEMENTWISE = frozenset(
    {
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.cat.default,
        aten.dropout.default, aten.gelu.default, aten.silu.default, aten.tanh.default, aten.relu.default,
    }
)  # fmt: skip

# Overloads that draw random numbers (on sharded values each tp rank must draw its own).
RANDOM = frozenset(
    {
        aten.dropout.default, aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
        aten.rand_like.default, aten.randn_like.default, aten.scaled_dot_product_attention.default,
        aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default,
    }
)  # fmt: skip

# Overloads that behave differently in training: (argument index, name, its value in eval mode).
# Batch norm in training also updates its running statistics; in eval it reads them.
TRAINING_ARGS = {
    aten.dropout.default: (2, "train", False),
    aten.feature_dropout.default: (2, "train", False),
    aten.alpha_dropout.default: (2, "train", False),
    aten.feature_alpha_dropout.default: (2, "train", False),
    aten.native_dropout.default: (2, "train", False),
    aten.batch_norm.default: (5, "training", False),
    aten.instance_norm.default: (5, "use_input_stats", False),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
}


# What a value's storage is (the key of what autograd keeps: passes/saved_tensors.py).
_COPIES_IF_STRIDED = {aten.reshape, aten.contiguous, aten.flatten}
_SDPA = aten.scaled_dot_product_attention
_STRIDED = {aten.transpose, aten.permute, aten.expand, aten.t}


def storage_root(node: Any, dtypes: dict[fx.Node, torch.dtype] | None = None) -> Any:
    """The value whose storage ``node`` views: past aliasing ops to the op that made it, or to a reshape
    that had to copy (of a transposed or expanded tensor, as attention's outputs and repeated kv heads).
    ``dtypes``: run-time dtypes under autocast, where a ``to`` that changes the dtype copies."""
    chain = []
    for _ in range(64):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            break
        if packet(node.target) not in ALIASING and not returns_its_input(node):
            break
        if node.target is operator.getitem or not node.args or not isinstance(node.args[0], fx.Node):
            break
        if dtypes and packet(node.target) is aten.to and dtypes.get(node) != dtypes.get(node.args[0]):
            break
        chain.append(node)
        node = node.args[0]
    strided = [v for v in chain if packet(v.target) in _STRIDED]
    if strided and _heads_first(strided[-1], node):  # the first strided view of the value
        chain.remove(strided[-1])  # fused kernels lay their output out token-major: swapping heads is contiguous
    for index, view in enumerate(chain):
        if packet(view.target) in _COPIES_IF_STRIDED and any(packet(v.target) in _STRIDED for v in chain[index:]):
            return view
    return node


def _heads_first(view: fx.Node, base: Any) -> bool:
    """Whether ``view`` swaps a fused attention's (batch, heads, tokens, dim) output to tokens first: a view of
    memory the kernels (flash and memory-efficient, CPU and CUDA) write token-major."""
    if not (isinstance(base, fx.Node) and base.op == "call_function"):
        return False
    swap = packet(view.target) is aten.transpose and sorted(a % 4 for a in view.args[1:3]) == [1, 2]
    if base.target in TOKEN_MAJOR:
        return swap
    return packet(base.target) is _SDPA and swap and attention_dropout(base.args, base.kwargs) == 0.0


def attention_dropout(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """scaled_dot_product_attention's dropout_p, given by position or by name."""
    return args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)


_DROPOUTS = {aten.dropout, aten.feature_dropout, aten.alpha_dropout, aten.feature_alpha_dropout}


def returns_its_input(node: fx.Node) -> bool:
    """A dropout at p = 0 or outside training: aten returns its input itself (Dropout.cpp, ``_dropout``),
    keeping nothing and drawing nothing."""
    if node.op != "call_function" or packet(node.target) not in _DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return p == 0 or train is False
