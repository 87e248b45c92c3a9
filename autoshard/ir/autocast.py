"""What torch.autocast does to a captured graph's dtypes, for the memory accounting.

A graph is captured in the model's dtype and runs under ``torch.autocast(device, low)`` when the plan
asks for it: each ATen op the graph calls is dispatched through autocast, which casts the floating
inputs of matmul-like ops to ``low`` (their outputs are ``low``), of numerically sensitive ops to fp32,
and leaves the rest to type promotion. So a value's bytes at run time follow its dtype there, and an
op autocast casts for keeps the cast copies of the inputs it saves (a weight's copy once per forward:
autocast caches the casts of leaf tensors; an activation's once per op that casts it).

The op lists are the dispatcher's (aten/src/ATen/autocast_mode.cpp), the subset a model graph meets:
they differ between CPU and CUDA (CUDA also runs norms, softmax and exp-like ops in fp32).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autoshard.ir.meta import get_shape
from autoshard.ir.ops import ALIASING, packet, runs

__all__ = ["cast_to", "run_dtypes"]

aten = torch.ops.aten

_LOW_BOTH = {
    aten.mm, aten.bmm, aten.addmm, aten.addbmm, aten.baddbmm, aten.linear, aten.matmul, aten.conv1d, aten.conv2d,
    aten.conv3d, aten.convolution, aten._convolution, aten.conv_transpose1d, aten.conv_transpose2d,
    aten.conv_transpose3d, aten.prelu, aten.scaled_dot_product_attention,
}  # fmt: skip
LOW = {"cpu": _LOW_BOTH, "cuda": _LOW_BOTH | {aten.addmv, aten.addr, aten.einsum, aten.mv, aten.chain_matmul}}
_FP32_BOTH = {
    aten.mse_loss, aten.nll_loss, aten.nll_loss2d, aten.nll_loss_forward, aten.cross_entropy_loss, aten.l1_loss,
    aten.smooth_l1_loss, aten.huber_loss, aten.kl_div, aten.binary_cross_entropy_with_logits, aten.cdist,
    aten.prod, aten.poisson_nll_loss, aten.cosine_embedding_loss, aten.margin_ranking_loss,
}  # fmt: skip
FP32 = {
    "cpu": _FP32_BOTH,
    "cuda": _FP32_BOTH | {
        aten.acos, aten.asin, aten.cosh, aten.erfinv, aten.exp, aten.expm1, aten.log, aten.log10, aten.log2,
        aten.log1p, aten.reciprocal, aten.rsqrt, aten.sinh, aten.tan, aten.pow, aten.softplus, aten.layer_norm,
        aten.native_layer_norm, aten.group_norm, aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax,
        aten.cumsum, aten.cumprod, aten.sum, aten.logsumexp, aten.linalg_vector_norm, aten.norm, aten.dist,
        aten.cosine_similarity, aten.renorm, aten.rms_norm,
    },
}  # fmt: skip
_CASTS = {aten._to_copy, aten.to, aten.type_as}  # explicit conversions the model wrote: their dtype stands


def cast_to(op: object, device_type: str, low: torch.dtype) -> torch.dtype | None:
    """The dtype autocast casts ``op``'s floating inputs to (None: it casts nothing)."""
    target = packet(op)
    if target in LOW[device_type]:
        return low
    if target in FP32[device_type]:
        return torch.float32
    return None


def _widest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    floating = [d for d in dtypes if d.is_floating_point]
    if not floating:
        return None
    out = floating[0]
    for d in floating[1:]:
        out = torch.promote_types(out, d)
    return out


def run_dtypes(gm: fx.GraphModule, device_type: str, low: torch.dtype) -> dict[fx.Node, torch.dtype]:
    """Each floating tensor value's dtype when ``gm`` runs under autocast to ``low`` (captured in fp32 or
    another dtype). Integer and boolean values, and values autocast leaves alone, keep their dtype."""
    dtypes: dict[fx.Node, torch.dtype] = {}
    for node in gm.graph.nodes:
        shape = get_shape(node) if node.op != "output" else None
        tensors = [t for t in shape.tensors if t is not None] if shape is not None else []
        if not tensors:
            continue
        captured = tensors[0].dtype
        if node.op != "call_function" or not captured.is_floating_point:
            dtypes[node] = captured
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            dtypes[node] = dtypes.get(parent, captured) if isinstance(parent, fx.Node) else captured
            continue
        op, args = runs(node)
        inputs = [dtypes.get(a, t.dtype) for a, t in _tensor_args(args, node.kwargs)]
        cast = cast_to(op, device_type, low)
        if cast is not None:
            dtypes[node] = cast
        elif packet(op) in _CASTS:
            dtypes[node] = captured  # the model's own conversion (a loss's .float()): it converts at run time too
        elif packet(op) in ALIASING:
            dtypes[node] = inputs[0] if inputs else captured
        else:  # type promotion among the floating inputs (a residual add of a bf16 matmul and fp32 stream: fp32)
            dtypes[node] = _widest(inputs) or captured
    return dtypes


def _tensor_args(args: tuple, kwargs: dict) -> list[tuple[fx.Node, Any]]:
    """(node, its first tensor's shape) of each tensor argument."""
    nodes: list[fx.Node] = []
    fx.node.map_arg((args, kwargs), lambda a: nodes.append(a))
    out = []
    for a in nodes:
        shape = get_shape(a)
        first = next((t for t in shape.tensors if t is not None), None) if shape.scalar is None else None
        if first is not None:
            out.append((a, first))
    return out
