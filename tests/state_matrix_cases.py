"""The state round-trip matrix's plans, rank functions and single-device reference (tests/test_state_matrix.py).

Every plan runs on two ranks. Plan A trains ``K`` steps and hands its state over (a checkpoint, or
``full_state_dict(masters=True)`` / ``load_state_dict``); plan B takes it, and must hold exactly what A
held (fp32 masters included, where either keeps them apart), then train one step as a single device
does from that state: compute in B's precision, AdamW on the fp32 masters, its moments carried over
by a checkpoint and fresh after a state dict (which holds no optimizer state).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from cases import adamw, build_case, train_local_batches
from gap_cases import gradient_as_ranks_form_it, one_thread_like_a_rank
from torch import nn

import autoshard

FAMILY, K = "gpt2", 2
BF16 = torch.bfloat16

# name -> (mesh, plan, compute dtype, dp): all on two ranks.
PLANS: dict[str, tuple[dict[str, int], dict[str, Any], torch.dtype, int]] = {
    "plain": ({"dp": 2}, {"zero": 0}, torch.float32, 2),
    "zero1": ({"dp": 2}, {"zero": 1}, torch.float32, 2),
    "zero2": ({"dp": 2}, {"zero": 2}, torch.float32, 2),
    "zero3": ({"dp": 2}, {"zero": 3}, torch.float32, 2),
    "offload": ({"dp": 2}, {"zero": 2, "offload": True}, torch.float32, 2),
    "bf16": ({"dp": 2}, {"zero": 1, "param_dtype": BF16}, BF16, 2),
    "bf16-zero3-offload": ({"dp": 2}, {"zero": 3, "param_dtype": BF16, "offload": True}, BF16, 2),
    "tp": ({"tp": 2}, {}, torch.float32, 1),
    "pp": ({"pp": 2}, {"microbatches": 2}, torch.float32, 1),
}
VIAS = ("checkpoint", "state_dict")


def _program(name: str, steps: int) -> tuple[Any, autoshard.Program]:
    mesh, plan, _, _ = PLANS[name]
    case = build_case(FAMILY, steps)
    first = case.batches[0]
    program = autoshard.compile(case.model, autoshard.Mesh(**mesh), first.inputs, example_kwargs=first.kwargs,
                                loss_fn=case.loss_fn, optimizer=adamw, plan=dict(plan), timeout=120)  # fmt: skip
    return case, program


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def hand_over(rank: int, world: int, name: str, via: str, path: str) -> dict[str, torch.Tensor]:
    """Plan ``name`` trains K steps and saves (a checkpoint, or its full state dict with masters); what it held."""
    case, program = _program(name, K + 1)
    case.batches = case.batches[:K]
    train_local_batches(program, case)
    held = _copy(program.full_state_dict(masters=True))
    if via == "checkpoint":
        program.save(path)
    elif rank == 0:
        torch.save(held, path)
    torch.distributed.barrier()
    return held


def take_over(rank: int, world: int, name: str, via: str, path: str) -> dict[str, Any]:
    """Plan ``name`` takes the state at ``path``, says what it holds, and trains one step."""
    case, program = _program(name, K + 1)
    if via == "checkpoint":
        program.load(path)
    else:
        program.load_state_dict(torch.load(path, weights_only=True))
    held = _copy(program.full_state_dict(masters=True))
    case.batches = case.batches[K:]
    losses, _ = train_local_batches(program, case)
    return {"held": held, "loss": losses[0], "state": _copy(program.full_state_dict(masters=True))}


@functools.cache
def reference(first: str, then: str, fresh_optimizer: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One device: K steps computing as plan ``first`` does, then one as ``then`` does (each rank's rows
    backward in the compute dtype, divided by dp and summed in it), AdamW on fp32 masters throughout;
    the last loss and the masters (buffers as they are) by state-dict key."""
    case = build_case(FAMILY, K + 1)
    model = case.model.train()
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = adamw(masters)
    loss = 0.0  # the last step's
    with one_thread_like_a_rank():  # each rank computes on one
        for step, batch in enumerate(case.batches):
            _, _, dtype, dp = PLANS[first if step < K else then]
            if step == K and fresh_optimizer:
                optimizer = adamw(masters)
            model.to(dtype)
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            loss, total = gradient_as_ranks_form_it(case, batch, params, dp)
            for m, grad in zip(masters, total):
                m.grad = grad.float()
            optimizer.step()
    by_param = {id(p): m for p, m in zip(params, masters)}
    state = {
        key: by_param[id(t)].detach().clone() if id(t) in by_param else t.detach().clone()
        for key, t in model.state_dict(keep_vars=True).items()
    }
    return loss, state
