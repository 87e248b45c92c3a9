"""Attention written out (q @ k^T -> scale -> + mask -> softmax -> dropout -> @ v) folded into one
``scaled_dot_product_attention`` node: context_parallel's helper (it splits attention it can see whole).

Reads:  autoshard.shape, autoshard.layer
Writes: autoshard.shape, autoshard.layer, autoshard.cost (no FLOPs of its own) on the nodes it inserts

The chain is Hugging Face's ``eager_attention_forward`` and what hand-written models do alike: a matmul of
the queries by the keys transposed over their last two dimensions, multiplications by constants (the scale),
additions of tensors computed without q and k (masks), a softmax over the keys (in a wider dtype or not),
casts, a dropout, and a matmul by the values. Every value in between must be read by the chain alone (an
``_assert_tensor_metadata`` check aside): the attention weights read elsewhere (returned, logged) stay as
written, and cp refuses them as an op that mixes tokens.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.ir.meta import LAYER, get_shape

from .infra import mark_inserted

__all__ = ["fold"]

aten = torch.ops.aten
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default)
_CHECK = aten._assert_tensor_metadata.default
_MATMUL = (aten.matmul.default,)


def _single_user(node: fx.Node) -> fx.Node | None:
    """The one reader of ``node`` besides metadata checks (None: none, or several)."""
    users = [u for u in node.users if u.target is not _CHECK]
    return users[0] if len(users) == 1 else None


def _keys(kt: object) -> fx.Node | None:
    """k, where ``kt`` is k transposed over its last two dimensions."""
    if not isinstance(kt, fx.Node) or kt.target is not aten.transpose.int:
        return None
    nd = len(get_shape(kt).tensor.sizes)
    return kt.args[0] if {d % nd for d in kt.args[1:3]} == {nd - 1, nd - 2} else None


def _reads_any(node: fx.Node, sources: set[fx.Node]) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def _chain(scores: fx.Node, q: fx.Node, k: fx.Node) -> tuple[float, list[fx.Node], float, fx.Node, list] | None:
    """(scale, masks, dropout, the final matmul, the nodes between) of the chain from ``scores``, or None."""
    scale, masks, dropout, between = 1.0, [], 0.0, []
    node, softmaxed = scores, False
    while True:
        user = _single_user(node)
        if user is None or user.op != "call_function":
            return None
        between.append(user)
        if not softmaxed and user.target in (aten.mul.Tensor, aten.div.Tensor) and user.args[0] is node:
            factor = user.args[1]
            if not isinstance(factor, (int, float)):
                return None
            scale = scale * factor if user.target is aten.mul.Tensor else scale / factor
        elif not softmaxed and user.target is aten.add.Tensor and node in user.args[:2]:
            mask = user.args[1] if user.args[0] is node else user.args[0]
            if not isinstance(mask, fx.Node) or _reads_any(mask, {q, k}):
                return None
            masks.append(mask)
        elif not softmaxed and user.target in _SOFTMAX and user.args[1] in (-1, len(get_shape(node).tensor.sizes) - 1):
            softmaxed = True
        elif user.target in _CASTS:
            pass
        elif softmaxed and user.target is aten.dropout.default:
            dropout = float(user.args[1]) if (user.args[2] if len(user.args) > 2 else True) else 0.0
        elif softmaxed and user.target in _MATMUL and user.args[0] is node:
            return scale, masks, dropout, user, between[:-1]
        else:
            return None
        node = user


def fold(gm: fx.GraphModule) -> list[str]:
    """Fold every written-out attention of ``gm`` into scaled_dot_product_attention; the names of the nodes
    folded (each final matmul, whose name the attention takes over)."""
    graph, folded = gm.graph, []
    for scores in list(graph.nodes):
        if scores.op != "call_function" or scores.target not in _MATMUL or scores not in graph.nodes:
            continue
        q, k = scores.args[0], _keys(scores.args[1])
        if k is None or not isinstance(q, fx.Node) or len(get_shape(q).tensor.sizes) != 4:
            continue
        found = _chain(scores, q, k)
        if found is None:
            continue
        scale, masks, dropout, final, between = found
        v = final.args[1]
        with graph.inserting_before(final):
            mask = masks[0] if masks else None
            for extra in masks[1:]:  # several masks add up to one
                mask = graph.call_function(operator.add, (mask, extra))
                mark_inserted(mask, get_shape(extra), final.meta.get(LAYER, "(top)"))
            attention = graph.call_function(
                aten.scaled_dot_product_attention.default, (q, k, v),
                {"attn_mask": mask, "dropout_p": dropout, "scale": float(scale)},
            )  # fmt: skip
        mark_inserted(attention, get_shape(final), final.meta.get(LAYER, "(top)"))
        final.replace_all_uses_with(attention)
        name = final.name
        for node in reversed([scores, *between, final]):
            for check in [u for u in node.users if u.target is _CHECK]:
                graph.erase_node(check)
            graph.erase_node(node)
        attention.name = name  # the attention takes the written-out result's name (verify, explain)
        folded.append(name)
    if folded:
        graph.lint()
        gm.recompile()
    return folded
