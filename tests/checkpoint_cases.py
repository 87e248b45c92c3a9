"""Rank functions for the checkpoint tests: train, save, load in new processes, train on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from cases import adamw, build_case, train_local_batches

import autoshard


def _program(family: str, mesh: dict[str, int], plan: dict[str, Any], steps: int, **shape: Any):
    case = build_case(family, steps, **shape)
    optimizer = _optimizer(plan.pop("optimizer", "adamw"))
    timeout = plan.pop("timeout", 300.0)
    first = case.batches[0]
    program = autoshard.compile(
        case.model, autoshard.Mesh(**mesh), first.inputs, example_kwargs=first.kwargs, loss_fn=case.loss_fn,
        optimizer=optimizer or adamw, plan=plan, example_target=first.target, timeout=timeout,
    )  # fmt: skip
    return case, program


def _optimizer(name: str) -> Any:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return None  # the cases' AdamW


def _bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def train_straight(rank: int, world_size: int, family: str, mesh: dict, plan: dict, steps: int, **shape: Any) -> dict:
    """``steps`` steps in one go: the losses and the consolidated state (rank 0)."""
    case, program = _program(family, mesh, dict(plan), steps, **shape)
    losses, _ = train_local_batches(program, case)
    return {"losses": losses, "state": _bits(program.full_state_dict())}


def train_and_save(
    rank: int, world_size: int, family: str, mesh: dict, plan: dict, steps: int, first: int, path: str, **shape: Any
) -> dict:
    """The first ``first`` of ``steps`` batches, then a checkpoint at ``path`` with a data position in ``extra``."""
    case, program = _program(family, mesh, dict(plan), steps, **shape)
    case.batches = case.batches[:first]
    losses, _ = train_local_batches(program, case)
    program.save(path, extra={"next_batch": first, "note": "resume"})
    return {"losses": losses, "steps": program.steps}


def load_and_train(
    rank: int, world_size: int, family: str, mesh: dict, plan: dict, steps: int, path: str, **shape: Any
) -> dict:
    """A new program (its generators moved on, as in a new process), loaded from ``path``, trains the rest."""
    case, program = _program(family, mesh, dict(plan), steps, **shape)
    torch.manual_seed(1234 + rank)  # nothing of this process's random state may leak into the resumed run
    extra = program.load(path)
    case.batches = case.batches[extra["next_batch"] :]
    loaded_steps = program.steps
    losses, _ = train_local_batches(program, case)
    return {"losses": losses, "state": _bits(program.full_state_dict()), "extra": extra, "steps": loaded_steps}


def load_errors(rank: int, world_size: int, family: str, mesh: dict, plan: dict, paths: list[str]) -> list[dict]:
    """Load each of ``paths``, all of which should be refused: the message, and whether the program's
    parameters, optimizer state and step count stayed as they were."""
    case, program = _program(family, mesh, dict(plan), 2)
    train_local_batches(program, case)
    before = _bits(program.full_state_dict())
    opt_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in program.optimizer.state.items()}
    out = []
    for path in paths:
        try:
            program.load(path)
            message = ""
        except autoshard.InputError as error:
            message = str(error)
        after = program.full_state_dict()
        unchanged = all(torch.equal(after[k], v) for k, v in before.items()) and program.steps == 2
        for p, state in program.optimizer.state.items():
            unchanged &= all(torch.equal(v, opt_before[id(p)][k]) for k, v in state.items())
        out.append({"message": message, "unchanged": bool(unchanged)})
    return out


def save_errors(rank: int, world_size: int, family: str, mesh: dict, attempts: list[tuple[str, Any]]) -> list[str]:
    """``save(path, extra)`` for each attempt, all of which should be refused: the messages."""
    _, program = _program(family, mesh, {}, 1)
    messages = []
    for path, extra in attempts:
        try:
            program.save(path, extra=extra)
            messages.append("")
        except autoshard.InputError as error:
            messages.append(str(error))
    return messages


def export_and_forward(rank: int, world_size: int, family: str, mesh: dict, plan: dict, directory: str) -> Any:
    """Train two steps, export with save_full (the weights and the model's config.json into ``directory``),
    and return the program's logits on this rank's rows of a batch."""
    case, program = _program(family, mesh, dict(plan), 2)
    train_local_batches(program, case)
    written = program.save_full(directory)
    assert written == (Path(directory) / "model.safetensors" if rank == 0 else None)
    ids = program.local_batch(case.batches[0].inputs[0])
    logits = program.eval()(ids, labels=ids).logits
    return {"logits": logits, "ids": ids}


def killed_inside_save(rank: int, world_size: int, family: str, mesh: dict, plan: dict, steps: int, directory: str):
    """Checkpoint after 3 steps, train a fourth, then save again with rank 1 killed while it writes."""
    case, program = _program(family, mesh, dict(plan), steps)
    batches = case.batches
    case.batches = batches[:3]
    train_local_batches(program, case)
    program.save(Path(directory) / "step-3", extra={"next_batch": 3, "note": "resume"})
    case.batches = batches[3:4]
    train_local_batches(program, case)
    if rank == 1:
        import os

        from autoshard.checkpoint import chunks

        def die(*args: Any) -> Any:
            os._exit(9)  # no clean-up, no exception: as if the process were killed

        chunks.PiecesSavePlanner.lookup_object = die
    program.save(Path(directory) / "step-4", extra={"next_batch": 4, "note": "resume"})


def fail_at_second_step(
    rank: int, world_size: int, family: str, mesh: dict, plan: dict, fault: str, **shape: Any
) -> dict:
    """Compile with a 5 s timeout and train a step; in the second, rank 1 dies (SIGKILL) or stalls. The
    others report how long their step took to fail and its message (raised when a rank died, as the
    pool then reports errors only)."""
    import dataclasses
    import os
    import signal
    import time

    case, program = _program(family, mesh, {**plan, "timeout": 5.0}, 2, **shape)
    train_local_batches(program, dataclasses.replace(case, batches=case.batches[:1]))
    if rank == 1:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # alive but stuck past the others' 5 s timeout; then it leaves without stepping
        return {"message": "", "seconds": 0.0}
    start = time.perf_counter()
    try:
        train_local_batches(program, dataclasses.replace(case, batches=case.batches[1:]))
        message = ""
    except autoshard.DistributedError as error:
        message = str(error)
    seconds = time.perf_counter() - start
    if fault == "kill":
        raise RuntimeError(f"REPORT {seconds:.1f}s {message}")
    return {"message": message, "seconds": seconds}
