"""Capture: the model and its loss as one torch.export graph in ATen training IR, batch dimension dynamic.

The captured graph takes flat tensors (positional inputs, tensor keyword inputs, target leaves) and
returns ``(loss, *model output tensors)``. Parameters stay ``get_attr`` nodes under their original
names, prefixed ``model.``.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from autoshard.capture.blocks import TRACED, RepeatedBlocks, find_repeated_blocks, trace_stamped
from autoshard.capture.call import CallSpec, normalize_inputs, split_kwargs
from autoshard.capture.regions import inline_grad_regions, recording_checkpoints
from autoshard.errors import AutoshardError, CaptureError, InputError, first_line
from autoshard.ir.meta import MODEL_ATTR

__all__ = ["CallSpec", "Captured", "capture"]

_MAX_DIM = 1 << 20


@dataclass
class Captured:
    """A captured training graph and what the compiler needs to know about it."""

    gm: fx.GraphModule
    call: CallSpec
    rename: dict[sympy.Symbol, sympy.Symbol]
    example_sizes: dict[str, int]
    state_keys: tuple[str, ...]
    model_name: str
    seconds: float
    stamped_blocks: RepeatedBlocks | None = None  # traced two and three deep, the others stamped

    def __str__(self) -> str:
        how = ""
        if self.stamped_blocks is not None:
            blocks = self.stamped_blocks
            depths = " and ".join(map(str, TRACED))
            how = f" ({blocks.path} traced {depths} blocks deep, stamped to all {blocks.count})"
        return f"{self.model_name} in {self.seconds:.2f}s{how}: {len(self.gm.graph.nodes)} nodes"


def _extract_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise InputError(
        f"loss_fn is None, so the model must return the loss (a scalar tensor, an output with .loss, "
        f"or a tuple whose first element is the loss), but it returned {type(out).__name__}; "
        f"pass loss_fn=callable(outputs, target) and example_target=..."
    )


class _ModelWithLoss(nn.Module):
    """The module torch.export traces: flat tensors in, (loss, *output tensors) out."""

    def __init__(self, model: nn.Module, loss_fn: Any, call: CallSpec, record: Callable[..., None]) -> None:
        super().__init__()
        self.add_module(MODEL_ATTR, model)
        self.loss_fn = loss_fn
        self.call = call
        # Called while torch.export traces forward; a callback because export restores module attributes.
        self.record = record

    def forward(self, flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        call = self.call
        args = flat[: call.n_args]
        kwargs = dict(zip(call.tensor_kwargs, flat[call.n_args : call.n_inputs]))
        out = getattr(self, MODEL_ATTR)(*args, **kwargs, **call.const_kwargs)
        if self.loss_fn is None:
            loss = _extract_loss(out)
        else:
            target = pytree.tree_unflatten(list(flat[call.n_inputs :]), call.target_spec)
            loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
            got = (
                f"a {loss.dim()}-d {str(loss.dtype).removeprefix('torch.')} tensor"
                if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}"
            )
            if self.loss_fn is None:
                raise InputError(
                    f"loss_fn is None, so the model's output is taken as the loss, but it is {got}, not a "
                    f"floating-point scalar; return the loss from the model, or pass loss_fn=callable(outputs, "
                    f"target) and example_target=..."
                )
            raise InputError(
                f"the loss must be a floating-point scalar tensor, got {got}; reduce it with .mean() or .sum() "
                f"in loss_fn"
            )
        leaves, spec = pytree.tree_flatten(out)
        self.record(output_spec=spec, output_is_tensor=tuple(isinstance(x, torch.Tensor) for x in leaves))
        return (loss.reshape(()), *[x for x in leaves if isinstance(x, torch.Tensor)])


def _user_frame(err: BaseException) -> str | None:
    """The innermost traceback frame outside torch and autoshard: the model's failing line."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    found = None
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        for frame in traceback.extract_tb(err.__traceback__):
            name = frame.filename
            if name.startswith(skip) or name.startswith("<") or "/importlib/" in name:
                continue
            if "contextlib.py" in name or "functools.py" in name:
                continue
            found = f'File "{name}", line {frame.lineno}, in {frame.name}: {(frame.line or "").strip()}'
        err = err.__cause__ or err.__context__
    return found


def _autoshard_error_in_chain(err: BaseException) -> AutoshardError | None:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, AutoshardError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _dynamic_shapes(flat: list[torch.Tensor], batch: int, seq: int | None) -> tuple[Any, ...]:
    batch_dim = Dim("B", min=2, max=_MAX_DIM)
    # The sequence may be bounded (position tables) or even fixed by the model: let export infer it.
    seq_dim = Dim.AUTO if seq is not None else None
    specs = []
    for t in flat:
        spec: dict[int, Any] = {}
        if t.dim() >= 1 and t.shape[0] == batch:
            spec[0] = batch_dim
        if seq_dim is not None and t.dim() >= 2 and t.shape[1] == seq:
            spec[1] = seq_dim
        specs.append(spec or None)
    return (tuple(specs),)


def _strip_export_wrapping(ep_module: fx.GraphModule, name: str = "the model") -> fx.GraphModule:
    """Plain flat calling convention: no pytree codegen, no input guards, no grad-mode regions."""
    graph = ep_module.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    graph._codegen = fx.graph.CodeGen()
    gm = fx.GraphModule(ep_module, graph, class_name="CapturedTrainingGraph")
    inline_grad_regions(gm, name)
    gm.graph.lint()
    gm.recompile()
    return gm


