"""autoshard's own ranges in a torch.profiler trace (stage, microbatch, collective, gather), only while
``program.profile`` records: otherwise ``span`` costs one flag test."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["set_recording", "span"]

_active = [False]


def set_recording(on: bool) -> None:
    """Turn the ranges on or off (program.profile does, around the steps it records)."""
    _active[0] = on


def span(name: str) -> contextlib.AbstractContextManager:
    """A named range ``autoshard.<name>`` in the trace while recording; nothing otherwise."""
    if not _active[0]:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"autoshard.{name}")
