"""The demo and the torchrun example run end to end as a newcomer would run them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun's workers run in sessions of their own)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *_descendants(child)]
    return out


def torchrun_two_ranks(
    script: str, *args: str, restarts: int = 0, fresh_store: bool = True, check: bool = True, nproc: int = 2
) -> subprocess.CompletedProcess:
    """torchrun on 2 ranks; on a timeout it and every worker it started are killed. With restarts, the
    agent gets a fresh store per attempt (launch.SHARED_STORE_FIX) unless ``fresh_store=False``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if restarts and fresh_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", str(restarts), "--monitor-interval", "1"] if restarts else []
    cmd += [str(ROOT / "examples" / script), *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode == -signal.SIGKILL:
        pytest.fail(f"{script} {' '.join(args)} ran past 300 s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    if check:
        assert proc.returncode == 0, stderr[-3000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_torchrun_example_trains_on_two_ranks() -> None:
    out = torchrun_two_ranks("train_dp.py", "--steps", "3")
    # On the CPU the plan assumes the CPU preset and says so, with the model's size.
    assert "TinyGPT: 0.12M parameters; assuming CPU core (preset)" in out.stdout
    assert "plan: Plan(dp=2, tp=1, pp=1, zero=1, bucket=25MiB)" in out.stdout
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


@pytest.mark.slow  # long (15-35 s): under -m slow
def test_torchrun_pipeline_example_trains_a_v_shaped_zero_bubble_pipeline() -> None:
    out = torchrun_two_ranks("train_pp.py", "--steps", "3", "--schedule", "zbv")
    assert "schedule=zbv, microbatches=4, virtual_stages=2" in out.stdout
    assert "stage 3 on pp rank 0" in out.stdout  # the V comes back to the first rank, with the loss
    assert "0W0" in out.stdout  # the schedule's table has its weight-gradient steps
    losses = [float(line.split("loss ")[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and "trained" in out.stdout


def test_demo_matches_single_device(capsys) -> None:
    from autoshard.demo import main

    assert main(ranks=2, steps=6) == 0
    out = capsys.readouterr().out
    table = out[out.index("autoshard loss") :].splitlines()[1:7]  # step, autoshard loss, single-device loss, ...
    losses = [float(line.split()[1]) for line in table]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5  # the demo's task is learnt: the loss visibly falls
    assert "OK: distributed training matches single-device training" in out
    assert "plan: Plan(dp=2, tp=1, pp=1, zero=1, bucket=25MiB)" in out  # the CPU preset: ZeRO-1 steps faster


def test_torchrun_tensor_parallel_example_trains_on_two_ranks() -> None:
    out = torchrun_two_ranks("train_tp.py", "--steps", "3", "--sequence-parallel")
    assert "plan: Plan(dp=1, tp=2, pp=1, zero=0, bucket=25MiB, sequence_parallel)" in out.stdout
    assert "blocks.0.qkv.weight                                  S(0)x3   full (192, 64)" in out.stdout
    assert "blocks.0                       2 all_gather bwd, 2 all_gather fwd, 2 reduce_scatter bwd" in out.stdout
    losses = [float(line.split("loss ")[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and "trained" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, options",
    [("train_dp.py", ()), ("train_tp.py", ("--sequence-parallel",)), ("train_pp.py", ("--schedule", "1f1b"))],
)
def test_a_job_restarted_by_torchrun_resumes_from_its_latest_checkpoint(tmp_path: Path, script, options) -> None:
    """Rank 1 exits before step 3; torchrun starts the job again, which loads step-2 and trains on to
    the same losses and parameters as a run that never failed."""
    straight = torchrun_two_ranks(script, "--steps", "6", *options)
    ckpt = str(tmp_path / "ckpt")
    args = ("--steps", "6", "--checkpoint-dir", ckpt, "--every", "2", "--fail-at-step", "3", *options)
    restarted = torchrun_two_ranks(script, *args, restarts=1)
    assert f"resumed from {ckpt}/step-2 at step 2" in restarted.stdout

    def tail(out: subprocess.CompletedProcess) -> list[str]:
        lines = [line for line in out.stdout.splitlines() if line.startswith(("step ", "parameter sum"))]
        return lines[-5:]  # steps 2..5 (the restarted attempt's) and the final parameter sum

    assert tail(restarted) == tail(straight)
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {"step-2", "step-4", "step-6"}


@pytest.mark.slow
def test_a_restart_on_torchruns_shared_store_stops_with_the_fix_named(tmp_path: Path) -> None:
    """Without a fresh store per attempt the restarted workers would read the failed attempt's addresses
    and hang; they stop at once instead, naming the environment variable that fixes it."""
    args = ("--steps", "4", "--checkpoint-dir", str(tmp_path), "--every", "2", "--fail-at-step", "3")
    out = torchrun_two_ranks("train_dp.py", *args, restarts=1, fresh_store=False, check=False)
    assert out.returncode != 0
    assert "launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in out.stderr


def _losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+: loss (\S+)$", stdout, re.M)]


@pytest.mark.slow  # long (15-35 s): under -m slow
def test_plan_70b_example_plans_1024_ranks_offline(tmp_path: Path) -> None:
    page = tmp_path / "l70.html"
    cmd = [sys.executable, str(ROOT / "examples" / "plan_70b.py"), "--layers", "2", "--report", str(page)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "on 1024 x h100-80gb" in out and "planned in" in out and f"report: {page}" in out
    plan = out.split("planned in ")[1].split(": ", 1)[1].splitlines()[0]
    assert autoshard_mesh_size(plan) == 1024
    text = page.read_text()
    assert "LlamaForCausalLM on" in text and plan in text.replace("&amp;", "&")


def autoshard_mesh_size(plan: str) -> int:
    degrees = dict(part.split("=") for part in plan.removeprefix("Plan(").split(", ")[:3])
    return int(degrees["dp"]) * int(degrees["tp"]) * int(degrees["pp"])


@pytest.mark.slow
def test_torchrun_3d_example_trains_and_reports(tmp_path: Path) -> None:
    report, trace = tmp_path / "3d.html", tmp_path / "trace.json"
    args = ("--steps", "10", "--tp", "2", "--pp", "2", "--report", str(report), "--trace", str(trace))
    out = torchrun_two_ranks("train_3d.py", *args, nproc=8)
    assert "plan: Plan(dp=2, tp=2, pp=2, zero=0, schedule=1f1b, microbatches=4" in out.stdout
    losses = _losses(out.stdout)
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5  # the successor task is learnt
    assert "MFU" in out.stderr and "tokens/s" in out.stderr  # the progress line, every 5 steps
    assert "rank 7 measured" in report.read_text()
    assert len(list(tmp_path.glob("trace.rank*.json"))) == 8


@pytest.mark.slow
def test_torchrun_llama_finetune_with_zero3_and_recompute() -> None:
    out = torchrun_two_ranks("finetune_llama.py", "--steps", "12", "--batch", "8", "--seq", "16")
    assert "plan: Plan(dp=2, tp=1, pp=1, zero=3, bucket=25MiB, recompute=full)" in out.stdout
    losses = _losses(out.stdout)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    difference = float(out.stdout.split("largest loss difference ")[1].split()[0])
    assert difference < 1e-4  # next to single-device training
