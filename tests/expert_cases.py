"""What the expert-parallel tests run on each rank (importable by the rank processes)."""

from __future__ import annotations

from typing import Any

from cases import build_case, compile_case, train_local_batches

import autoshard

EP_OPS = ("ep_counts", "ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad")


def exchanges_per_step(rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> dict:
    """The expert-parallel collectives of one training step, by op, and what this rank holds of the experts."""
    case = build_case(family, steps=1)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    program.comm.reset()
    train_local_batches(program, case, [], None)
    experts = {k: tuple(t.shape) for k, t in program.state_dict().items() if "experts" in k}
    return {"calls": {op: program.comm.calls[op] for op in EP_OPS}, "experts": experts}
