"""The ATen op sets that passes and the runtime share, kept in one place.

Sharding rules have their own registry (autoshard.sharding); everything else that asks "is
this op a view", "does it draw random numbers" or "does it behave differently in training" reads
the sets here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

__all__ = [
    "ALIASING",
    "WRAPPERS",
    "GRAD_PATH_ELEMENTWISE",
    "RANDOM",
    "SHARD_PRESERVING",
    "TRAINING_ARGS",
    "packet",
    "runs",
]

aten = torch.ops.aten


def packet(target: object) -> object:
    """An overload's packet (``aten.view`` for ``aten.view.default``), or the target itself."""
    return getattr(target, "overloadpacket", target)


# Runtime functions that run an ATen op with context in front of its arguments (tp.sharded_random:
# the tp rank's own random stream; masks.dropout: a single-device mask): function -> how to read the op
# and its own arguments off the node's. Each runtime module registers its wrappers here.
WRAPPERS: dict[object, Callable[[tuple], tuple[object, tuple]]] = {}


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
