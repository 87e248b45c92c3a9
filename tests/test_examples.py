"""The demo and the torchrun example run end to end as a newcomer would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun_two_ranks(script: str, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", str(restarts)] if restarts else []
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


@pytest.mark.slow
def test_a_job_restarted_by_torchrun_resumes_from_its_latest_checkpoint(tmp_path: Path) -> None:
    """Rank 1 exits before step 3; torchrun starts the job again, which loads step-2 and trains on to
    the same losses and parameters as a run that never failed."""
    straight = torchrun_two_ranks("train_dp.py", "--steps", "6")
    ckpt = str(tmp_path / "ckpt")
    args = ("--steps", "6", "--checkpoint-dir", ckpt, "--every", "2", "--fail-at-step", "3")
    restarted = torchrun_two_ranks("train_dp.py", *args, restarts=1)
    assert f"resumed from {ckpt}/step-2 at step 2" in restarted.stdout

    def tail(out: subprocess.CompletedProcess) -> list[str]:
        lines = [line for line in out.stdout.splitlines() if line.startswith(("step ", "parameter sum"))]
        return lines[-5:]  # steps 2..5 (the restarted attempt's) and the final parameter sum

    assert tail(restarted) == tail(straight)
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {"step-2", "step-4", "step-6"}
