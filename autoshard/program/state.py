"""Program's state and checkpoint methods (a mixin of autoshard.Program): state dicts, DCP checkpoints,
resume, export. They delegate to program/across_ranks.py and autoshard/checkpoint/ on this rank's runtime."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from autoshard import checkpoint
from autoshard.distributed.comm import is_comm_failure
from autoshard.errors import AutoshardError, DistributedError, first_line
from autoshard.program import across_ranks as state

F = TypeVar("F", bound=Callable[..., Any])


def collective(what: str) -> Callable[[F], F]:
    """A method every rank must call: a rank that does not leaves the others waiting in a collective until
    it exits or the timeout passes, and what they then see from the backend is said in these words."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def called(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except RuntimeError as error:
                if isinstance(error, AutoshardError) or not is_comm_failure(error):
                    raise
                first = first_line(error, 200)
                raise DistributedError(
                    f"{what} is a collective: every rank must call it, at the same point of the program; a rank "
                    f"that did not (or that failed) left this one waiting ({first})"
                ) from error

        return called  # type: ignore[return-value]

    return wrap


__all__ = ["StateMethods"]


class StateMethods:
    """Mixed into Program, which provides ``runtime``, ``compiled`` and ``_runtime(what)``."""

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors: the model's keys (with ZeRO-3: its flat shards, then the buffers)."""
        return state.local_state(self._runtime("state_dict()"))

    @collective("full_state_dict()")
    def full_state_dict(self, *, masters: bool = False) -> dict[str, torch.Tensor]:
        """On rank 0: the original model's keys and full shapes; elsewhere an empty dict. A collective: call it
        on every rank. ``masters=True``: the trainable parameters as their fp32 masters where the plan keeps
        them apart (bf16 parameters, offload), for a plan that computes in fp32 to load without rounding."""
        if self.runtime is None:
            return {k: v.detach().clone() for k, v in self.compiled.model.state_dict().items()}
        return state.full_state(self.runtime, masters)

    @collective("load_state_dict()")
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (the original model's keys) on every rank; each keeps its share. Values more
        precise than the parameters (fp32 into bf16) become the fp32 masters as they are."""
        state.load_full_state(self._runtime("load_state_dict()"), state_dict)

    # ---- checkpoints (autoshard/checkpoint/__init__.py) ------------------------------------------------
    @collective("save()")
    def save(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        """Each rank writes its shards, optimizer state and random state; ``extra`` (JSON data, e.g. an LR
        scheduler's state_dict()) comes back from ``load``. Atomic; call on every rank."""
        return checkpoint.save(self._runtime("save()"), path, extra)

    @collective("load()")
    def load(self, path: str | os.PathLike) -> dict | None:
        """Restore a checkpoint saved under any plan of the same model; returns its ``extra``. Every rank."""
        return checkpoint.load(self._runtime("load()"), path)

    @collective("resume()")
    def resume(self, directory: str | os.PathLike) -> Path | None:
        """Load the newest complete checkpoint under ``directory``, if any (every rank the same); its path or None."""
        return checkpoint.resume(self._runtime("resume()"), directory)

    @collective("save_full()")
    def save_full(self, path: str | os.PathLike, *, masters: bool = True) -> Path | None:
        """The consolidated model state as one safetensors file (rank 0 writes; every rank calls)."""
        return checkpoint.save_full(self._runtime("save_full()"), path, masters=masters)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""
        return self._runtime("steps").steps
