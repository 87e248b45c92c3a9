"""autoshard benchmarks: each line is a ratio measured side by side in one run.

    python bench/run.py            # all benchmarks
    python bench/run.py --only capture

Not a test: nothing here asserts a duration. Numbers depend on the machine; the ratios are the point.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
from allocations import allocation_trace
from autoshard.passes import tp_rewrite
from checkpoint import bench_checkpoint
from context import bench_context
from experts import bench_experts
from recompute import bench_recompute

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import LocalRanks
from autoshard.spec.schedule_builders import build_schedule
from autoshard.spec.schedules import V_SCHEDULES, Action, Schedule

RESULTS: list[tuple[str, str, str, float, str]] = []


def report(name: str, ours: str, theirs: str, ratio: float, target: str) -> None:
    RESULTS.append((name, ours, theirs, ratio, target))
    print(f"{name}: autoshard {ours} | reference {theirs} | ratio {ratio:.3f} (target {target})", flush=True)


def bench_capture_llama_7b() -> None:
    """Capture + analysis of Llama-2-7B on the meta device (no weights allocated)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32000, (64, 4096))
    start = time.perf_counter()
    program = autoshard.compile(model, 64, (ids,), {"labels": ids, "use_cache": False})
    seconds = time.perf_counter() - start
    nodes = len(program.captured_graph.graph.nodes)
    report(
        f"compile Llama-2-7B on meta ({nodes} nodes, {program.cost.param_bytes / 4 / 1e9:.2f}B params)",
        f"{seconds:.1f} s",
        "30 s budget",
        seconds / 30.0,
        "< 1.0",
    )


