"""Saved-tensor accounting: the bytes autograd keeps for backward, per layer and category, in B and S.

Reads:  autoshard.shape, autoshard.layer; autoshard.recompute on recompute region calls
Writes: autoshard.saved (meta.NodeSaves) on each call: the bytes it keeps for backward (not kept already)

What an ATen op keeps is asked of PyTorch itself: the op runs once on the meta device, its sizes
evaluated at two primes far from every model dimension (B = 1009, S = 1013), under
``torch.autograd.graph.saved_tensors_hooks``. A saved tensor that is one of the op's inputs or outputs
(or views their storage) keeps that value; a value kept by several ops counts once, at the size of
the tensor it views (a view of a fused QKV output keeps all of it). A tensor the op makes for itself
(a dropout mask, attention's log-sum-exp, a norm's statistics) gets its sizes back from the primes.
Parameters and graph inputs are not activations. A recompute region keeps only its inputs; the
saves of its own nodes are live only while its backward runs (``ActivationMemory.transient``). A matmul
whose saved input is made again (``recompute.input_recomputed``) keeps the producer's inputs instead.

Under autocast (the plan's ``autocast`` dtype) a value's bytes follow its dtype at run time, and an op that
autocast casts for keeps the cast copies of the inputs it saves (autoshard/ir/autocast.py).

Where kernels differ by device: scaled-dot-product attention without dropout runs the fused kernel
on CPU and CUDA (keeps q, k, v, the output and the log-sum-exp, and a boolean mask made additive in q's
dtype, its own copy each call; its output is token-major, so the usual transpose-and-reshape after it is a
view: autoshard.ir.ops.storage_root); with dropout on CPU the math path (the score matrices). Dropout keeps a
float mask on CPU and a one-byte mask on CUDA.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from autoshard.graph_ops import context as cp_ops
from autoshard.graph_ops import masks as mask_ops
from autoshard.graph_ops import pipeline, recompute, zero
from autoshard.graph_ops import tp as tp_ops
from autoshard.ir.autocast import cast_to, run_dtypes
from autoshard.ir.meta import LAYER, SAVED, SHAPE, NodeSaves, evaluate_expr, get_layer, get_shape
from autoshard.ir.ops import ALIASING, WRAPPERS, attention_dropout, packet, returns_its_input, runs, storage_root
from autoshard.sharding.matmul import matmul_dims

from .infra import CALLS, Need, Pass, PassResult

__all__ = ["PASS", "ActivationMemory", "LayerActivations", "activation", "node_saves", "run"]

aten = torch.ops.aten
PROBE = {"B": 1009, "S": 1013}

MATMUL = "matmul inputs"
ATTENTION = "attention"
DROPOUT = "dropout masks"
NORM = "norms"
POINTWISE = "pointwise"
LOSS = "embedding and loss"
REGION = "recompute inputs"

_NORMS = {aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten.group_norm, aten.batch_norm}
_DROPOUT = {aten.dropout, aten.native_dropout, aten.feature_dropout, aten.alpha_dropout}
_ATTENTION = {aten.scaled_dot_product_attention, aten._softmax, aten.softmax, aten._safe_softmax}
_LOSS = {aten.embedding, aten.cross_entropy_loss, aten.nll_loss_forward, aten._log_softmax, aten.log_softmax}
_SAVE_NOTHING = {
    tp_ops.all_reduce, tp_ops.copy, tp_ops.all_gather, tp_ops.scatter, tp_ops.reduce_scatter, tp_ops.gather_rs,
    zero.gather, zero.mark, pipeline.recv, pipeline.send, pipeline.size, operator.getitem,
}  # fmt: skip


@dataclass(frozen=True)
class LayerActivations:
    """The bytes one layer's nodes keep for backward, by category (expressions in B and S)."""

    layer: str
    by_category: dict[str, sympy.Expr]

    @property
    def total(self) -> sympy.Expr:
        return sympy.expand(sympy.Add(*self.by_category.values()))

    def evaluate(self, **sizes: int) -> dict[str, int]:
        """Bytes per category at these sizes."""
        return {category: evaluate_expr(expr, sizes) for category, expr in self.by_category.items()}


