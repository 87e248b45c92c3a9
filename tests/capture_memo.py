"""Capture each suite model once per process: a test-suite speedup, not a library feature.

torch.export (B and S symbolic) is ~85% of compiling the suite's two-layer models, and the suite
compiles the same few architectures hundreds of times on every rank. A model built by
``cases.build_model`` carries its build arguments. When another model of the same build (class, repr,
configuration, state layout), example shapes and loss is captured in the same process, the first graph
is deep-copied and its parameters and buffers are rebound to the new model's tensors, which is what a
fresh capture returns: parameter values never enter the graph, they stay attributes under ``model.``.
Models not built by ``build_model``, and each build's first capture in a process, go through
torch.export as users' models do.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import autoshard.planner.api
from autoshard.capture import Captured, capture

BUILD_KEY = "_suite_build_key"  # set on the models cases.build_model returns
_memo: dict[tuple, Captured] = {}


def _signature(value: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(value)
    out = [str(spec)]
    first: dict[int, int] = {}  # a tensor passed twice (ids as labels) is captured as one input: part of the key
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            alias = first.setdefault(id(leaf), i)
            out.append((tuple(leaf.shape), leaf.dtype, leaf.device.type, leaf.requires_grad, alias))
        else:
            out.append(repr(leaf))
    return tuple(out)


def _key(model: nn.Module, *examples: Any) -> tuple | None:
    build = getattr(model, BUILD_KEY, None)
    if build is None:
        return None
    state = tuple(
        (name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad, isinstance(t, nn.Parameter))
        for name, t in model.state_dict(keep_vars=True).items()
    )
    config = (
        model.config.to_json_string() if hasattr(model, "config") and hasattr(model.config, "to_json_string") else ""
    )
    return (
        build,
        type(model),
        repr(model),
        config,
        state,
        _signature(examples[:2]),
        examples[2],
        _signature(examples[3]),
    )


def _rebound(captured: Captured, model: nn.Module) -> Captured:
    gm = copy.deepcopy(captured.gm)
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owner, _, leaf = f"model.{name}".rpartition(".")
        module = gm.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = tensor
        elif leaf in module._buffers:
            module._buffers[leaf] = tensor
        else:
            raise AssertionError(f"the memoized graph has no attribute model.{name}")
    return dataclasses.replace(captured, gm=gm, seconds=0.0)


def memoized_capture(
    model: nn.Module, example_inputs: Any, example_kwargs: Any = None, loss_fn: Any = None, example_target: Any = None
) -> Captured:
    key = _key(model, example_inputs, example_kwargs, loss_fn, example_target)
    if key is not None and key in _memo:
        return _rebound(_memo[key], model)
    captured = capture(model, example_inputs, example_kwargs, loss_fn, example_target)
    if key is not None:
        _memo[key] = dataclasses.replace(captured, gm=copy.deepcopy(captured.gm))  # compile's passes annotate its own
    return captured


def install() -> None:
    autoshard.planner.api.capture = memoized_capture
