"""torch.compile for the rank graphs: the request (backend and options), checked at compile, before any rank
communicates; a model that is already ``torch.compile``d is unwrapped and its request carried over.

``autoshard.compile(model, mesh, ..., torch_compile=True)`` compiles each rank's graph (each pipeline
stage's graph) with inductor; ``backend="aot_eager"`` (or any registered torch.compile backend) picks
another. ``torch.compile(model)`` handed to ``autoshard.compile`` is the same request: autoshard
captures the original module (its parameter names without ``_orig_mod.``) and compiles its own graphs
with the backend, options, ``dynamic`` and ``fullgraph`` the user gave torch.compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.errors import DistributedError, PlanError

__all__ = ["TorchCompile", "check_devices", "check_toolchain", "resolve"]

OWN_PASSES = ("inductor", "aot_eager")  # backends whose forward and backward graphs autoshard's passes rewrite


@dataclass(frozen=True)
class TorchCompile:
    """How each rank graph is compiled: torch.compile's backend and its options."""

    backend: str | Callable[..., Any] = "inductor"
    options: tuple[tuple[str, Any], ...] = ()  # the backend's options (inductor: config patches)
    dynamic: bool | None = False  # the rank graphs' sizes are fixed per batch shape; False: no symbolic sizes
    fullgraph: bool = False
    origin: str = "compile(torch_compile=True)"

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")

    @property
    def rewrites_graphs(self) -> bool:
        """Whether autoshard's passes see the forward and backward graphs (bucketed reductions, late waits)."""
        return self.backend in OWN_PASSES

    @property
    def fuses_pointwise(self) -> bool:
        """Whether the backend fuses pointwise work (inductor): then the optimizer's update, which is pointwise
        work outside the graphs, runs on torch's fused kernel where the user left that choice open."""
        return self.backend == "inductor"

    def __str__(self) -> str:
        extra = [f"{k}={v!r}" for k, v in self.options]
        extra += [f"dynamic={self.dynamic}"] if self.dynamic is not False else []
        extra += ["fullgraph=True"] if self.fullgraph else []
        return f"torch.compile(backend={self.backend_name}{''.join(', ' + e for e in extra)}) from {self.origin}"


def _carried(model: nn.Module) -> tuple[nn.Module, TorchCompile]:
    """The module inside ``torch.compile(module)`` and the request it was compiled with."""
    ctx = model.dynamo_ctx
    wrapper = getattr(ctx.callback, "_torchdynamo_orig_backend", None)
    inner = getattr(wrapper, "_torchdynamo_orig_backend", wrapper)
    name = getattr(wrapper, "_compiler_name", None) or getattr(inner, "compiler_name", None)
    backend: str | Callable[..., Any] = name if isinstance(name, str) else getattr(inner, "compiler_fn", inner)
    if isinstance(backend, str) and backend not in _known_backends():
        backend = getattr(inner, "compiler_fn", backend)  # a callable of the user's, named after itself
    options = getattr(inner, "config", None) or getattr(inner, "kwargs", None) or {}
    dynamic = getattr(inner, "dynamic", None)
    request = TorchCompile(
        backend=backend,
        options=tuple(sorted(dict(options).items())),
        dynamic=False if dynamic is None else dynamic,
        fullgraph=bool(ctx.fullgraph),
        origin="torch.compile(model)",
    )
    return model._orig_mod, request


def _known_backends() -> list[str]:
    import torch._dynamo

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | set(OWN_PASSES))


def resolve(
    model: nn.Module, torch_compile: bool | None, backend: str | Callable[..., Any] | None
) -> tuple[nn.Module, TorchCompile | None]:
    """The module to capture and the compile request (None: the rank graphs run eagerly)."""
    if torch_compile is not None and not isinstance(torch_compile, bool):
        raise PlanError(f"torch_compile={torch_compile!r} must be True, False or None (None: as the model)")
    carried = None
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):  # torch.compile(model)
        model, carried = _carried(model)
        if torch_compile is False:
            raise PlanError(
                f"the model was compiled with {carried} but compile(..., torch_compile=False) asks for eager rank "
                f"graphs; pass model._orig_mod to train eagerly, or drop torch_compile=False to compile each rank's "
                f"graph the same way"
            )
        if backend is not None and backend != carried.backend:
            raise PlanError(
                f"the model was compiled with backend {carried.backend_name!r} but compile(..., backend={backend!r}) "
                f"asks for another; pass model._orig_mod with backend={backend!r}, or drop backend="
            )
    if carried is not None:
        request = carried
    elif torch_compile or (torch_compile is None and backend is not None):
        request = TorchCompile(backend=backend if backend is not None else "inductor")
    else:
        if backend is not None:
            raise PlanError(f"backend={backend!r} compiles the rank graphs, but torch_compile=False; drop one of them")
        return model, None
    _check_backend(request)
    return model, request


def _check_backend(request: TorchCompile) -> None:
    backend = request.backend
    if callable(backend):
        return
    if not isinstance(backend, str) or backend not in _known_backends():
        raise PlanError(
            f"torch.compile backend {backend!r} does not exist; use one of {_known_backends()} "
            f"(autoshard rewrites the graphs of {list(OWN_PASSES)})"
        )


def check_toolchain(request: TorchCompile | None, device: torch.device) -> None:
    """Inductor on the CPU compiles C++ (a compiler and Python's headers); on CUDA it needs Triton."""
    if request is None or request.backend != "inductor":
        return
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise PlanError(
                "torch_compile=True with inductor on CUDA needs Triton, which this torch cannot import; "
                "pip install triton (the version your torch pins), or pass backend='aot_eager'"
            )
        return
    from torch._inductor import cpp_builder

    try:
        cxx = cpp_builder.get_cpp_compiler()
        subprocess.run([cxx, "--version"], check=True, capture_output=True, timeout=30)
    except Exception as error:  # noqa: BLE001 - any failure means no working compiler
        raise PlanError(
            f"torch_compile=True with inductor on the CPU compiles C++, but no working C++ compiler was found "
            f"({type(error).__name__}: {str(error).strip()[:120] or 'not found'}); install g++ (or set CXX), or pass "
            f"backend='aot_eager' (no code generation) or torch_compile=False"
        ) from error
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(headers):
        raise PlanError(
            f"torch_compile=True with inductor on the CPU compiles C++ against Python's headers, but {headers} is "
            f"missing; install the python3-dev package of this interpreter, or pass backend='aot_eager'"
        )
    if shutil.which("ld") is None:
        raise PlanError("torch_compile=True with inductor on the CPU links shared objects, but `ld` is missing")


def check_devices(model: nn.Module, backend_name: str) -> torch.device:
    """The device the rank's tensors live on, checked against the process group's backend."""
    if not isinstance(model, nn.Module):
        return torch.device("cpu")  # capture names what the model should be
    devices = {t.device for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"}
    if len(devices) > 1:
        raise DistributedError(
            f"the model's tensors are on several devices ({sorted(map(str, devices))}); every tensor of a rank "
            f"lives on its one device: model.to(device) before autoshard.compile"
        )
    device = next(iter(devices), torch.device("cpu"))
    if "nccl" in backend_name:
        if not torch.cuda.is_available():
            raise DistributedError(
                "the process group uses NCCL but this torch sees no CUDA device; use gloo on the CPU "
                "(init_process_group('gloo')), or run on a machine with GPUs"
            )
        if device.type != "cuda":
            raise DistributedError(
                f"the process group uses NCCL, which moves only CUDA tensors, but the model is on {device}; "
                f"model.to(torch.device('cuda', local_rank)) before autoshard.compile"
            )
    return device