@dataclass(frozen=True)
class ActivationMemory:
    """What one graph keeps for backward per call: per layer, and the largest recompute region's own saves."""

    layers: tuple[LayerActivations, ...]
    transient: sympy.Expr = sympy.Integer(0)
    unaccounted: tuple[str, ...] = field(default=())  # ops whose saves could not be probed

    @property
    def kept(self) -> sympy.Expr:
        return sympy.expand(sympy.Add(*(layer.total for layer in self.layers)))

    def evaluate(self, **sizes: int) -> dict[str, int]:
        """Bytes per layer, "kept" and "transient", at these sizes (e.g. B=4, S=512)."""
        out = {layer.layer: evaluate_expr(layer.total, sizes) for layer in self.layers}
        return {**out, "kept": evaluate_expr(self.kept, sizes), "transient": evaluate_expr(self.transient, sizes)}


def _category(node: fx.Node) -> str:
    op, args = runs(node)  # through tp.sharded_random, masks.dropout, a zero-bubble matmul: the op they run
    target, dims = packet(op), matmul_dims(op)
    if dims is not None:
        return MATMUL if any(_is_weight(args[i]) for i in dims) else ATTENTION
    for names, category in ((_NORMS, NORM), (_DROPOUT, DROPOUT), (_ATTENTION, ATTENTION), (_LOSS, LOSS)):
        if target in names:
            return category
    if node.target in (tp_ops.vocab_parallel_embedding, tp_ops.vocab_parallel_cross_entropy):
        return LOSS
    return POINTWISE


def _is_weight(node: Any) -> bool:
    root = storage_root(node)
    if not isinstance(root, fx.Node):
        return False
    if root.op == "get_attr":
        return True
    return root.target is operator.getitem and getattr(root.args[0], "target", None) is zero.gather


def _is_activation(root: fx.Node, part: bool = False) -> bool:
    if part and root.op == "placeholder":  # a part cut out of a graph: inputs that need grad are activations
        return any(t is not None and t.requires_grad for t in get_shape(root).tensors)
    return root.op == "call_function" and not _is_weight(root) and get_shape(root).tensors != ()


def _probe_value(arg: Any, dtype: torch.dtype | None = None) -> Any:
    """A node argument at the probe sizes: a meta tensor (in ``dtype``, its dtype at run time under
    autocast, when given), an int, or the constant itself."""
    if not isinstance(arg, fx.Node):
        return arg
    shape = get_shape(arg)
    if shape.scalar is not None:
        return evaluate_expr(shape.scalar, PROBE)
    t = shape.tensor
    sizes = [evaluate_expr(s, PROBE) for s in t.sizes]
    grad = t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
    dtype = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
    return torch.empty(sizes, dtype=dtype, device="meta", requires_grad=grad)


def _dims_back(concrete: tuple[int, ...], known: list[sympy.Expr]) -> sympy.Expr:
    """Bytes-free numel of a tensor the op made, its sizes mapped back through the probe to expressions."""
    table: dict[int, sympy.Expr] = {}
    for a, b in itertools.product(known, repeat=2):
        table.setdefault(evaluate_expr(a * b, PROBE), a * b)
    for a in known:
        table[evaluate_expr(a, PROBE)] = a
    return sympy.Mul(*(table.get(d, sympy.Integer(d)) for d in concrete))


