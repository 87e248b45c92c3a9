"""autoshard on a GPU: one prepared script for the figures that only a CUDA device gives.

    python bench/gpu.py --out DIR                                  # a CUDA machine: about 8 minutes on an H200
    python bench/gpu.py --out DIR --device cpu --size tiny         # the same steps on the CPU, small: a rehearsal

Each section runs in a process of its own under a time budget; what a section measured before its budget
ran out is kept, and a section that fails leaves its error in the table instead of stopping the others:

  single     one rank on NCCL, a ~1B Llama (bf16 autocast): a plain training loop eagerly and under
             torch.compile with fused AdamW (the baseline), against autoshard's program eagerly and with
             torch_compile=True: step time, tokens/s, MFU; the peak CUDA memory of a step against the
             planner's prediction; Hardware.measure() against the "h200" preset, and the planner's step
             time with each against the measured one.
  suite      the GPU check suite (tests/test_gpu.py, ``-m gpu``): the equivalence grid with every tensor on
             the GPU, one rank on NCCL, pinned offload, a bf16 GPT block on the CUDA allocator against the
             accounting and Korthikanti et al., Hardware.measure().
  offload    a 7B-class Llama (bf16 parameters, fp32 masters) with ZeRO-Offload against without: step time,
             peak device memory, the host's step and the copies it did not hide.

Writes DIR/gpu.json (every measurement) and DIR/gpu.md (the table for the README). Nothing here asserts
a duration; the suite asserts equivalence and memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv": 8, "inter": 8192, "vocab": 32000}
LLAMA_7B = {"hidden": 4096, "layers": 32, "heads": 32, "kv": 32, "inter": 11008, "vocab": 32000}
SIZES = {  # "1b": Llama-3.2-1B's body with a 32k vocabulary (0.97B parameters); "7b": Llama-2-7B's shapes
    "1b": {**LLAMA_1B, "seq": 2048, "batch": 4},
    "7b": {**LLAMA_7B, "seq": 2048, "batch": 1},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "inter": 128, "vocab": 256, "seq": 32, "batch": 4},
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}  # bf16 dense
BUDGETS = {"single": 210, "suite": 150, "offload": 140}  # seconds: 8 minutes and 20 seconds in all


# ---- shared pieces ---------------------------------------------------------------------------------------
class Results:
    """One section's measurements, written to its JSON file after every row (a killed section keeps them)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []

    def add(self, **row: Any) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.path.write_text(json.dumps(self.rows, indent=1))


def build(size: dict[str, int], device: torch.device, seed: int = 0) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=size["hidden"], num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"], intermediate_size=size["inter"], vocab_size=size["vocab"],
        max_position_embeddings=size["seq"], bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    with device:
        return transformers.LlamaForCausalLM(cfg)


def batches(size: dict[str, int], device: torch.device, n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen).to(device) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Any, data: list[torch.Tensor], device: torch.device, warmup: int = 2) -> tuple[float, float]:
    """(median seconds of the timed steps, seconds of the warm-up steps: compilation shows there). The CUDA
    peak-memory statistics restart after the warm-up: their peak is then a step's."""
    start = time.perf_counter()
    for ids in data[:warmup]:
        step(ids)
    sync(device)
    warm = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for ids in data[warmup:]:
        start = time.perf_counter()
        step(ids)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), warm


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def init_one_rank(device: torch.device) -> None:
    """A process group of one: NCCL on a GPU (the program's collectives run on it), gloo on the CPU."""
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)  # fmt: skip


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def program_for(model: torch.nn.Module, ids: torch.Tensor, plan: dict[str, Any], hardware: Any, **options: Any) -> Any:
    import autoshard

    return autoshard.compile(
        model, 1, (ids,), {"labels": ids, "use_cache": False}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        plan={"dp": 1, **plan}, hardware=hardware, **options,
    )  # fmt: skip


