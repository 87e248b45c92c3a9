"""Ranks that share a GPU run their collectives on gloo through host memory (autoshard/distributed/gloo_via_host.py).

On this CPU-only machine the process group is told to stage host tensors too, so every copy to the
host and back runs as it would for CUDA tensors: each collective, asynchronous point-to-point that
crosses, functional collectives as compiled graphs issue them, subgroups, and whole plans against one
device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import train_plan, train_single_device
from test_tp import assert_state_close

from autoshard.distributed import gloo_via_host
from autoshard.launch import LocalRanks


@pytest.fixture(scope="module")
def staged():
    pools: dict[int, LocalRanks] = {}

    def get(world: int) -> LocalRanks:
        if world not in pools:
            pools[world] = LocalRanks(world, backend=gloo_via_host.BACKEND).start()
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()


def _stage_everything(rank: int, world: int) -> str:
    gloo_via_host.GlooViaHost.stage_host_tensors = True
    return dist.get_backend()


def _collectives(rank: int, world: int) -> dict[str, list[float]]:
    from torch.distributed import _functional_collectives as fc

    me = float(rank + 1)
    out: dict[str, list[float]] = {}
    t = torch.full((2,), me)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.full((2,), me)
    dist.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    t = torch.full((2,), me)
    dist.reduce(t, dst=0)
    out["reduce"] = t.tolist() if rank == 0 else []
    full = torch.zeros(2 * world)
    dist.all_gather_into_tensor(full, torch.full((2,), me))
    out["all_gather_into_tensor"] = full.tolist()
    pieces = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(pieces, torch.full((2,), me))
    out["all_gather"] = torch.cat(pieces).tolist()
    mine = torch.zeros(2)
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * world) * me)
    out["reduce_scatter_tensor"] = mine.tolist()
    mine = torch.zeros(2)
    dist.reduce_scatter(mine, [torch.full((2,), me * (r + 1)) for r in range(world)])
    out["reduce_scatter"] = mine.tolist()
    # asynchronous: the result lands in the tensor at wait()
    t = torch.full((3,), me)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["all_reduce_async"] = t.tolist()
    # point-to-point posted before the matching send on both sides (a pipeline's pattern)
    peer = 1 - rank
    incoming = torch.zeros(2)
    recv = dist.irecv(incoming, src=peer, tag=7)
    send = dist.isend(torch.full((2,), me), dst=peer, tag=7)
    recv.wait()
    send.wait()
    out["irecv"] = incoming.tolist()
    # functional collectives, as the compiled graphs and the tp runtime issue them
    group = dist.group.WORLD
    out["fc_all_reduce"] = fc.wait_tensor(fc.all_reduce(torch.full((2,), me), "sum", group)).tolist()
    out["fc_all_gather"] = fc.wait_tensor(fc.all_gather_tensor(torch.full((2,), me), 0, group)).tolist()
    out["fc_reduce_scatter"] = fc.wait_tensor(
        fc.reduce_scatter_tensor(torch.arange(2.0 * world) * me, "sum", 0, group)
    ).tolist()
    sub = dist.new_group([0, 1])
    t = torch.full((1,), me)
    dist.all_reduce(t, group=sub)
    out["subgroup"] = t.tolist()
    objects: list = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    out["objects"] = [o["rank"] for o in objects]
    dist.barrier()
    return out


def test_every_collective_moves_the_values_gloo_would(staged) -> None:
    pool = staged(2)
    assert pool.run(_stage_everything) == [gloo_via_host.BACKEND] * 2
    results = pool.run(_collectives)
    assert results[0]["all_reduce"] == [3.0, 3.0] and results[1]["all_reduce"] == [3.0, 3.0]
    assert results[0]["broadcast"] == [2.0, 2.0] and results[0]["reduce"] == [3.0, 3.0]
    for r, result in enumerate(results):
        assert result["all_gather_into_tensor"] == [1.0, 1.0, 2.0, 2.0]
        assert result["all_gather"] == [1.0, 1.0, 2.0, 2.0]
        assert result["reduce_scatter_tensor"] == [3.0 * (2 * r), 3.0 * (2 * r + 1)]
        assert result["reduce_scatter"] == [3.0 * (r + 1)] * 2
        assert result["all_reduce_async"] == [3.0] * 3
        assert result["irecv"] == [float(2 - r)] * 2
        assert result["fc_all_reduce"] == [3.0, 3.0]
        assert result["fc_all_gather"] == [1.0, 1.0, 2.0, 2.0]
        assert result["fc_reduce_scatter"] == [3.0 * (2 * r), 3.0 * (2 * r + 1)]
        assert result["subgroup"] == [3.0] and result["objects"] == [0, 1]


@pytest.mark.parametrize(
    "mesh, plan",
    [
        ({"dp": 2}, {"zero": 3, "offload": True}),
        ({"tp": 2}, {"sequence_parallel": True}),
        ({"pp": 2}, {"microbatches": 2, "schedule": "1f1b"}),
    ],
    ids=["zero3-offload", "tp2-sp", "pp2-1f1b"],
)
def test_plans_through_the_host_equal_one_device(staged, mesh: dict, plan: dict) -> None:
    pool = staged(2)
    pool.run(_stage_everything)
    results = pool.run(train_plan, "gpt2", mesh, plan, layers=2)
    ref_losses, ref_state = train_single_device("gpt2", layers=2)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(results[0]["state"], ref_state)


def test_local_ranks_choose_the_backend_from_the_device() -> None:
    assert LocalRanks(2).backend == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="sees no CUDA device"):
            LocalRanks(2, device="cuda")
