"""bench/gpu.py runs end to end on the CPU with small sizes (on a GPU machine it runs the same steps on CUDA)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_runs_on_the_cpu() -> None:
    args = ["--device", "cpu", "--size", "tiny", "--steps", "3", "--backend", "aot_eager", "--ranks", "2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout[done.stdout.index("| run |") :]
    for name in ("Hugging Face, eager", "Hugging Face, torch.compile", "autoshard dp=1, eager", "torch_compile"):
        assert f"| {name}" in table or name in table, name
    zero_rows = [line for line in table.splitlines() if line.startswith("| ZeRO-")]
    assert len(zero_rows) == 3
    for line in zero_rows:  # the CPU's held bytes equal the formula (fp32 parameters and gradients)
        assert line.split("|")[4].strip() == "1.000", line
    equivalence = next(line for line in table.splitlines() if line.startswith("| dp=2 torch_compile on gloo"))
    gap = float(equivalence.split("loss rel. gap ")[1].split(" ")[0])
    assert gap < 1e-4, equivalence