# ---- section: single -------------------------------------------------------------------------------------
def section_single(args: argparse.Namespace, out: Results) -> None:
    import autoshard

    device = torch.device(args.device)
    size = SIZES[args.size]
    cuda = device.type == "cuda"
    autocast = torch.bfloat16 if (cuda and args.autocast == "auto") or args.autocast == "bf16" else None
    data = batches(size, device, args.steps + 2)
    tokens = size["batch"] * size["seq"]
    preset = autoshard.Hardware.preset("h200" if cuda else "cpu")
    probe = program_for(build(size, torch.device("meta")), data[0].cpu(), {"autocast": autocast}, preset)
    flops = 3 * float(probe.cost.evaluate(B=size["batch"], S=size["seq"]).flops_fwd)  # forward + 2x backward
    params = sum(p.numel() for p in probe.compiled.model.parameters())
    peak = peak_flops(device, args.peak_tflops)
    out.add(kind="setup", torch=torch.__version__, cuda=torch.version.cuda, size=args.size, params=params,
            device=torch.cuda.get_device_name(device) if cuda else "cpu", batch=size["batch"], seq=size["seq"],
            precision="bf16 autocast" if autocast else "fp32", flops_per_step=flops, peak_flops=peak)  # fmt: skip

    def row(name: str, step: float, warm: float, **extra: Any) -> None:
        out.add(kind="speed", run=name, step_s=step, tokens_per_s=tokens / step, warmup_s=warm,
                mfu=flops / step / peak if peak else None, **extra)  # fmt: skip

    def plain_loop(model: torch.nn.Module, fused: bool) -> Any:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused if cuda else None)

        def step(ids: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, autocast or torch.float32, enabled=autocast is not None):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()

        return step

    row("plain loop, eager, AdamW", *timed(plain_loop(build(size, device), False), data, device))
    free(device)
    baseline = torch.compile(build(size, device), backend=args.backend)
    row("plain loop, torch.compile, fused AdamW (baseline)", *timed(plain_loop(baseline, True), data, device))
    del baseline
    free(device)
    plan = {"autocast": autocast} if autocast else {}
    compiled = {"torch_compile": True, "backend": args.backend}
    for label, options in (("eager", {}), (f"torch_compile=True ({args.backend})", compiled)):
        start = time.perf_counter()
        program = program_for(build(size, device), data[0], plan, preset, **options)
        compile_s = time.perf_counter() - start
        step, warm = timed(lambda ids, p=program: p.step(ids, labels=ids), data, device)
        held = allocated(device)  # parameters, gradients, optimizer state between steps
        chosen = program.plan_report.chosen
        row(f"autoshard dp=1, {label}", step, warm, compile_s=compile_s,
            peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None, held_bytes=held,
            predicted_bytes=chosen.memory.total, predicted_memory=dict(chosen.memory.items()),
            predicted_step_s=chosen.step_time, predicted_time=str(chosen.time), plan=str(program.plan),
            fused=[g.get("fused") for g in program.optimizer.param_groups])  # fmt: skip
        del program
        free(device)
    # The device calibrated, and the planner's step with the measured figures instead of the preset's.
    start = time.perf_counter()
    measured = autoshard.Hardware.measure()
    out.add(kind="hardware", seconds=time.perf_counter() - start, measured=json.loads(measured.to_json()),
            preset=json.loads(preset.to_json()))  # fmt: skip
    # The planner does not model compiled graphs: one prediction for both runs.
    planned = program_for(build(size, torch.device("meta")), data[0].cpu(), plan, measured).plan_report.chosen
    out.add(kind="prediction", hardware="measured", predicted_step_s=planned.step_time,
            predicted_bytes=planned.memory.total)  # fmt: skip


# ---- section: suite --------------------------------------------------------------------------------------
def section_suite(args: argparse.Namespace, out: Results) -> None:
    record = out.path.with_suffix(".records")
    record.unlink(missing_ok=True)
    env = {**os.environ, "AUTOSHARD_GPU_RECORD": str(record), "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["AUTOSHARD_GPU_REHEARSAL"] = "1"
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs",
           str(ROOT / "tests" / "test_gpu.py")]  # fmt: skip
    try:
        # From tests/: a checkout's autoshard/ (whose passes/ only an install maps) must not shadow the installed one.
        done = subprocess.run(
            cmd, cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=args.budget - 10
        )
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        code, text = None, f"{_text(stopped.stdout)}{_text(stopped.stderr)}\nstopped at {args.budget - 10} s"
    for line in record.read_text().splitlines() if record.exists() else []:
        out.add(**json.loads(line))
    summary = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    closing = [line for line in text.strip().splitlines() if " in " in line and ("passed" in line or "failed" in line)]
    out.add(kind="suite", returncode=code, last_line=closing[-1:], problems=summary,
            tail=text[-6000:] if code != 0 else "")  # fmt: skip


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