def _trace(
    model: nn.Module, loss_fn: Any, call: CallSpec, flat: list[torch.Tensor], batch: int, seq: int | None
) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    """One torch.export trace of the model and its loss: the graph, and (the sequence length kept
    dynamic or None, the output's structure)."""
    traced: dict[str, Any] = {}
    wrapper = _ModelWithLoss(model, loss_fn, call, traced.update)
    name = type(model).__name__
    attempts = [seq, None] if seq is not None else [None]
    ep = None
    error: BaseException | None = None
    for seq_attempt in attempts:
        try:
            with recording_checkpoints():
                ep = torch.export.export(
                    wrapper, (tuple(flat),), dynamic_shapes=_dynamic_shapes(flat, batch, seq_attempt), strict=False
                )
            seq = seq_attempt
            break
        except Exception as err:  # noqa: BLE001 - reported below with the model's failing line
            own = _autoshard_error_in_chain(err)
            if own is not None:
                raise own from None
            error = err
    if ep is None:
        assert error is not None
        summary = first_line(error, 400)
        where = _user_frame(error) or "(no frame of the model's own code in the traceback)"
        experts = ""
        if getattr(getattr(model, "config", None), "_experts_implementation", None) == "eager":
            # transformers' "eager" experts loop over the experts a batch routes to: a data-dependent loop
            experts = (
                "\n  this model's experts run transformers' 'eager' implementation, a Python loop over the "
                "experts the batch routes to, which no trace can hold: build it with "
                "experts_implementation='grouped_mm' (transformers' default), which runs the same experts as "
                "grouped matmuls"
            )
        raise CaptureError(
            f"autoshard could not capture {name} with torch.export (non-strict, batch dimension dynamic): "
            f"{type(error).__name__}: {summary}\n  failing source: {where}{experts}\n"
            f"  try: make data-dependent Python control flow tensor-free (torch.where, torch.cond), pass "
            f"constant arguments through example_kwargs (e.g. use_cache=False for HF models), and check "
            f"that the model runs eagerly on example_inputs"
        ) from error
    gm = _strip_export_wrapping(ep.module(), name)
    return gm, (seq, traced["output_spec"], traced["output_is_tensor"])


def capture(
    model: nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Any = None,
    example_target: Any = None,
) -> Captured:
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = normalize_inputs(example_inputs)
    tensor_kwargs, const_kwargs = split_kwargs(example_kwargs)
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable(outputs, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if loss_fn is not None and example_target is None:
        raise InputError("loss_fn needs an example target to capture the loss: pass example_target=...")
    if loss_fn is None and example_target is not None:
        raise InputError("example_target is only used with loss_fn; pass loss_fn=callable(outputs, target)")
    target_leaves, target_spec = ([], None) if loss_fn is None else pytree.tree_flatten(example_target)
    for leaf in target_leaves:
        if not isinstance(leaf, torch.Tensor):
            raise InputError(f"example_target must hold tensors only, found one of type {type(leaf).__name__}")

    call = CallSpec(
        n_args=len(args),
        tensor_kwargs=tuple(tensor_kwargs),
        const_kwargs=const_kwargs,
        target_spec=target_spec,
    )
    flat = [*args, *tensor_kwargs.values(), *target_leaves]
    if args[0].dim() == 0:
        raise InputError("example_inputs[0] is a scalar; the first input must have a batch dimension (dim 0)")
    batch = args[0].shape[0]
    if batch == 1:
        # torch.export specializes size-1 dims; capture on two copies of the sample instead.
        flat = [torch.cat([t, t]) if t.dim() >= 1 and t.shape[0] == 1 else t for t in flat]
        batch = 2
    if any(p.is_meta for p in model.parameters()):
        # Planning without weights: inputs follow the model onto the meta device.
        flat = [t.to("meta") for t in flat]
    first = flat[0]
    seq = first.shape[1] if first.dim() >= 2 and not first.dtype.is_floating_point and first.shape[1] >= 2 else None

    name = type(model).__name__
    was_training = model.training
    model.train()
    start = time.perf_counter()
    trace = functools.partial(_trace, model, loss_fn, call, flat, batch, seq)
    params = list(model.parameters())
    # Weights on the meta device: the model only plans, so its repeated blocks may be traced once and stamped.
    blocks = find_repeated_blocks(model) if params and all(p.is_meta for p in params) else None
    try:
        stamped = trace_stamped(model, blocks, trace) if blocks is not None else None
        gm, (seq, output_spec, output_is_tensor) = stamped if stamped is not None else trace()
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start

    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = _dynamic_shapes(flat, batch, seq)[0]
    for node, spec in zip(placeholders, specs):
        for dim in spec or {}:
            size = node.meta["val"].shape[dim]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                rename[size.node.expr] = sympy.Symbol("B" if dim == 0 else "S", integer=True, positive=True)
    example_sizes = {"B": int(args[0].shape[0])}
    if seq is not None and any(sym.name == "S" for sym in rename.values()):
        example_sizes["S"] = int(seq)
    call = CallSpec(
        n_args=call.n_args,
        tensor_kwargs=call.tensor_kwargs,
        const_kwargs=call.const_kwargs,
        target_spec=call.target_spec,
        output_spec=output_spec,
        output_is_tensor=output_is_tensor,
    )
    return Captured(
        gm=gm,
        call=call,
        rename=rename,
        example_sizes=example_sizes,
        state_keys=tuple(model.state_dict(keep_vars=True).keys()),
        model_name=name,
        seconds=seconds,
        stamped_blocks=blocks if stamped is not None else None,
    )