def _gpt_batches(cfg: dict[str, int], rank: int, world_size: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``n`` local batches of (tokens, next tokens)."""
    gen = torch.Generator().manual_seed(rank)
    local = cfg["batch"] // world_size
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg["vocab"], (local, cfg["seq"] + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _gpt(cfg: dict[str, int]) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"], layers=cfg["layers"], max_seq=cfg["seq"])


def _ddp_vs_autoshard(rank: int, world_size: int, cfg: dict[str, int], steps: int, rounds: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    def model() -> TinyGPT:
        return _gpt(cfg)

    data = _gpt_batches(cfg, rank, world_size, steps)
    global_ids = torch.cat([data[0][0]] * world_size)
    global_target = torch.cat([data[0][1]] * world_size)
    program = autoshard.compile(
        model(),
        autoshard.Mesh(dp=world_size),
        example_inputs=(global_ids,),
        loss_fn=next_token_loss,
        example_target=global_target,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    ddp = DistributedDataParallel(model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def ddp_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        ddp_opt.zero_grad(set_to_none=True)
        loss = next_token_loss(ddp(ids), target)
        loss.backward()
        ddp_opt.step()

    def autoshard_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        program.step(ids, target=target)

    timings: dict[str, list[float]] = {"autoshard": [], "ddp": []}
    for fn in (autoshard_step, ddp_step):  # warm-up
        for ids, target in data[:2]:
            fn(ids, target)
    for _ in range(rounds):  # alternate, so drift hits both alike
        for name, fn in (("autoshard", autoshard_step), ("ddp", ddp_step)):
            torch.distributed.barrier()
            start = time.perf_counter()
            for ids, target in data:
                fn(ids, target)
            torch.distributed.barrier()
            timings[name].append((time.perf_counter() - start) / len(data))
    return timings


def bench_dp_vs_ddp(ranks: int = 4) -> None:
    cfg = GPT
    with LocalRanks(ranks) as pool:
        timings = pool.run(_ddp_vs_autoshard, cfg, steps=5, rounds=4)[0]
    ours, theirs = statistics.median(timings["autoshard"]), statistics.median(timings["ddp"])
    params = sum(
        p.numel() for p in TinyGPT(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], cfg["seq"]).parameters()
    )
    report(
        f"dp={ranks} step, GPT {params / 1e6:.1f}M params, batch {cfg['batch']}x{cfg['seq']} (gloo, CPU)",
        f"{ours * 1e3:.1f} ms",
        f"DDP {theirs * 1e3:.1f} ms",
        ours / theirs,
        "<= 1.05",
    )


GPT = {"vocab": 4096, "dim": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16}


def _compiled_vs_ddp(rank: int, world_size: int, cfg: dict[str, int], steps: int, rounds: int) -> dict[str, Any]:
    """dp=world_size with torch_compile=True (inductor) against DDP around torch.compile(model), both warm."""
    import os
    import tempfile

    from torch.nn.parallel import DistributedDataParallel

    # A fresh inductor cache per run: both sides compile from scratch, nothing carried over between runs.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor-{rank}-")
    data = _gpt_batches(cfg, rank, world_size, steps)

    def model() -> TinyGPT:
        return _gpt(cfg)

    start = time.perf_counter()
    program = autoshard.compile(
        model(),
        autoshard.Mesh(dp=world_size),
        example_inputs=(torch.cat([data[0][0]] * world_size),),
        loss_fn=next_token_loss,
        example_target=torch.cat([data[0][1]] * world_size),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        torch_compile=True,
    )
    program.step(*data[0][:1], target=data[0][1])
    ours_compile = time.perf_counter() - start
    ddp = DistributedDataParallel(torch.compile(model()))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def ddp_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        ddp_opt.zero_grad(set_to_none=True)
        next_token_loss(ddp(ids), target).backward()
        ddp_opt.step()

    start = time.perf_counter()
    ddp_step(*data[0])
    theirs_compile = time.perf_counter() - start
    # With torch_compile=True autoshard steps the user's AdamW on torch's fused kernel (the user left the
    # choice open); the same DDP with that kernel too shows how much of the difference that is.
    fused = DistributedDataParallel(torch.compile(model()))
    fused_opt = torch.optim.AdamW(fused.parameters(), lr=1e-4, fused=True)

    def fused_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        fused_opt.zero_grad(set_to_none=True)
        next_token_loss(fused(ids), target).backward()
        fused_opt.step()

    timings = _alternate(
        lambda ids, target: program.step(ids, target=target), ddp_step, data, rounds, {"torch fused": fused_step}
    )
    return {
        "timings": timings,
        "compile": (ours_compile, theirs_compile, program.compile_seconds),
        "graphs": [str(g) for g in program.compiled_graphs],
    }


def bench_compiled_vs_ddp(ranks: int = 4) -> None:
    cfg = GPT
    with LocalRanks(ranks) as pool:
        result = pool.run(_compiled_vs_ddp, cfg, steps=5, rounds=6)[0]
    timings = result["timings"]
    ours, theirs = statistics.median(timings["autoshard"]), statistics.median(timings["torch"])
    theirs_fused = statistics.median(timings["torch fused"])
    params = sum(
        p.numel() for p in TinyGPT(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], cfg["seq"]).parameters()
    )
    print("  autoshard's compiled graphs on rank 0:", "; ".join(result["graphs"]))
    report(
        f"dp={ranks} step with torch_compile=True (inductor), GPT {params / 1e6:.1f}M params, batch "
        f"{cfg['batch']}x{cfg['seq']}, both warm",
        f"{ours * 1e3:.1f} ms",
        f"DDP(torch.compile(model)) {theirs * 1e3:.1f} ms",
        ours / theirs,
        "<= 1.0",
    )
    report(
        "same, DDP's AdamW on torch's fused kernel too (fused=True: the kernel torch_compile=True gives autoshard's)",
        f"{ours * 1e3:.1f} ms",
        f"DDP(torch.compile(model)), AdamW(fused=True) {theirs_fused * 1e3:.1f} ms",
        ours / theirs_fused,
        "(reported)",
    )
    ours_first, theirs_first, backend_seconds = result["compile"]
    report(
        "same: compile + first step on rank 0 (autoshard: capture, plan, torch.compile of the rank graph)",
        f"{ours_first:.1f} s (AOTAutograd + inductor {backend_seconds:.1f} s)",
        f"{theirs_first:.1f} s",
        ours_first / theirs_first,
        "(reported)",
    )


def _held_bytes(tensors: Any) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen and t.dim() > 0:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_allocated(step: Any) -> int:
    """Peak bytes of tensors allocated during one call of ``step`` above what was allocated before it
    (bench/allocations.py; RSS, below, counts gloo's own buffers too)."""
    return allocation_trace(step)[2]


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux clear_refs 5); return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _sharded_step(rank: int, world_size: int, system: str, cfg: dict[str, int], steps: int) -> dict[str, Any]:
    """One system on fresh ranks: median step time, tensors held after a step, and peak RSS growth."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = TinyGPT(vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"], layers=cfg["layers"], max_seq=cfg["seq"])
    gen = torch.Generator().manual_seed(rank)
    local = cfg["batch"] // world_size
    tokens = torch.randint(0, cfg["vocab"], (local, cfg["seq"] + 1), generator=gen)
    ids, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    if system.startswith("autoshard"):
        zero = int(system[-1])
        program = autoshard.compile(
            model,
            autoshard.Mesh(dp=world_size),
            example_inputs=(torch.cat([ids] * world_size),),
            loss_fn=next_token_loss,
            example_target=torch.cat([target] * world_size),
            optimizer=adamw,
            plan={"zero": zero},
        )

        def step() -> None:
            program.step(ids, target=target)

        def held() -> int:
            return sum(program.last_step_memory.values())
    else:
        if system == "ddp+zero_redundancy":
            wrapped = DistributedDataParallel(model)
            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
            inner = opt.optim
        else:  # fsdp2
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            wrapped = fully_shard(model)
            opt = inner = adamw(model.parameters())

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            next_token_loss(wrapped(ids), target).backward()
            opt.step()

        def held() -> int:
            params = list(model.parameters())
            state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            return _held_bytes(params) + _held_bytes(p.grad for p in params) + _held_bytes(state)

    for _ in range(2):
        step()
    rss_before = _reset_peak_rss()  # peak over the timed training steps only, not compile or set-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    rss = _status_bytes("VmHWM") - rss_before
    return {"seconds": statistics.median(times), "held": held(), "rss": rss, "peak": _peak_allocated(step)}


def _run_system(system: str, ranks: int, steps: int) -> dict[str, Any]:
    with LocalRanks(ranks) as pool:
        results = pool.run(_sharded_step, system, GPT, steps)
    return {
        "seconds": statistics.median(r["seconds"] for r in results),
        "held": max(r["held"] for r in results),
        "rss": max(r["rss"] for r in results),
        "peak": max(r["peak"] for r in results),
    }


def bench_zero_vs_torch(ranks: int = 4, steps: int = 6, rounds: int = 2) -> None:
    """ZeRO-1 vs ZeroRedundancyOptimizer + DDP, ZeRO-3 vs FSDP2 (fully_shard per block): time and memory.

    Each system runs on fresh ranks, alternating ours and theirs ``rounds`` times so drift hits both.
    """
    for ours, theirs in (("autoshard zero=1", "ddp+zero_redundancy"), ("autoshard zero=3", "fsdp2")):
        runs: dict[str, list[dict[str, Any]]] = {ours: [], theirs: []}
        for _ in range(rounds):
            for system in (ours, theirs):
                runs[system].append(_run_system(system, ranks, steps))
        a, b = ({k: statistics.mean(r[k] for r in runs[s]) for k in runs[s][0]} for s in (ours, theirs))
        report(
            f"{ours} vs {theirs}: step time, dp={ranks}",
            f"{a['seconds'] * 1e3:.1f} ms",
            f"{b['seconds'] * 1e3:.1f} ms",
            a["seconds"] / b["seconds"],
            "<= 1.1",
        )
        report(
            f"{ours} vs {theirs}: tensors held per rank (params+grads+optimizer)",
            f"{a['held'] / 2**20:.1f} MiB",
            f"{b['held'] / 2**20:.1f} MiB",
            a["held"] / b["held"],
            "<= 1.0",
        )
        report(
            f"{ours} vs {theirs}: peak tensor bytes allocated during a step, per rank",
            f"{a['peak'] / 2**20:.2f} MiB",
            f"{b['peak'] / 2**20:.2f} MiB",
            a["peak"] / max(b["peak"], 1),
            "<= 1.0",
        )
        report(
            f"{ours} vs {theirs}: peak RSS above the pre-step RSS, per rank",
            f"{a['rss'] / 2**20:.1f} MiB",
            f"{b['rss'] / 2**20:.1f} MiB",
            a["rss"] / max(b["rss"], 1),
            "<= 1.0",
        )


def _memory_rank(rank: int, world_size: int, zero: int) -> dict[str, int]:
    import gc

    import transformers

    gc.collect()  # the previous stage's program

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=128))  # GPT-2 small, 124M
    ids = torch.randint(0, 50257, (world_size, 64))
    program = autoshard.compile(
        model,
        autoshard.Mesh(dp=world_size),
        example_inputs=(ids,),
        example_kwargs={"labels": ids, "use_cache": False},
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        plan={"zero": zero},
    )
    local = program.local_batch(ids)
    for _ in range(2):  # the second step measures with the optimizer state in place
        program.step(local, labels=local)
    zero3 = program.runtime.holder.runtime if zero == 3 else None
    return {
        **program.last_step_memory,
        "param_bytes": program.cost.param_bytes,
        "peak_gathered": zero3.peak_gathered_bytes if zero3 else 0,
        "largest_group": max(lay.padded * 4 for lay in zero3.layouts.values()) if zero3 else 0,
    }


def bench_zero_memory_table(ranks: int = 4) -> None:
    """Bytes each rank holds by category for GPT-2 small, measured vs the ZeRO formulas (fp32, Adam K=8)."""
    print(f"\nZeRO memory per rank, GPT-2 small (124M params, fp32, AdamW), dp={ranks}")
    print(f"{'stage':<6} {'category':<11} {'measured MiB':>13} {'formula MiB':>12} {'ratio':>7}")
    n = ranks
    with LocalRanks(ranks) as pool:
        for zero in (0, 1, 2, 3):
            result = pool.run(_memory_rank, zero)[0]
            psi = result["param_bytes"] / 4
            formula = {
                "parameters": 4 * psi / (n if zero == 3 else 1),
                "gradients": 4 * psi / (n if zero >= 2 else 1),
                "optimizer": 8 * psi / (n if zero >= 1 else 1),
            }
            for category, value in formula.items():
                measured = result[category]
                ratio = measured / value
                print(f"{zero:<6} {category:<11} {measured / 2**20:>13.1f} {value / 2**20:>12.1f} {ratio:>7.3f}")
            if zero == 3:
                print(
                    f"ZeRO-3 peak of gathered parameters: {result['peak_gathered'] / 2**20:.1f} MiB = "
                    f"{result['peak_gathered'] / result['largest_group']:.2f} x the largest layer "
                    f"({result['largest_group'] / 2**20:.1f} MiB, the tied embedding)"
                )
            total = sum(result[c] for c in formula)
            report(
                f"ZeRO-{zero} GPT-2 small: bytes held per rank vs formula",
                f"{total / 2**20:.0f} MiB",
                f"formula {sum(formula.values()) / 2**20:.0f} MiB",
                total / sum(formula.values()),
                "within 0.9-1.1",
            )


class Blocks(torch.nn.Module):
    """Identical MLP blocks: every pipeline stage costs the same, so the bubble is the schedule's alone."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


PIPE = {"blocks": 8, "width": 1024, "batch": 256, "microbatches": 8}


def _pipeline_vs_torch(rank: int, world_size: int, schedule: str, steps: int, rounds: int) -> dict[str, Any]:
    from torch.distributed import pipelining

    cfg = PIPE
    mse = torch.nn.functional.mse_loss
    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(cfg["batch"], cfg["width"], generator=gen), torch.randn(cfg["batch"], cfg["width"], generator=gen))
        for _ in range(steps)
    ]

    def model() -> Blocks:
        torch.manual_seed(0)
        return Blocks(cfg["blocks"], cfg["width"])

    plan = {"schedule": schedule, "microbatches": cfg["microbatches"]}
    program = autoshard.compile(
        model(),
        autoshard.Mesh(pp=world_size),
        example_inputs=(data[0][0],),
        loss_fn=mse,
        example_target=data[0][1],
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        plan=plan,
    )
    # The same split for torch.distributed.pipelining: the blocks autoshard put on this rank.
    mine = sorted({int(name.split(".")[1]) for name in program.for_rank(rank).placements})
    blocks = model().blocks
    m = cfg["microbatches"]
    if schedule in ("zbv", "dualpipev"):  # two stages a rank, as a V: the lower blocks stage r, the others 2p-1-r
        halves = [mine[: len(mine) // 2], mine[len(mine) // 2 :]]
        modules = [torch.nn.Sequential(*(blocks[i] for i in half)) for half in halves]
        indices = [rank, 2 * world_size - 1 - rank]
        stages = [
            pipelining.PipelineStage(mod, i, 2 * world_size, torch.device("cpu")) for mod, i in zip(modules, indices)
        ]
        v_schedule = pipelining.ScheduleZBVZeroBubble if schedule == "zbv" else pipelining.ScheduleDualPipeV
        theirs = v_schedule(stages, n_microbatches=m, loss_fn=mse)
        first, last = 0, 0  # the V starts and ends on rank 0
    else:
        modules = [torch.nn.Sequential(*(blocks[i] for i in mine))]
        stages = [pipelining.PipelineStage(modules[0], rank, world_size, torch.device("cpu"))]
        if schedule == "zb_h1":  # torch's zero-bubble schedule, one stage a rank
            theirs = pipelining.ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=mse)
        else:
            schedule_cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
            theirs = schedule_cls(stages[0], n_microbatches=m, loss_fn=mse)
        first, last = 0, world_size - 1
    their_opt = torch.optim.AdamW([p for mod in modules for p in mod.parameters()], lr=1e-4)

    def their_step(x: torch.Tensor, y: torch.Tensor) -> None:
        their_opt.zero_grad(set_to_none=True)
        if rank == first == last:
            theirs.step(x, target=y, losses=[])
        elif rank == first:
            theirs.step(x)
        elif rank == last:
            theirs.step(target=y, losses=[])
        else:
            theirs.step()
        their_opt.step()

    def our_step(x: torch.Tensor, y: torch.Tensor) -> None:
        program.step(x, target=y)

    idle: list[float] = []
    windows: list[tuple[float, float, float]] = []  # each step's (start, seconds, busy seconds) on the host's clock
    durations: dict[tuple[int, str], list[float]] = {}  # (stage, kind) -> seconds of each action measured

    def our_step_measured(x: torch.Tensor, y: torch.Tensor) -> None:
        our_step(x, y)
        stats = program.pipeline_stats
        idle.append(stats.idle_fraction)
        windows.append((stats.started_at, stats.step_seconds, stats.busy_seconds))
        for text, began, ended in stats.events:
            action = Action.parse(text)
            durations.setdefault((action.stage, action.kind), []).append(ended - began)

    timings = _alternate(our_step_measured, their_step, data, rounds)
    in_flight = program.pipeline_stats.peak_in_flight
    peak = _peak_allocated(lambda: our_step(*data[0]))  # activations and a step's temporaries
    return {
        "timings": timings,
        "idle": statistics.median(idle),
        "windows": windows,
        "in_flight": in_flight,
        "peak": peak,
        "durations": {key: statistics.median(seconds) for key, seconds in durations.items()},
    }


@dataclasses.dataclass(frozen=True)
class _MeasuredStage:
    """A stage's median action times as measured, in the form the planner's simulation reads."""

    forward: float
    backward: float  # B and W together where backward is split
    send: float
    weight_grad: float


def _medians(results: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """Every stage's median seconds of each action kind, (stage, kind) -> seconds, over the ranks' results."""
    return {key: seconds for r in results for key, seconds in r["durations"].items()}


def _kind_means(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each action kind's median seconds, the mean over the stages."""
    measured = _medians(results)
    kinds = {kind for _, kind in measured}
    return {kind: statistics.mean(t for (_, k), t in measured.items() if k == kind) for kind in kinds}


def _floor_idle(
    schedule_name: str, ranks: int, results: list[dict[str, Any]], steps: int = 6, alike: bool = False
) -> float:
    """The schedule's own idle fraction per rank, as measured (each rank's window from its step's start to its
    last action), with each action as long as its measured median and each hand-over instant: the planner's
    simulation (autoshard/planner/simulate.py) of ``steps`` steps back to back, each rank starting the next
    where it ended its own (the optimizer step, longer than the ranks end apart, keeps them that far apart);
    the mean over ranks and over the steps after the first two (which fill the pipeline from a common start).
    What the measured idle adds to it is the actions' variation (one rank's action running long holds up the
    next rank) and the ranks' optimizer steps unequal. ``alike``: every stage as long as the stages' mean of
    each kind, which leaves out the ranks' cores running at unequal speeds: the schedule's bound at this
    machine's ratio of W to F."""
    from autoshard.planner.simulate import simulate

    measured = _medians(results)
    if alike:
        mean = _kind_means(results)
        measured = {(stage, kind): mean[kind] for stage, kind in measured}
    virtual = 2 if schedule_name in V_SCHEDULES else 1
    one = build_schedule(schedule_name, ranks, PIPE["microbatches"], virtual)
    m = one.microbatches
    repeated = tuple(
        tuple(Action(a.stage, a.kind, a.microbatch + k * m) for k in range(steps) for a in actions)
        for actions in one.ranks
    )
    schedule = Schedule(one.name, one.pp, m * steps, virtual, repeated, one.placement)
    stages = []
    for stage in range(schedule.n_stages):
        w = measured.get((stage, "W"), 0.0)
        stages.append(_MeasuredStage(measured[(stage, "F")], measured[(stage, "B")] + w, 0.0, w))
    _, _, timeline = simulate(schedule, tuple(stages), timeline=True)
    idle = []
    for rank, rows in enumerate(timeline):
        n = len(one.ranks[rank])
        for k in range(2, steps):
            step = rows[k * n : (k + 1) * n]
            window = step[-1][2] - rows[k * n - 1][2]
            idle.append(1 - sum(end - start for _, start, end in step) / window)
    return statistics.mean(idle)


def _common_idle(results: list[dict[str, Any]]) -> float:
    """The mean idle fraction per rank over each step's common window (the first rank's start to the last rank's
    end, one clock for the host's ranks), the median over steps. A rank's own window (``idle``) ends with its
    last action and leaves out its wait for the others at the step's end, which (p-1)/(m+p-1) counts."""
    per_step = []
    for steps in zip(*(r["windows"] for r in results)):
        start, end = min(s for s, _, _ in steps), max(s + seconds for s, seconds, _ in steps)
        per_step.append(statistics.mean(1 - busy / (end - start) for _, _, busy in steps))
    return statistics.median(per_step)


def _alternate(
    ours: Any, theirs: Any, data: list[Any], rounds: int, more: dict[str, Any] | None = None
) -> dict[str, list[float]]:
    """Seconds per step of each system (``more``: further ones, by name), timed in alternating rounds so that
    drift hits all alike."""
    import torch.distributed as dist

    systems = {"autoshard": ours, "torch": theirs, **(more or {})}
    timings: dict[str, list[float]] = {name: [] for name in systems}
    for fn in systems.values():  # warm-up
        for x, y in data[:2]:
            fn(x, y)
    names = list(systems)
    for round_ in range(rounds):
        shift = round_ % len(names)  # each round starts at another system: none is always first
        for name in names[shift:] + names[:shift]:
            fn = systems[name]
            dist.barrier()
            start = time.perf_counter()
            for x, y in data:
                fn(x, y)
            dist.barrier()
            timings[name].append((time.perf_counter() - start) / len(data))
    return timings


def bench_pipeline() -> None:
    """Bubble and activations held per schedule, and step time vs torch.distributed.pipelining.

    4 ranks as asked; the 2 cores of the development machine are then oversubscribed, which stretches
    every hand-over between ranks, so the bubble is also measured on 2 ranks (one core each).
    """
    cfg = PIPE
    m = cfg["microbatches"]
    for ranks in (4, 2):
        for schedule in ("gpipe", "1f1b"):
            with LocalRanks(ranks) as pool:
                results = pool.run(_pipeline_vs_torch, schedule, steps=3, rounds=5 if ranks == 4 else 1)
            bubble = (ranks - 1) / (m + ranks - 1)
            idle = [r["idle"] for r in results]
            report(
                f"pp={ranks} {schedule}, m={m}: idle fraction per rank vs (p-1)/(m+p-1)",
                " ".join(f"{x:.2f}" for x in idle),
                f"formula {bubble:.3f}",
                statistics.mean(idle) / bubble,
                "within 0.8-1.2",
            )
            common = _common_idle(results)
            report(
                f"pp={ranks} {schedule}, m={m}: mean idle fraction per rank over the step's common window vs "
                f"(p-1)/(m+p-1)",
                f"{common:.3f}",
                f"formula {bubble:.3f}",
                common / bubble,
                "reported",
            )
            if ranks == 2:
                continue
            report(
                f"pp={ranks} {schedule}, m={m}: peak microbatches in flight per rank",
                " ".join(str(r["in_flight"]) for r in results),
                f"{'m' if schedule == 'gpipe' else 'at most p'} = {m if schedule == 'gpipe' else ranks}",
                max(r["in_flight"] for r in results) / (m if schedule == "gpipe" else ranks),
                "1.0 gpipe, <= 1.0 1f1b",
            )
            ours = statistics.median(t for r in results for t in r["timings"]["autoshard"])
            theirs = statistics.median(t for r in results for t in r["timings"]["torch"])
            params = sum(p.numel() for p in Blocks(cfg["blocks"], cfg["width"]).parameters())
            report(
                f"pp={ranks} {schedule} step, {cfg['blocks']} blocks ({params / 1e6:.1f}M params), "
                f"batch {cfg['batch']}, m={m} (gloo, CPU)",
                f"{ours * 1e3:.1f} ms",
                f"torch.distributed.pipelining {theirs * 1e3:.1f} ms",
                ours / theirs,
                "<= 1.0",
            )


def bench_zero_bubble() -> None:
    """ZB-H1, ZBV and DualPipeV against 1F1B on the same blocks and ranks, one run: idle time per rank (what W
    fills) and the step against torch.distributed.pipelining's ScheduleInterleavedZeroBubble (one stage a
    rank), ScheduleZBVZeroBubble and ScheduleDualPipeV (two, as a V)."""
    cfg = PIPE
    m = cfg["microbatches"]
    torch_names = {
        "zb_h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"
    }  # fmt: skip
    targets = {"zb_h1": "<= 0.55", "zbv": "<= 0.35", "dualpipev": "reported"}
    for ranks in (4, 2):
        results = {}
        for schedule in ("1f1b", "zb_h1", "zbv", "dualpipev"):
            with LocalRanks(ranks) as pool:
                results[schedule] = pool.run(_pipeline_vs_torch, schedule, steps=3, rounds=3)
        idle = {s: statistics.mean(r["idle"] for r in results[s]) for s in results}
        floor = {s: _floor_idle(s, ranks, results[s]) for s in results}
        alike = {s: _floor_idle(s, ranks, results[s], alike=True) for s in results}
        common = {s: _common_idle(results[s]) for s in results}
        step = {
            (s, who): statistics.median(t for r in results[s] for t in r["timings"][who])
            for s in results
            for who in ("autoshard", "torch")
        }
        peak = {s: max(r["peak"] for r in results[s]) for s in results}
        for schedule in ("zb_h1", "zbv", "dualpipev"):
            report(
                f"pp={ranks} m={m}: peak tensor bytes allocated in a step (most loaded rank), {schedule} vs 1f1b",
                f"{peak[schedule] / 2**20:.1f} MiB",
                f"1f1b {peak['1f1b'] / 2**20:.1f} MiB",
                peak[schedule] / peak["1f1b"],
                "<= 1.1" if schedule == "zb_h1" else "reported",
            )
            report(
                f"pp={ranks} m={m}: mean idle fraction per rank, {schedule} vs 1f1b",
                f"{idle[schedule]:.3f}",
                f"1f1b {idle['1f1b']:.3f}",
                idle[schedule] / idle["1f1b"],
                targets[schedule],
            )
            report(
                f"pp={ranks} m={m}: the schedule's own idle fraction, {schedule} vs 1f1b: simulated with each action "
                f"as long as its measured median, without their variation (what the ratio above would be without it)",
                f"{floor[schedule]:.3f}",
                f"1f1b {floor['1f1b']:.3f}",
                floor[schedule] / floor["1f1b"],
                "reported",
            )
            kinds = _kind_means(results[schedule])
            report(
                f"pp={ranks} m={m}: the schedule's own idle fraction with every stage alike (the stages' mean F, B, W "
                f"measured: {kinds['F'] * 1e3:.1f}, {kinds['B'] * 1e3:.1f}, {kinds['W'] * 1e3:.1f} ms, W / F "
                f"{kinds['W'] / kinds['F']:.2f}), {schedule} vs 1f1b: the bound at this machine's W / F",
                f"{alike[schedule]:.3f}",
                f"1f1b {alike['1f1b']:.3f}",
                alike[schedule] / alike["1f1b"],
                "reported",
            )
            report(
                f"pp={ranks} m={m}: mean idle fraction per rank over the step's common window, {schedule} vs 1f1b",
                f"{common[schedule]:.3f}",
                f"1f1b {common['1f1b']:.3f}",
                common[schedule] / common["1f1b"],
                "reported",
            )
            report(
                f"pp={ranks} m={m}: {schedule} step (gloo, CPU)",
                f"{step[schedule, 'autoshard'] * 1e3:.1f} ms",
                f"torch {torch_names[schedule]} {step[schedule, 'torch'] * 1e3:.1f} ms",
                step[schedule, "autoshard"] / step[schedule, "torch"],
                "<= 1.0" if schedule != "dualpipev" else "reported",
            )
            report(
                f"pp={ranks} m={m}: {schedule} step vs autoshard's 1f1b",
                f"{step[schedule, 'autoshard'] * 1e3:.1f} ms",
                f"1f1b {step['1f1b', 'autoshard'] * 1e3:.1f} ms",
                step[schedule, "autoshard"] / step["1f1b", "autoshard"],
                "reported",
            )


def _compiled_pipelines(rank: int, world_size: int, steps: int, rounds: int) -> dict:
    """Seconds per step and idle share of 1F1B and ZB-H1 on the same blocks with torch_compile=True, timed in
    alternating rounds."""
    schedules = ("1f1b", "zb_h1")
    cfg = PIPE
    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(cfg["batch"], cfg["width"], generator=gen), torch.randn(cfg["batch"], cfg["width"], generator=gen))
        for _ in range(steps)
    ]
    programs = {}
    for schedule in schedules:
        torch.manual_seed(0)
        programs[schedule] = autoshard.compile(
            Blocks(cfg["blocks"], cfg["width"]),
            autoshard.Mesh(pp=world_size),
            example_inputs=(data[0][0],),
            loss_fn=torch.nn.functional.mse_loss,
            example_target=data[0][1],
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
            plan={"schedule": schedule, "microbatches": cfg["microbatches"]},
            torch_compile=True,
        )
    idle: dict[str, list[float]] = {s: [] for s in schedules}

    def stepper(schedule: str) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            programs[schedule].step(x, target=y)
            idle[schedule].append(programs[schedule].pipeline_stats.idle_fraction)

        return step

    timings = _alternate(stepper("zb_h1"), stepper("1f1b"), data, rounds)  # timed as "autoshard" and "torch"
    return {"timings": {"zb_h1": timings["autoshard"], "1f1b": timings["torch"]}, "idle": idle}


def bench_zero_bubble_compiled() -> None:
    """ZB-H1 against 1F1B, both with torch_compile=True (inductor), on the same blocks and 4 ranks."""
    with LocalRanks(4) as pool:
        results = pool.run(_compiled_pipelines, steps=3, rounds=3)
    ours = statistics.median(t for r in results for t in r["timings"]["zb_h1"])
    theirs = statistics.median(t for r in results for t in r["timings"]["1f1b"])
    idle = {s: statistics.mean(statistics.median(r["idle"][s]) for r in results) for s in ("1f1b", "zb_h1")}
    report(
        f"pp=4 m={PIPE['microbatches']}, torch_compile=True: zb_h1 step vs compiled 1f1b",
        f"{ours * 1e3:.1f} ms (idle {idle['zb_h1']:.3f})",
        f"1f1b {theirs * 1e3:.1f} ms (idle {idle['1f1b']:.3f})",
        ours / theirs,
        "reported",
    )


TP = {"blocks": 4, "width": 512, "heads": 8, "batch": 4, "seq": 64}


class TpBlock(torch.nn.Module):
    """A pre-LN transformer block with separate q, k, v projections: shardable by a hand-written TP plan."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.ln_1 = torch.nn.LayerNorm(width)
        self.q = torch.nn.Linear(width, width, bias=False)
        self.k = torch.nn.Linear(width, width, bias=False)
        self.v = torch.nn.Linear(width, width, bias=False)
        self.o = torch.nn.Linear(width, width, bias=False)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln_1(x)
        # -1 heads: the same code runs on a rank's local shard of the heads under parallelize_module.
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln_2(x))))


class TpModel(torch.nn.Module):
    def __init__(self, blocks: int, width: int, heads: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(TpBlock(width, heads) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _tp_vs_torch(rank: int, world_size: int, steps: int, rounds: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = TP

    def model() -> TpModel:
        torch.manual_seed(0)
        return TpModel(cfg["blocks"], cfg["width"], cfg["heads"])

    gen = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], cfg["seq"], cfg["width"])
    data = [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)) for _ in range(steps)]

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    program = autoshard.compile(
        model(),
        autoshard.Mesh(tp=world_size),
        example_inputs=(data[0][0],),
        loss_fn=torch.nn.functional.mse_loss,
        example_target=data[0][1],
        optimizer=adamw,
    )
    theirs = model()
    plan = {}
    for i in range(cfg["blocks"]):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "fc2")})
    parallelize_module(theirs, init_device_mesh("cpu", (world_size,)), plan)
    their_opt = adamw(theirs.parameters())

    def their_step(x: torch.Tensor, y: torch.Tensor) -> None:
        their_opt.zero_grad()
        torch.nn.functional.mse_loss(theirs(x), y).backward()
        their_opt.step()

    def our_step(x: torch.Tensor, y: torch.Tensor) -> None:
        program.step(x, target=y)

    # The same computation on both sides: equal first losses, else the timing comparison means nothing.
    with torch.no_grad():
        their_first = torch.nn.functional.mse_loss(theirs(data[0][0]), data[0][1]).item()
    our_first = program.step(data[0][0], target=data[0][1])
    if abs(our_first - their_first) > 1e-5 * abs(their_first):
        raise AssertionError(f"first losses differ: autoshard {our_first}, parallelize_module {their_first}")
    timings = _alternate(our_step, their_step, data, rounds)
    per_layer = tp_rewrite.collectives_by_layer(program.graph_modules[0])
    blocks = [c for layer, c in per_layer.items() if layer.rsplit(".", 1)[-1].isdigit()]
    return {"timings": timings, "collectives": blocks[0]}


def bench_tp(ranks: int = 4) -> None:
    """autoshard tp=4 vs parallelize_module with a hand-written Colwise/Rowwise plan, same model and batch."""
    cfg = TP
    with LocalRanks(ranks) as pool:
        results = pool.run(_tp_vs_torch, steps=3, rounds=5)
    ours = statistics.median(t for r in results for t in r["timings"]["autoshard"])
    theirs = statistics.median(t for r in results for t in r["timings"]["torch"])
    params = sum(p.numel() for p in TpModel(cfg["blocks"], cfg["width"], cfg["heads"]).parameters())
    per_block = ", ".join(f"{n} {k}" for k, n in sorted(results[0]["collectives"].items()))
    report(
        f"tp={ranks} step, {cfg['blocks']} blocks ({params / 1e6:.1f}M params), batch {cfg['batch']}x{cfg['seq']} "
        f"(gloo, CPU); autoshard per block: {per_block}",
        f"{ours * 1e3:.1f} ms",
        f"parallelize_module {theirs * 1e3:.1f} ms",
        ours / theirs,
        "<= 1.0",
    )


def _fsdp_tp_vs_torch(rank: int, world_size: int, steps: int, rounds: int) -> dict[str, Any]:
    """dp2 x tp2 with ZeRO-3: autoshard against torch's own 2D (Colwise/Rowwise per block, then fully_shard
    over the dp sub-mesh), the same model, batch and optimizer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg, dp, tp = TP, 2, world_size // 2
    mse = torch.nn.functional.mse_loss

    def model() -> TpModel:
        torch.manual_seed(0)
        return TpModel(cfg["blocks"], cfg["width"], cfg["heads"])

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    gen = torch.Generator().manual_seed(1)
    shape = (cfg["batch"] * dp, cfg["seq"], cfg["width"])  # the global batch: cfg["batch"] rows per dp rank
    data = [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)) for _ in range(steps)]
    program = autoshard.compile(
        model(), autoshard.Mesh(dp=dp, tp=tp), example_inputs=(data[0][0],), loss_fn=mse,
        example_target=data[0][1], optimizer=adamw, plan={"zero": 3},
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    theirs = model()
    for block in theirs.blocks:
        plan = {n: ColwiseParallel() for n in ("q", "k", "v", "fc1")} | {n: RowwiseParallel() for n in ("o", "fc2")}
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(theirs, mesh=mesh["dp"])
    their_opt = adamw(theirs.parameters())
    local = program.local_batch

    def their_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        their_opt.zero_grad()
        loss = mse(theirs(local(x)), local(y))
        loss.backward()
        their_opt.step()
        return loss

    def our_step(x: torch.Tensor, y: torch.Tensor) -> float:
        return program.step(local(x), target=local(y))

    # The same computation on both sides: equal first losses (theirs averaged over dp), else timing means nothing.
    their_first = their_step(*data[0]).detach().clone()
    dist.all_reduce(their_first)
    their_first = their_first.item() / world_size  # every tp rank holds the dp rank's loss
    our_first = our_step(*data[0])
    if abs(our_first - their_first) > 1e-5 * abs(their_first):
        raise AssertionError(f"first losses differ: autoshard {our_first}, torch 2D {their_first}")
    timings = _alternate(our_step, their_step, data, rounds)
    x, y = data[0]
    return {
        "timings": timings,
        "peak": {
            "autoshard": _peak_allocated(lambda: our_step(x, y)),
            "torch": _peak_allocated(lambda: their_step(x, y)),
        },
    }


def bench_fsdp_tp(ranks: int = 4) -> None:
    """autoshard dp2 x tp2 with ZeRO-3 vs torch's FSDP2 + DTensor TP on the same model and batch."""
    cfg = TP
    with LocalRanks(ranks) as pool:
        results = pool.run(_fsdp_tp_vs_torch, steps=3, rounds=5)
    ours, theirs = (statistics.median(t for r in results for t in r["timings"][k]) for k in ("autoshard", "torch"))
    params = sum(p.numel() for p in TpModel(cfg["blocks"], cfg["width"], cfg["heads"]).parameters())
    name = (
        f"dp2 x tp2 zero=3, {cfg['blocks']} blocks ({params / 1e6:.1f}M params), batch {2 * cfg['batch']}x{cfg['seq']}"
    )
    report(f"{name}: step time", f"{ours * 1e3:.1f} ms", f"fully_shard + parallelize_module {theirs * 1e3:.1f} ms",
           ours / theirs, "<= 1.0")  # fmt: skip
    peak_ours = max(r["peak"]["autoshard"] for r in results)
    peak_theirs = max(r["peak"]["torch"] for r in results)
    report(f"{name}: peak tensor bytes allocated in a step, per rank", f"{peak_ours / 2**20:.2f} MiB",
           f"{peak_theirs / 2**20:.2f} MiB", peak_ours / peak_theirs, "<= 1.0")  # fmt: skip


BENCHMARKS = {
    "capture": bench_capture_llama_7b,
    "dp": bench_dp_vs_ddp,
    "compiled": bench_compiled_vs_ddp,
    "zero": bench_zero_vs_torch,
    "zero-memory": bench_zero_memory_table,
    "pipeline": bench_pipeline,
    "zero-bubble": bench_zero_bubble,
    "zero-bubble-compiled": bench_zero_bubble_compiled,
    "tp": bench_tp,
    "fsdp-tp": bench_fsdp_tp,
    "recompute": lambda: bench_recompute(report),
    "checkpoint": lambda: bench_checkpoint(report),
    "experts": lambda: bench_experts(report),
    "context": lambda: bench_context(report),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    args = parser.parse_args()
    for name in args.only or list(BENCHMARKS):
        BENCHMARKS[name]()
    print("\n| benchmark | autoshard | reference | ratio | target |\n|---|---|---|---|---|")
    for name, ours, theirs, ratio, target in RESULTS:
        print(f"| {name} | {ours} | {theirs} | {ratio:.3f} | {target} |")


if __name__ == "__main__":
    main()
