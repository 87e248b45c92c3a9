"""Models and rank functions for the tests that close mutation gaps (tests/test_mutation_gaps.py).

Importable by the spawned worker processes, like tests/cases.py. The models are tiny so that every
strategy can run on them in every test run:

- ``reuse``: each block calls one module twice, ``inp(relu(out(relu(inp(x)))))``, so a ZeRO-3 group's
  last use in forward is not the last use of its last parameter;
- ``shared``: two blocks share one weight, so a group is used again by a later layer (and, cut into
  pipeline stages, the weight is tied across stages). The graph reads the weight under the later
  block's name, so it joins that block's group, whose own parameter is used before the weight's last use.

Widths are chosen so that no flat group divides by 2 or 4 (ZeRO pads every shard) and tp=2 still
shards the blocks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from cases import Batch, Case, build_case, compile_case, cross_entropy
from torch import nn

import autoshard

GAP_MODELS = ("reuse", "shared")
FEATURES, WIDTH, CLASSES = 5, 6, 3


class ReuseBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(F.relu(self.out(F.relu(self.inp(x)))))


class Reuse(nn.Module):
    def __init__(self, blocks: int = 2, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(ReuseBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = F.gelu(block(x))
        return self.head(x)


class SharedBlock(nn.Module):
    """A scale, then a linear without bias (Llama's norm weight before its projection)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.linear = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x * self.scale))


class Shared(nn.Module):
    def __init__(self, blocks: int = 2, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(SharedBlock(width) for _ in range(blocks))
        for block in self.blocks[1:]:
            block.linear.weight = self.blocks[0].linear.weight  # one weight in every block
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_case(name: str, steps: int = 3, seed: int = 0, **shape: Any) -> Case:
    """A gap model's case (deterministic batches of 8 rows), or a tests/cases.py family's."""
    if name not in GAP_MODELS:
        return build_case(name, steps, seed, **shape)
    torch.manual_seed(seed)
    model = Reuse(**shape) if name == "reuse" else Shared(**shape)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [
        Batch(inputs=(torch.randn(8, FEATURES, generator=gen),), target=torch.randint(0, CLASSES, (8,), generator=gen))
        for _ in range(steps)
    ]
    return Case(model=model, batches=batches, loss_fn=cross_entropy)


def plain_sgd(params: Any, lr: float = 1.0) -> torch.optim.Optimizer:
    """SGD without momentum or weight decay: each update is exactly -lr x the gradient, so a gradient
    scaled wrongly (by dp, by the microbatch count, by a clipping coefficient) shows in the parameters."""
    return torch.optim.SGD(params, lr=lr)


def _loss(case: Case, batch: Batch) -> torch.Tensor:
    out = case.model(*batch.inputs, **batch.kwargs)
    return case.loss_fn(out, batch.target) if case.loss_fn is not None else out.loss


def single_device_updates(
    name: str, steps: int = 3, lr: float = 1.0, max_grad_norm: float | None = None, **shape: Any
) -> dict[str, Any]:
    """The reference: plain SGD on one device; the state before and after every step, losses, norms."""
    case = make_case(name, steps, **shape)
    model = case.model.train()
    opt = plain_sgd(model.parameters(), lr)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    losses, norms = [], []
    for batch in case.batches:
        opt.zero_grad()
        loss = _loss(case, batch)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        opt.step()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "states": states, "grad_norms": norms}


def train_updates(
    rank: int,
    world_size: int,
    name: str,
    mesh: dict[str, int],
    plan: dict[str, Any],
    steps: int = 3,
    lr: float = 1.0,
    **shape: Any,
) -> dict[str, Any]:
    """One rank of any plan under plain SGD: the full state before and after every step (rank 0), losses, norms."""
    case = make_case(name, steps, **shape)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan, optimizer=functools.partial(plain_sgd, lr=lr))
    states = [program.full_state_dict()]
    losses, norms = [], []
    for batch in case.batches:
        local = program.local_batch
        kwargs = {k: local(v) for k, v in batch.kwargs.items() if isinstance(v, torch.Tensor)}
        target = None if batch.target is None else local(batch.target)
        losses.append(program.step(*(local(x) for x in batch.inputs), target=target, **kwargs))
        norms.append(program.last_grad_norm)
        states.append(program.full_state_dict())
    return {"losses": losses, "states": states, "grad_norms": norms}


def assert_updates_close(states: list[dict], ref_states: list[dict], rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Every step's update (state before minus after: lr x the reduced gradient) equals the reference's."""
    assert len(states) == len(ref_states)
    for step in range(1, len(states)):
        before, after = states[step - 1], states[step]
        ref_before, ref_after = ref_states[step - 1], ref_states[step]
        assert after.keys() == ref_after.keys()
        for key in ref_after:
            torch.testing.assert_close(
                before[key] - after[key],
                ref_before[key] - ref_after[key],
                rtol=rtol,
                atol=atol,
                msg=lambda m, k=key, s=step: f"update of {k} in step {s}: {m}",
            )


@contextlib.contextmanager
def one_thread_like_a_rank() -> Iterator[None]:
    """Compute on one thread, as each rank of the test pools does (LocalRanks' default): a reduction split
    over threads rounds differently in bf16 (a LayerNorm's weight and bias gradients, over the rows), and a
    low-precision reference must round as the ranks do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_single_device_as_program(
    family: str, dtype: torch.dtype, dp: int, steps: int = 3, **shape: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Mixed precision on one device, computed as a dp-rank program computes it, so that it can be
    compared tightly: ``dtype`` compute, AdamW on fp32 masters copied from the fp32 originals, and each
    step's gradient formed as the ranks form it (each rank's rows backward in ``dtype``, divided by dp
    and summed in ``dtype``), on one thread like each rank."""
    from cases import adamw

    case = build_case(family, steps, **shape)
    model = case.model.train()
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().clone()) for p in params]
    model.to(dtype)
    opt = adamw(masters)
    losses = []
    with one_thread_like_a_rank():
        for batch in case.batches:
            loss, total = gradient_as_ranks_form_it(case, batch, params, dp)
            for master, grad in zip(masters, total):
                master.grad = grad.float()
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def gradient_as_ranks_form_it(
    case: Case, batch: Batch, params: list[nn.Parameter], dp: int
) -> tuple[float, list[torch.Tensor]]:
    """The mean loss and each parameter's gradient as ``dp`` ranks form it: each rank's rows backward in the
    parameters' dtype, divided by dp and summed in it."""
    rows = batch.inputs[0].shape[0] // dp
    total: list[torch.Tensor | None] = [None] * len(params)
    loss_sum = 0.0
    for r in range(dp):
        part = slice(r * rows, (r + 1) * rows)
        kwargs = {k: v[part] if isinstance(v, torch.Tensor) else v for k, v in batch.kwargs.items()}
        local = Batch(tuple(x[part] for x in batch.inputs), kwargs, None)
        case.model.zero_grad(set_to_none=True)
        loss = _loss(case, local)
        loss.backward()
        loss_sum += loss.double().item()
        for i, p in enumerate(params):
            share = p.grad / dp if dp > 1 else p.grad
            total[i] = share if total[i] is None else total[i] + share
    return loss_sum / dp, total
