"""Checkpoint save and load: autoshard's program.save/load (dp4, ZeRO-3) against torch.distributed.checkpoint
used directly on an FSDP2 model of the same size (fully_shard per block, get/set_state_dict), in
alternating rounds on the same ranks; seconds per GiB of checkpoint, and the bytes each rank writes.

    python bench/run.py --only checkpoint
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import LocalRanks

CFG = {"vocab": 8192, "dim": 512, "heads": 8, "layers": 8, "seq": 64, "batch": 8}


def _dir_bytes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}


def _rank(rank: int, world_size: int, root: str, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def model() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(vocab=CFG["vocab"], dim=CFG["dim"], heads=CFG["heads"], layers=CFG["layers"], max_seq=CFG["seq"])

    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, CFG["vocab"], (CFG["batch"] // world_size, CFG["seq"] + 1), generator=gen)
    ids, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    program = autoshard.compile(
        model(), autoshard.Mesh(dp=world_size), (torch.cat([ids] * world_size),), loss_fn=next_token_loss,
        example_target=torch.cat([target] * world_size), plan={"zero": 3},
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
    )  # fmt: skip
    program.step(ids, target=target)  # the optimizer state exists

    theirs = model()
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    next_token_loss(theirs(ids), target).backward()
    opt.step()

    def save_ours(path: str) -> None:
        program.save(path)

    def load_ours(path: str) -> None:
        program.load(path)

    def save_theirs(path: str) -> None:
        model_state, optim_state = get_state_dict(theirs, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    def load_theirs(path: str) -> None:
        model_state, optim_state = get_state_dict(theirs, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(theirs, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    times: dict[str, list[float]] = {k: [] for k in ("save ours", "load ours", "save theirs", "load theirs")}
    for r in range(rounds):
        for who, save, load in (("ours", save_ours, load_ours), ("theirs", save_theirs, load_theirs)):
            path = f"{root}/{who}-{r}"
            for kind, fn in (("save", save), ("load", load)):
                dist.barrier()
                start = time.perf_counter()
                fn(path)
                dist.barrier()
                times[f"{kind} {who}"].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_checkpoint(report: Any, ranks: int = 4, rounds: int = 3) -> None:
    root = Path(tempfile.mkdtemp(prefix="autoshard-bench-ckpt-"))
    try:
        with LocalRanks(ranks) as pool:
            results = pool.run(_rank, str(root), rounds)
        sizes = {who: _dir_bytes(root / f"{who}-0") for who in ("ours", "theirs")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = {who: sum(s.values()) / 2**30 for who, s in sizes.items()}
    for kind in ("save", "load"):
        ours = max(r[f"{kind} ours"] for r in results) / gib["ours"]
        theirs = max(r[f"{kind} theirs"] for r in results) / gib["theirs"]
        report(f"checkpoint {kind}, dp4 ZeRO-3 vs DCP on FSDP2: seconds per GiB", f"{ours:.2f} s/GiB",
               f"{theirs:.2f} s/GiB", ours / theirs, "<= 1.2")  # fmt: skip
    largest = {who: max(v for k, v in s.items() if k.endswith(".distcp")) for who, s in sizes.items()}
    total = {who: sum(v for k, v in s.items() if k.endswith(".distcp")) for who, s in sizes.items()}
    report(f"checkpoint: largest rank's file of {total['ours'] / 2**20:.1f} MiB written by {ranks} ranks",
           f"{largest['ours'] / 2**20:.1f} MiB", f"{largest['theirs'] / 2**20:.1f} MiB",
           largest["ours"] / largest["theirs"], "<= 1.05 (each rank its shard)")  # fmt: skip