# ---- section: offload ------------------------------------------------------------------------------------
def section_offload(args: argparse.Namespace, out: Results) -> None:
    import autoshard

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    size = SIZES["7b" if cuda else "tiny"]
    data = batches(size, device, 2)  # one step to warm (the optimizer's state appears), one timed
    preset = autoshard.Hardware.preset("h200" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    for offload in (True, False):
        name = f"{'7B-class' if cuda else 'tiny'} Llama, ZeRO-1 {'with' if offload else 'without'} offload"
        try:
            start = time.perf_counter()
            plan = {"zero": 1, "offload": offload, **({"param_dtype": dtype} if cuda else {})}
            program = program_for(build(size, device), data[0], plan, preset)
            setup = time.perf_counter() - start
            step, warm = timed(lambda ids, p=program: p.step(ids, labels=ids), data, device, warmup=1)
            masters = program.runtime.holder.masters
            chosen = program.plan_report.chosen
            out.add(kind="offload", run=name, step_s=step, warmup_s=warm, setup_s=setup,
                    params=sum(p.numel() for p in program.compiled.model.parameters()),
                    peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
                    predicted_bytes=chosen.memory.total, predicted_step_s=chosen.step_time,
                    host_seconds=dict(masters.last_seconds) if offload else None,
                    host_bytes=masters.nbytes() if offload else 0,
                    pinned=all(t.is_pinned() for t in masters.host_tensors()) if offload and cuda else None,
                    tokens_per_s=size["batch"] * size["seq"] / step)  # fmt: skip
            del program, masters
        except torch.OutOfMemoryError as error:
            out.add(kind="offload", run=name, error=f"out of memory: {str(error).splitlines()[0][:300]}")
        free(device)


SECTIONS = {"single": section_single, "suite": section_suite, "offload": section_offload}


# ---- the driver ------------------------------------------------------------------------------------------
def run_section(name: str, args: argparse.Namespace, parts: Path, budget: float) -> list[dict[str, Any]]:
    """Run one section in a child process within ``budget`` seconds; its rows, with an error row if it failed."""
    path = parts / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--parts", str(parts),
           "--device", args.device, "--size", args.size, "--steps", str(args.steps), "--backend", args.backend,
           "--autocast", args.autocast,
           "--budget", str(int(budget))]  # fmt: skip
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    start = time.perf_counter()
    print(f"== {name} (budget {budget:.0f} s)", flush=True)
    try:
        done = subprocess.run(cmd, timeout=budget, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        failure = None if done.returncode == 0 else f"exit code {done.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"stopped at its budget of {budget:.0f} s"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append({"kind": "section", "section": name, "seconds": time.perf_counter() - start, "failure": failure})
    return rows


def table(rows: list[dict[str, Any]], date: str) -> str:
    """The Markdown the README carries."""
    mib = 2**20
    setup = next((r for r in rows if r["kind"] == "setup"), {})
    lines = [
        f"{date}, {setup.get('device', '?')}, torch {setup.get('torch', '?')} (CUDA {setup.get('cuda')}); "
        f"{setup.get('size', '?')} Llama ({setup.get('params', 0) / 1e9:.2f}B parameters), batch "
        f"{setup.get('batch')} x {setup.get('seq')}, {setup.get('precision')}",
        "",
        "| run | step | tokens/s | MFU | MFU / baseline's | peak memory (predicted) | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    speeds = [r for r in rows if r["kind"] == "speed"]
    base = next((r for r in speeds if "baseline" in r["run"]), None)
    for r in speeds:
        ratio = f"{base['step_s'] / r['step_s']:.3f}" if base else ""
        memory = ""
        if r.get("peak_bytes"):
            error = r["predicted_bytes"] / r["peak_bytes"] - 1
            memory = f"{r['peak_bytes'] / mib:,.0f} MiB ({r['predicted_bytes'] / mib:,.0f} MiB, {error:+.1%})"
        notes = f"warm-up {r['warmup_s']:.0f} s"
        if r.get("predicted_step_s"):
            notes += f"; planner (h200 preset): {r['predicted_step_s'] * 1e3:.0f} ms"
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "n/a"
        step = f"{r['step_s'] * 1e3:.1f} ms"
        lines.append(f"| {r['run']} | {step} | {r['tokens_per_s']:,.0f} | {mfu} | {ratio} | {memory} | {notes} |")
    for r in (r for r in rows if r["kind"] == "prediction"):
        for measured in (s for s in speeds if s["run"].startswith("autoshard")):
            error = r["predicted_step_s"] / measured["step_s"] - 1
            lines.append(
                f"| planner with Hardware.measure(), against {measured['run']} | "
                f"{r['predicted_step_s'] * 1e3:.1f} ms predicted | | | | | {error:+.1%} |"
            )
    lines += _hardware_lines(rows) + _grid_lines(rows) + _offload_lines(rows)
    for r in (r for r in rows if r["kind"] == "activations"):
        lines += [
            "",
            f"{r['what']}: {r['measured'] / mib:.1f} MiB on the CUDA allocator, {r['accounted'] / mib:.1f} MiB "
            f"accounted ({r['measured'] / r['accounted'] - 1:+.1%}), {r['korthikanti'] / mib:.1f} MiB by "
            f"Korthikanti et al. ({r['measured'] / r['korthikanti'] - 1:+.1%})",
        ]
    suite = next((r for r in rows if r["kind"] == "suite"), None)
    if suite:
        lines += ["", f"GPU check suite (tests/test_gpu.py): {' '.join(suite['last_line'])}"]
        lines += [f"- {p}" for p in suite["problems"]]
    for r in (r for r in rows if r["kind"] == "section" and r["failure"]):
        lines.append(f"- section {r['section']}: {r['failure']}")
    return "\n".join(lines)


def _hardware_lines(rows: list[dict[str, Any]]) -> list[str]:
    hw = next((r for r in rows if r["kind"] == "hardware" and "seconds" in r), None)
    if not hw:
        return []
    m, p = hw["measured"], hw["preset"]
    lines = ["", f"| figure | Hardware.measure() | {p['name']} preset | measured / preset |", "|---|---|---|---|"]
    for label, key, unit, scale in (
        ("bf16 matmul rate", "peak_flops", "TFLOP/s", 1e12),
        ("memory bandwidth", "memory_bandwidth", "GB/s", 1e9),
        ("host link (pinned copies)", "host_bandwidth", "GB/s", 1e9),
        ("host memory", "host_memory_bandwidth", "GB/s", 1e9),
        ("per-op overhead", "op_overhead", "us", 1e-6),
    ):
        if key == "peak_flops":  # what a large GEMM reaches: the peak times the efficiency
            a = m[key].get("bfloat16", m[key].get("float32")) * m["matmul_efficiency"]
            b = p[key]["bfloat16"] * p["matmul_efficiency"]
        else:
            a, b = m[key], p[key]
        lines.append(f"| {label} | {a / scale:,.1f} {unit} | {b / scale:,.1f} {unit} | {a / b:.2f} |")
    return lines


def _grid_lines(rows: list[dict[str, Any]]) -> list[str]:
    grid = [r for r in rows if r["kind"] == "equivalence"]
    if not grid:
        return []
    lines = ["", "| plan, every tensor on the GPU | ranks | collectives | loss gap | max parameter gap |"]
    lines.append("|---|---|---|---|---|")
    for r in grid:
        gaps = f"{r['loss_rel_gap']:.1e} | {r['param_max_abs_gap']:.1e}"
        lines.append(f"| {r['family']} {r['plan']} | {r['world']} | {r['backend']} | {gaps} |")
    return lines


def _offload_lines(rows: list[dict[str, Any]]) -> list[str]:
    offload = [r for r in rows if r["kind"] == "offload"]
    if not offload:
        return []
    mib = 2**20
    lines = ["", "| offload | step | tokens/s | peak device memory (predicted) | host step | copies not hidden |"]
    lines.append("|---|---|---|---|---|---|")
    for r in offload:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['error']} | | | | |")
            continue
        host = r.get("host_seconds") or {}
        peak = ""
        if r.get("peak_bytes"):
            peak = f"{r['peak_bytes'] / mib:,.0f} MiB ({r['predicted_bytes'] / mib:,.0f} MiB)"
        exposed = host.get("wait_down", 0) + host.get("wait_up", 0)
        lines.append(
            f"| {r['run']} | {r['step_s']:.2f} s | {r['tokens_per_s']:,.0f} | {peak} | "
            f"{host.get('host_step', 0):.2f} s | {exposed:.2f} s |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="the folder for gpu.json and gpu.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 1b on cuda, tiny on cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--autocast", choices=("auto", "bf16", "none"), default="auto", help="auto: bf16 on cuda")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="which sections, in order")
    parser.add_argument("--budget", type=float, default=sum(BUDGETS.values()), help="seconds for all sections")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child process: one section
    parser.add_argument("--parts", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device; pass --device cpu")
    args.size = args.size or ("1b" if args.device == "cuda" else "tiny")
    if args.section:
        results = Results(args.parts / f"{args.section}.json")
        if args.section != "suite":
            init_one_rank(torch.device(args.device))
        try:
            SECTIONS[args.section](args, results)
        except Exception:
            results.add(kind="error", section=args.section, traceback=traceback.format_exc()[-3000:])
            raise
        return
    if args.out is None:
        parser.error("--out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    parts = Path(os.environ.get("TMPDIR", "/tmp")) / f"autoshard-gpu-{os.getpid()}"
    parts.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    names = args.sections.split(",")
    end = time.perf_counter() + args.budget
    for i, name in enumerate(names):
        # A section may take its own budget, but leaves the ones after it theirs out of what is left.
        left, later = end - time.perf_counter(), sum(BUDGETS[n] for n in names[i + 1 :])
        budget = min(BUDGETS[name] * 1.25, left - 0.8 * later)
        rows += run_section(name, args, parts, max(budget, 20.0))
        (args.out / "gpu.json").write_text(json.dumps(rows, indent=1))
    markdown = table(rows, time.strftime("%Y-%m-%d"))
    (args.out / "gpu.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
