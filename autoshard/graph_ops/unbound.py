"""What a graph built for inspection holds in place of a rank's parallel group (tp, cp): its degree."""

from __future__ import annotations

from typing import Any

from torch import nn

from autoshard.errors import DistributedError

__all__ = ["UnboundGroup"]


class UnboundGroup(nn.Module):
    """A group's degree, and what the graph ops read of a rank's (its rank in the group, the group's name);
    running one needs a Program compiled under a process group. ``kind`` names the group in errors."""

    rank = 0
    kind = "parallel"

    def __init__(self, degree: int) -> None:
        super().__init__()
        self.degree = degree

    def _unbound(self, *_: Any) -> Any:
        raise DistributedError(
            f"this {self.kind} graph was built for inspection; run it through a Program compiled under a process group"
        )

    @property
    def group_name(self) -> str:
        """The process group's name, which the graph ops' functional collectives run on."""
        return self._unbound()
