"""Data per rank: program.data_loader gives each data-parallel rank its own rows and every rank of a tensor-
parallel group or pipeline the same rows; training on it equals single-device training on the global
batches; and step() refuses, in its first steps, the two usual mistakes (a sampler over the world size,
the global batch handed to every rank)."""

from __future__ import annotations

import pytest
import torch
from cases import SEQ, VOCAB, Batch, Case, adamw, build_model, compile_case
from test_tp import assert_state_close
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autoshard
from autoshard.launch import RankFailure

ROWS, GLOBAL, STEPS = 24, 8, 3


def _dataset() -> TensorDataset:
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    ids[:, 0] = torch.arange(ROWS)  # row i starts with token i: which rows a rank got is readable
    return TensorDataset(ids)


def _program(mesh: dict[str, int], layers: int) -> autoshard.Program:
    ids = _dataset().tensors[0][:GLOBAL]
    model = build_model("gpt2", layers=layers)
    case = Case(model, [Batch(inputs=(ids,), kwargs={"labels": ids, "use_cache": False})])
    return compile_case(case, autoshard.Mesh(**mesh), plan={"microbatches": 2} if mesh.get("pp", 1) > 1 else "auto")


def _train_with_loader(rank: int, world: int, mesh: dict[str, int], layers: int) -> dict:
    program = _program(mesh, layers)
    loader = program.data_loader(_dataset(), GLOBAL, shuffle=False)
    rows, losses = [], []
    for step, (ids,) in enumerate(loader):
        if step == STEPS:
            break
        rows.append(ids[:, 0].tolist())
        losses.append(program.step(ids, labels=ids))
    return {"rows": rows, "losses": losses, "state": program.full_state_dict(), "dp": program.dp_rank,
            "dp_size": program.dp_size, "placeholders": bool(ids.eq(0).all())}  # fmt: skip


def _single_device(layers: int) -> tuple[list[float], dict]:
    model = build_model("gpt2", layers=layers)
    opt = adamw(model.parameters())
    ids = _dataset().tensors[0]
    losses = []
    for step in range(STEPS):
        batch = ids[step * GLOBAL : (step + 1) * GLOBAL]
        opt.zero_grad()
        loss = model(batch, labels=batch, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "mesh, layers",
    [({"dp": 2, "tp": 2}, 2), ({"dp": 2, "pp": 2}, 2), ({"pp": 4}, 4)],
    ids=["dp2xtp2", "dp2xpp2", "pp4"],
)
def test_the_loader_gives_each_share_its_rows_and_training_equals_one_device(ranks, mesh: dict, layers: int) -> None:
    results = ranks(4).run(_train_with_loader, mesh, layers)
    dp_size = results[0]["dp_size"]
    assert dp_size == mesh.get("dp", 1)
    for step in range(STEPS):
        by_share: dict[int, list[int]] = {}
        for result in results:
            if result["placeholders"]:  # a pipeline's middle stage reads no input: it loaded nothing
                continue
            rows = result["rows"][step]
            assert by_share.setdefault(result["dp"], rows) == rows  # tp and pipeline ranks: the same rows
        assert sorted(r for rows in by_share.values() for r in rows) == list(range(step * GLOBAL, (step + 1) * GLOBAL))
    middle = [r for r, result in enumerate(results) if result["placeholders"]]
    assert middle == ([1, 2] if mesh.get("pp", 1) == 4 else [])
    ref_losses, ref_state = _single_device(layers)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(results[0]["state"], ref_state)


def _sampler_over_the_world(rank: int, world: int) -> float:
    program = _program({"dp": 2, "tp": 2}, 2)
    sampler = DistributedSampler(_dataset(), num_replicas=world, rank=rank, shuffle=False)  # the usual mistake
    (ids,) = next(iter(DataLoader(_dataset(), batch_size=GLOBAL // 2, sampler=sampler)))
    return program.step(ids, labels=ids)


def test_a_sampler_over_the_world_size_is_caught_on_the_first_step(ranks) -> None:
    with pytest.raises(RankFailure, match="handed different batches.*program.data_loader"):
        ranks(4).run(_sampler_over_the_world)


def _global_batch_everywhere(rank: int, world: int) -> float:
    program = _program({"dp": 2, "tp": 2}, 2)
    ids = _dataset().tensors[0][:GLOBAL]
    return program.step(ids, labels=ids)  # the whole global batch on every rank


def test_the_global_batch_handed_to_every_dp_rank_is_refused(ranks) -> None:
    with pytest.raises(RankFailure, match="every data-parallel rank was handed the same 8 rows.*local_batch"):
        ranks(4).run(_global_batch_everywhere)
