"""Errors autoshard raises. Each message names the problem and the fix."""

from __future__ import annotations

__all__ = [
    "AutoshardError",
    "CaptureError",
    "CompileError",
    "DistributedError",
    "InputError",
    "MeshError",
    "MissingMetaError",
    "PlanError",
    "first_line",
]


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class MeshError(AutoshardError, ValueError):
    """A mesh whose degrees are invalid or do not match the world size."""


class PlanError(AutoshardError, ValueError):
    """A plan that is invalid, contradicts the mesh, or asks for something not implemented."""


class InputError(AutoshardError, TypeError):
    """Arguments of the wrong type or shape given to compile() or to a Program."""


class CaptureError(AutoshardError, RuntimeError):
    """The model (with its loss) could not be captured into a graph."""


class CompileError(AutoshardError, RuntimeError):
    """torch.compile did not compile what the program asked of it (its graphs would run eagerly)."""


class DistributedError(AutoshardError, RuntimeError):
    """The process group is missing or does not fit the program."""


class MissingMetaError(AutoshardError, LookupError):
    """A pass read a node.meta key that the pass producing it has not written."""


def first_line(error: BaseException, limit: int) -> str:
    """An exception's first line, at most ``limit`` characters, for a one-line message that quotes it; its type
    when it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
