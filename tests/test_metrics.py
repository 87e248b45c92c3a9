"""program.metrics after each step, the progress line, and program.profile's Chrome trace, on gloo ranks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.demo import TinyGPT, next_token_loss, successor_batch
from autoshard.inspection.metrics import StepMetrics, trace_path


def _train(rank: int, world: int, mesh: autoshard.Mesh, trace: str) -> dict:
    torch.manual_seed(0)
    ids, target = successor_batch(0, 8, 16)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("autoshard").addHandler(handler)
    logging.getLogger("autoshard").setLevel(logging.INFO)
    program = autoshard.compile(TinyGPT(), mesh, (ids,), loss_fn=next_token_loss, example_target=target,
                                optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), log_every=2)  # fmt: skip
    assert program.metrics is None
    out = program.profile(trace, steps=2)
    for step in range(4):
        ids, target = successor_batch(step, 8, 16)
        program.step(program.local_batch(ids), target=program.local_batch(target))
    logging.getLogger("autoshard").removeHandler(handler)
    m = program.metrics
    ev = program.cost.evaluate(B=8, S=16)
    return {
        "metrics": m, "model_flops": float(ev.flops_fwd + ev.flops_bwd), "step_seconds": program.runtime.step_seconds,
        "peak": program.plan_report.hardware.peak(torch.float32), "trace": str(out),
        "lines": [r for r in records if r.startswith("step ")],
    }  # fmt: skip


@pytest.mark.parametrize("mesh", [autoshard.Mesh(dp=2, tp=2), autoshard.Mesh(pp=2, dp=2)], ids=["dp2xtp2", "pp2xdp2"])
def test_metrics_and_trace(ranks, tmp_path: Path, mesh: autoshard.Mesh) -> None:
    results = ranks(4).run(_train, mesh, str(tmp_path / "trace.json"))
    for rank, r in enumerate(results):
        m: StepMetrics = r["metrics"]
        assert m.step == 4 and m.tokens == 8 * 16 and m.unit == "tokens" and m.world_size == 4
        # MFU is the model FLOPs from program.cost over the measured step time, the world and the peak.
        assert m.flops == pytest.approx(r["model_flops"]) and m.step_seconds == r["step_seconds"]
        assert m.mfu == pytest.approx(r["model_flops"] / (4 * r["step_seconds"] * r["peak"]))
        assert m.tflops_per_rank == pytest.approx(r["model_flops"] / 4 / r["step_seconds"] / 1e12)
        assert m.tokens_per_second == pytest.approx(128 / r["step_seconds"])
        parts = m.compute_seconds + m.comm_seconds + m.bubble_seconds
        assert parts == pytest.approx(m.step_seconds) and m.comm_seconds > 0 and m.compute_seconds > 0
        assert (m.bubble_seconds > 0) == (mesh.pp > 1)
        assert m.peak_memory_bytes > 2**20
        assert r["lines"] == ([] if rank else [r["lines"][0], r["lines"][1]])  # rank 0, steps 2 and 4
        trace = json.loads(Path(r["trace"]).read_text())  # valid Chrome-trace JSON
        assert r["trace"].endswith(f"trace.rank{rank}.json")
        names = {e.get("name", "") for e in trace["traceEvents"]}
        ours = {n for n in names if n.startswith("autoshard.")}
        assert "autoshard.optimizer" in ours
        if mesh.pp > 1:
            stage = mesh.coords(rank)["pp"]
            assert {f"autoshard.stage{stage}.F.mb0", f"autoshard.stage{stage}.B.mb0"} <= ours
        else:
            assert "autoshard.stage0.F+B.mb0" in ours and "autoshard.tp_all_reduce" in ours
        assert any(n.startswith("autoshard.all_reduce") for n in ours)  # the dp gradient reduction
    assert results[0]["lines"][0].startswith("step 2: loss ") and "MFU" in results[0]["lines"][0]


def test_trace_path_names_each_rank() -> None:
    assert trace_path("t/x.json", 3, 8) == Path("t/x.rank3.json")
    assert trace_path("t/x.json", 0, 1) == Path("t/x.json")
    assert trace_path("t/{rank}/x.json", 2, 4) == Path("t/2/x.json")


def test_log_every_and_profile_steps_must_be_positive() -> None:
    ids, target = successor_batch(0, 4, 8)
    with pytest.raises(autoshard.InputError, match="log_every=0 must be a positive number of steps"):
        autoshard.compile(TinyGPT(), 1, (ids,), loss_fn=next_token_loss, example_target=target, log_every=0)


@pytest.mark.parametrize(
    ("model_dtype", "plan", "peak_dtype"),
    [
        (torch.bfloat16, {}, torch.bfloat16),  # a model already in bf16, the plan casting nothing
        (torch.float32, {"autocast": torch.bfloat16}, torch.bfloat16),
        (torch.float32, {}, torch.float32),
    ],
    ids=["bf16-model", "fp32-model-autocast", "fp32"],
)
def test_mfu_is_against_the_peak_of_the_dtype_the_matmuls_run_in(model_dtype, plan, peak_dtype) -> None:
    ids, target = successor_batch(0, 4, 16)
    hardware = autoshard.Hardware.preset("cpu").with_(peak_flops={"float32": 1e11, "bfloat16": 4e11})
    program = autoshard.compile(TinyGPT().to(model_dtype), 1, (ids,), loss_fn=next_token_loss,
                                example_target=target, hardware=hardware, plan=plan,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), log_every=1)  # fmt: skip
    program.step(ids, target=target)
    m = program.metrics
    assert m.mfu == pytest.approx(m.flops / (m.step_seconds * hardware.peak(peak_dtype)))