def _ops_saves(node: fx.Node, device_type: str, dtypes: Any = None) -> list[tuple[Any, sympy.Expr]] | None:
    """What ``node`` keeps: (input or own node, bytes) pairs; None when it cannot be probed. ``dtypes``:
    (run-time dtype of each value, the dtype autocast casts this op's inputs to), under autocast."""
    target = node.target
    if target is recompute.region:
        return [(a, get_shape(a).nbytes) for a in node.args[2:] if isinstance(a, fx.Node) and get_shape(a).tensors]
    if target in _SAVE_NOTHING or packet(target) in ALIASING or returns_its_input(node):
        return []
    if target is tp_ops.vocab_parallel_embedding:  # the ids and a one-byte mask of the ids this rank holds
        ids = node.args[2]
        return [(ids, 0), (("own", node, 0), get_shape(ids).tensor.numel)]
    if target is tp_ops.vocab_parallel_cross_entropy:  # the local softmax; the target, a row index, two masks
        logits, rows = get_shape(node.args[1]).tensor, get_shape(node.args[2]).tensor.numel
        return [(("own", node, 0), logits.nbytes), (node.args[2], 0), (("own", node, 1), rows * 10)]
    if target is cp_ops.ring_attention:  # q, k, v, the mask rows, the output, its log-sum-exp (fp32 at least)
        q, k, v = node.args[1:4]  # and the next rank's K/V block, where backward starts
        mask = node.args[4] if len(node.args) > 4 else node.kwargs.get("attn_mask")
        lse = sympy.Mul(*get_shape(q).tensor.sizes[:-1]) * 4
        kept = [(q, 0), (k, 0), (v, 0), *([(mask, 0)] if isinstance(mask, fx.Node) else []), (node, 0)]
        return [*kept, (("own", node, 0), lse), (("own", node, 1), get_shape(k).nbytes + get_shape(v).nbytes)]
    if target is cp_ops.all_to_all_attention:  # SDPA's saves, of its heads over every token: as many bytes
        q, k, v = (get_shape(t).tensor for t in node.args[1:4])
        mask = node.args[4] if len(node.args) > 4 else node.kwargs.get("attn_mask")
        lse = sympy.Mul(*q.sizes[:-1]) * 4
        own = [(("own", node, i), t.nbytes) for i, t in enumerate((q, k, v, q))]
        return [*own, *([(mask, 0)] if isinstance(mask, fx.Node) else []), (("own", node, 4), lse)]
    if target is recompute.input_recomputed:  # the matmul's saves but the value made again, and what makes it
        made, inputs = node.args[1], [*node.args[1].all_input_nodes]
        saves = _aten_saves(node, *runs(node), node.kwargs, device_type, dtypes)
        return [(v, b) for v, b in saves if not isinstance(v, fx.Node) or storage_root(v) is not made] + [
            (a, 0) for a in inputs
        ]
    if target is cp_ops.cross_entropy:  # as aten's, on this rank's tokens
        return _aten_saves(node, aten.cross_entropy_loss.default, node.args[1:], node.kwargs, device_type, dtypes)
    if target in (cp_ops.local_tokens, cp_ops.all_reduce, cp_ops.replica_mean):  # an index, or nothing
        return []
    if target is mask_ops.dropout:  # x * mask: the single-device mask, in x's dtype
        return [(("own", node, 0), get_shape(node).nbytes)] if get_shape(node.args[2]).requires_grad else []
    if target in WRAPPERS:  # the wrapped op, as if called directly
        return _aten_saves(node, *runs(node), node.kwargs, device_type, dtypes)
    if not isinstance(target, torch._ops.OpOverload):
        return [] if get_shape(node).scalar is not None else None  # arithmetic on sizes keeps nothing
    return _aten_saves(node, target, node.args, node.kwargs, device_type, dtypes)


