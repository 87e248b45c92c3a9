"""bench/gpu.py runs end to end on the CPU with small sizes (on a GPU machine it runs the same steps on CUDA).

The GPU check suite's own rehearsal (its section ``suite``, tests/test_gpu.py with AUTOSHARD_GPU_REHEARSAL=1)
takes minutes here and is left to the GPU session; tests/test_gloo_via_host.py covers the host-staged ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # long (15-35 s): under -m slow
def test_gpu_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--device", "cpu", "--size", "tiny", "--steps", "3", "--backend", "aot_eager",
            "--sections", "single,offload", "--autocast", "bf16"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())
    assert not [r for r in rows if r["kind"] in ("error",) or r.get("failure")], rows
    speeds = {r["run"]: r for r in rows if r["kind"] == "speed"}
    assert any("baseline" in run for run in speeds) and len(speeds) == 4
    for run in ("autoshard dp=1, eager", "autoshard dp=1, torch_compile=True (aot_eager)"):
        assert speeds[run]["predicted_bytes"] > 0 and speeds[run]["step_s"] > 0
    hardware = next(r for r in rows if r["kind"] == "hardware")
    assert hardware["measured"]["host_bandwidth"] > 0 and hardware["preset"]["name"]
    offload = {r["run"]: r for r in rows if r["kind"] == "offload"}
    with_offload = offload["tiny Llama, ZeRO-1 with offload"]
    assert set(with_offload["host_seconds"]) == {"host_step", "wait_down", "wait_up"}
    assert with_offload["host_bytes"] == 4 * with_offload["params"]  # fp32 masters on the host
    table = (tmp_path / "gpu.md").read_text()
    for heading in ("| run | step |", "| figure | Hardware.measure()", "| offload | step |"):
        assert heading in table, heading
