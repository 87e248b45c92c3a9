"""The demo and the torchrun example run end to end as a newcomer would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_two_ranks(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(
        [*cmd, str(ROOT / "examples" / script), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_torchrun_example_trains_on_two_ranks() -> None:
    out = torchrun_two_ranks("train_dp.py", "--steps", "3")
    assert "plan: Plan(dp=2, tp=1, pp=1, zero=0, bucket=25MiB)" in out.stdout
    losses = [float(line.split("loss ")[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3
    assert "trained" in out.stdout


def test_torchrun_pipeline_example_trains_on_two_ranks() -> None:
    out = torchrun_two_ranks("train_pp.py", "--steps", "3", "--schedule", "gpipe")
    assert "plan: Plan(dp=1, tp=1, pp=2, zero=0, schedule=gpipe, microbatches=4, bucket=25MiB)" in out.stdout
    assert "stage 1 on pp rank 1: blocks.2 .. blocks.3" in out.stdout
    assert "rank 0: 0F0 0F1 0F2 0F3" in out.stdout  # the schedule's table
    losses = [float(line.split("loss ")[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and "trained" in out.stdout


def test_demo_matches_single_device(capsys) -> None:
    from autoshard.demo import main

    assert main(ranks=2, steps=2) == 0
    out = capsys.readouterr().out
    assert "OK: distributed training matches single-device training" in out
    assert "plan: Plan(dp=2, tp=1, pp=1, zero=0, bucket=25MiB)" in out


def test_torchrun_tensor_parallel_example_trains_on_two_ranks() -> None:
    out = torchrun_two_ranks("train_tp.py", "--steps", "3", "--sequence-parallel")
    assert "plan: Plan(dp=1, tp=2, pp=1, zero=0, bucket=25MiB, sequence_parallel)" in out.stdout
    assert "blocks.0.qkv.weight                                  S(0)x3   full (192, 64)" in out.stdout
    assert "blocks.0                       2 all_gather bwd, 2 all_gather fwd, 2 reduce_scatter bwd" in out.stdout
    losses = [float(line.split("loss ")[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and "trained" in out.stdout