def _aten_saves(
    node: fx.Node, op: Any, args: Any, kwargs: Any, device_type: str, dtypes: Any = None
) -> list[tuple[Any, sympy.Expr]]:
    flat_args: list[fx.Node] = []
    fx.node.map_arg((args, kwargs), lambda a: flat_args.append(a))
    shapes = [get_shape(a) for a in flat_args]
    if not any(s.scalar is None and any(t is not None and t.requires_grad for t in s.tensors) for s in shapes):
        return []  # nothing needs a gradient: autograd records nothing
    out_shape = get_shape(node)
    if packet(op) is aten.scaled_dot_product_attention:
        dropout = attention_dropout(args, kwargs)
        if dropout == 0.0 or device_type == "cuda":  # the fused kernel: q, k, v, a mask, output, log-sum-exp
            q = args[0]
            lse = sympy.Mul(*get_shape(q).tensor.sizes[:-1]) * 4
            mask = [(args[3], 0)] if len(args) > 3 and isinstance(args[3], fx.Node) else []
            if mask and get_shape(args[3]).tensor.dtype == torch.bool:  # it keeps the mask made additive, in q's dtype
                mask = [(("own", node, 3), get_shape(args[3]).tensor.numel * get_shape(q).tensor.dtype.itemsize)]
            return [(args[0], 0), (args[1], 0), (args[2], 0), *mask, (node, 0), (("own", node, 0), lse)]
    if packet(op) in _DROPOUT and device_type == "cuda":
        return [(("own", node, 0), get_shape(args[0]).tensor.numel)]  # a one-byte mask
    run, cast = dtypes if dtypes is not None else ({}, None)
    # The meta tensors the op gets (a saved input is one), in the dtypes it gets them in at run time.
    probed = {a: _probe_value(a, cast or run.get(a)) for a in flat_args}
    probe_args = fx.node.map_arg(args, probed.__getitem__)
    probe_kwargs = fx.node.map_arg(kwargs, probed.__getitem__)
    tensors = [(a, v) for a, v in probed.items() if isinstance(v, torch.Tensor)]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = op(*probe_args, **probe_kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    known = [s for sh in [*shapes, out_shape] for t in sh.tensors if t is not None for s in t.sizes]
    result, own = [], set()
    for index, t in enumerate(saved):
        storage = t.untyped_storage()._cdata
        owner = next((a for a, v in tensors if v is t or v.untyped_storage()._cdata == storage), None)
        if owner is None and any(o is t or o.untyped_storage()._cdata == storage for o in outs):
            owner = node
        if owner is None and storage not in own:  # one the op made (saved twice, as log-softmax is, once)
            own.add(storage)
            nbytes = _dims_back(tuple(t.shape), known) * t.element_size()
            result.append((("own", node, index), nbytes))
        elif owner is None:
            continue
        else:
            result.append((owner, 0))
    return result


def _run_nbytes(root: fx.Node, dtypes: dict[fx.Node, torch.dtype]) -> sympy.Expr:
    """A value's bytes at run time (under autocast, in its run-time dtype)."""
    shape = get_shape(root)
    if root in dtypes and len(shape.tensors) == 1 and shape.tensors[0] is not None:
        return shape.tensors[0].numel * torch.empty((), dtype=dtypes[root], device="meta").element_size()
    return shape.nbytes


def _cast_copy(node: fx.Node, value: Any, device_type: str, autocast: torch.dtype | None, dtypes: dict) -> tuple | None:
    """Under autocast: (key, bytes) of the cast copy of input ``value`` that ``node`` saves, or None."""
    cast = cast_to(runs(node)[0], device_type, autocast) if autocast is not None else None
    if cast is None or not isinstance(value, fx.Node) or value is node:
        return None
    root = storage_root(value, dtypes)
    run = dtypes.get(root)
    if not isinstance(root, fx.Node) or run is None or not run.is_floating_point or run == cast:
        return None
    numel = get_shape(root).tensors[0].numel
    # autocast caches a weight's cast for the forward; an activation is cast again by each op that casts it
    key = ("cast", root, cast) if _is_weight(root) else ("cast", node, root, cast)
    return key, numel * torch.empty((), dtype=cast, device="meta").element_size()


def node_saves(
    gm: fx.GraphModule, device_type: str, part: bool = False, autocast: torch.dtype | None = None, shards: int = 1
) -> dict[fx.Node, list[tuple[Any, sympy.Expr]] | None]:
    """Per call, what it keeps for backward as (key, bytes) pairs, a value's key the same wherever it is kept
    (its root node, or the op's own tensor); None for an op the meta device cannot run. ``shards``: a part's
    inputs arrive as that many sequence shards (``run``)."""
    out: dict[fx.Node, list[tuple[Any, sympy.Expr]] | None] = {}
    dtypes = run_dtypes(gm, device_type, autocast) if autocast is not None else {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        try:
            cast = cast_to(runs(node)[0], device_type, autocast) if autocast is not None else None
            saves = _ops_saves(node, device_type, (dtypes, cast) if autocast is not None else None)
        except Exception:  # noqa: BLE001 - an op the meta device cannot run: reported, not guessed
            saves = None
        if saves is None:
            out[node] = None
            continue
        pairs = []
        for value, nbytes in saves:
            copy = _cast_copy(node, value, device_type, autocast, dtypes)
            if copy is not None:
                pairs.append(copy)
            elif isinstance(value, tuple):  # the op's own tensor
                pairs.append((value, nbytes))
            else:
                kept = activation(value, part, dtypes, shards)
                pairs += [kept] if kept is not None else []
        out[node] = pairs
    return out


def activation(
    value: Any, part: bool = False, dtypes: dict[fx.Node, torch.dtype] | None = None, shards: int = 1
) -> tuple | None:
    """(key, bytes) of the activation that keeping ``value`` keeps (the value it views), or None (a weight)."""
    root = storage_root(value, dtypes)
    if not isinstance(root, fx.Node) or not _is_activation(root, part):
        return None
    nbytes = _run_nbytes(root, dtypes or {})
    return root, nbytes / shards if root.op == "placeholder" else nbytes


def _account(
    gm: fx.GraphModule, device_type: str, part: bool = False, autocast: torch.dtype | None = None, shards: int = 1
) -> tuple[dict[str, dict[str, sympy.Expr]], list[str]]:
    """Per layer and category, the bytes ``gm``'s nodes keep (each value once, in its first saver's layer)."""
    layers: dict[str, dict[str, sympy.Expr]] = {}
    counted: set[Any] = set()
    unaccounted: list[str] = []
    for node, saves in node_saves(gm, device_type, part, autocast, shards).items():
        if saves is None:
            unaccounted.append(str(node.target))
            node.meta[SAVED] = NodeSaves(POINTWISE, sympy.Integer(0), probed=False)
            continue
        category = REGION if node.target is recompute.region else _category(node)
        before = layers.get(get_layer(node), {}).get(category, sympy.Integer(0))
        for key, size in saves:
            if key in counted:
                continue
            counted.add(key)
            per = layers.setdefault(get_layer(node), {})
            per[category] = sympy.expand(per.get(category, 0) + size)
        after = layers.get(get_layer(node), {}).get(category, sympy.Integer(0))
        node.meta[SAVED] = NodeSaves(category, sympy.expand(after - before))
    return layers, unaccounted


def run(
    gm: fx.GraphModule,
    device_type: str = "cpu",
    part: bool = False,
    autocast: torch.dtype | None = None,
    shards: int = 1,
) -> PassResult:
    """The value: this graph's ActivationMemory. ``device_type``: "cpu" or "cuda" (kernels differ, above).
    ``part``: ``gm`` is a part cut out of a model's graph (the planner's profile): its placeholders that
    need grad are the previous part's activations, kept like any other. ``autocast``: the dtype the graph
    runs under torch.autocast in (None: as captured). ``shards``: with sequence parallelism a part's inputs
    are the previous part's hidden state handed on in sequence shards (as the program runs it): a rank keeps
    1/shards of what the part, profiled reading them whole, shows."""
    layers, unaccounted = _account(gm, device_type, part, autocast, shards)
    transient: sympy.Expr = sympy.Integer(0)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is recompute.region:
            inner, more = _account(getattr(gm, node.args[0].target), device_type, part, autocast)
            unaccounted += more
            total = sympy.expand(sympy.Add(*(e for per in inner.values() for e in per.values())))
            transient = sympy.Max(transient, total) if transient != 0 else total
    memory = ActivationMemory(
        tuple(LayerActivations(name, per) for name, per in layers.items()), transient, tuple(sorted(set(unaccounted)))
    )
    summary = f"saved for backward per call: {memory.kept} bytes kept"
    if transient != 0:
        summary += f", {transient} while the largest region recomputes"
    if unaccounted:
        summary += f"; not probed: {', '.join(memory.unaccounted)}"
    return PassResult("saved_tensors", False, summary, value=memory)


PASS = Pass("saved_tensors", reads=(Need(SHAPE), Need(LAYER)), writes=(Need(SAVED, CALLS),), run=run)
