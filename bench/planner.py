"""The planner against reality: predicted and measured step time and peak memory of 4 gloo ranks, after
``Hardware.measure()`` calibrated those ranks; and the planning time of Llama-2-70B for 1024 ranks and of a
Llama-3-405B-shaped model for 16,384.

    python bench/planner.py              # measured vs predicted tables (GPT, MoE), then the planning times
    python bench/planner.py --only plan_405b
    python bench/planner.py --only measured
    python bench/planner.py --only experts   # the same for a Mixtral-shaped MoE under expert parallelism
    python bench/planner.py --only own_cores # the GPT's pipelines on 2 ranks with a core each

Every plan trains the same GPT (autoshard.demo.TinyGPT) on the same global batch (``--only experts``: a
Hugging Face Mixtral of 8 experts, top-2, under dp=4 with its experts split ep=1, 2 or 4); each is compiled with
the measured Hardware, so ``program.plan_report.chosen`` is the cost model's prediction for exactly that
plan. Measured: the fastest of warm steps (all ranks in step, the plans in turn); peak memory: the tensors the
rank holds before a step (parameters, gradients, optimizer state, masters) plus the profiler's allocation peak
during one step (the CPU analog of ``torch.cuda.max_memory_allocated``), on the most loaded rank.
A pipeline's bubble: its ranks' span in the step (from the barrier before it, on the machine's one clock)
less the busiest rank's seconds in its actions, against the planner's bubble and sends' share, which it
counts the same way (the makespan less the busiest rank's work).
The ranks calibrate again amid the rounds (this machine's speed drifts by tens of percent over minutes);
the table's predictions are the calibration's that saw the machine fastest, chosen by its predictions
alone, and every calibration's errors are printed (``PLANNER_RUN_JSON=path`` also saves them with the
measured steps, to replay the predictions offline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from experts import mixtral
from run import _peak_allocated  # the CPU analog of torch.cuda.max_memory_allocated, as the ZeRO benchmarks use

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import LocalRanks

CFG = {"vocab": 2048, "dim": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16}
PLANS: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    ("dp4", {"dp": 4}, {}),
    ("dp4 zero1", {"dp": 4}, {"zero": 1}),
    ("dp4 zero3", {"dp": 4}, {"zero": 3}),
    ("dp4 full recompute", {"dp": 4}, {"recompute": "full"}),
    ("tp4", {"tp": 4}, {}),
    ("dp2 x tp2", {"dp": 2, "tp": 2}, {}),
    ("pp4 gpipe", {"pp": 4}, {"schedule": "gpipe", "microbatches": 4}),
    ("pp4 1f1b", {"pp": 4}, {"schedule": "1f1b", "microbatches": 8}),
    ("dp2 x pp2", {"dp": 2, "pp": 2}, {"microbatches": 4}),
    ("pp4 zb_h1", {"pp": 4}, {"schedule": "zb_h1", "microbatches": 8}),
    ("pp4 zb_h2", {"pp": 4}, {"schedule": "zb_h2", "microbatches": 8}),
    ("dp2 x pp2 zbv", {"dp": 2, "pp": 2}, {"schedule": "zbv", "virtual_stages": 2, "microbatches": 4}),
]
# A Mixtral-shaped mixture of experts (Hugging Face's MixtralForCausalLM), its experts split over ep of the
# 4 dp ranks.
MOE = {
    "hidden": 256, "intermediate": 512, "experts": 8, "top_k": 2, "layers": 2, "heads": 4, "kv_heads": 2,
    "vocab": 2048, "seq": 128, "batch": 16,
}  # fmt: skip
EP_PLANS: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    ("dp4 ep1", {"dp": 4}, {"ep": 1}),  # ep fixed: left free, the search would pick ep=4 for this MoE
    ("dp4 ep2", {"dp": 4}, {"ep": 2}),
    ("dp4 ep4", {"dp": 4}, {"ep": 4}),
    ("dp4 ep2 zero1", {"dp": 4}, {"ep": 2, "zero": 1}),
]


# Rounds before which the ranks calibrate again (compile used the first calibration, made before them).
CALIBRATE_BEFORE = (5, 10, 15)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch every plan trains on (and the planner predicts for): input ids and targets."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab"], (CFG["batch"], CFG["seq"]), generator=gen)
    return ids, torch.randint(0, CFG["vocab"], (CFG["batch"], CFG["seq"]), generator=gen)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CFG["vocab"], CFG["dim"], CFG["heads"], CFG["layers"], CFG["seq"])


def _gpt_batch() -> tuple[tuple[torch.Tensor, ...], dict[str, Any], Any]:
    ids, target = _batch()
    return (ids,), {}, target


def _moe_model() -> torch.nn.Module:
    return mixtral(MOE)


def _moe_batch() -> tuple[tuple[torch.Tensor, ...], dict[str, Any], Any]:
    """Token ids, the model's own loss on them (``labels``, shifted inside), no target."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, MOE["vocab"], (MOE["batch"], MOE["seq"]), generator=gen)
    return (ids,), {"labels": ids, "use_cache": False}, None


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model the plans train: its factory, the global batch (inputs, kwargs, target: every plan trains on it
    and the planner predicts for it), the loss (None: the model's own output), and the plans."""

    model: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple[tuple[torch.Tensor, ...], dict[str, Any], Any]]
    loss_fn: Callable[..., torch.Tensor] | None
    plans: list[tuple[str, dict[str, int], dict[str, Any]]]
    ranks: int = 4


# The same GPT on 2 ranks, a core each (autoshard.launch pins them): no rank shares a processor, as none shares
# a GPU, so the pipelines' bubbles are the schedules' and the runtime's, not the scheduler's slices (4 ranks on
# this machine's 2 cores share them; their bubbles are measured above).
OWN_CORE_PLANS: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    ("dp2", {"dp": 2}, {}),
    ("tp2", {"tp": 2}, {}),
    ("pp2 1f1b", {"pp": 2}, {"schedule": "1f1b", "microbatches": 8}),
    ("pp2 zb_h1", {"pp": 2}, {"schedule": "zb_h1", "microbatches": 8}),
    ("pp2 zbv", {"pp": 2}, {"schedule": "zbv", "virtual_stages": 2, "microbatches": 8}),
]

WORKLOADS = {
    "gpt": Workload(_model, _gpt_batch, next_token_loss, PLANS),
    "experts": Workload(_moe_model, _moe_batch, None, EP_PLANS),
    "own_cores": Workload(_model, _gpt_batch, next_token_loss, OWN_CORE_PLANS, ranks=2),
}


def _held(program: Any) -> int:
    """Bytes the program holds between steps (parameters, gradients, optimizer state and masters)."""
    return sum(program.last_step_memory.values())


def _local(program: Any, batch: tuple[tuple[torch.Tensor, ...], dict[str, Any], Any]) -> dict[str, Any]:
    """This rank's share of the global batch, as ``program.step``'s arguments (tensors only)."""
    inputs, kwargs, target = batch
    return {
        "inputs": tuple(program.local_batch(x) for x in inputs),
        "kwargs": {k: program.local_batch(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)},
        "target": None if target is None else program.local_batch(target),
    }


def _step(program: Any, local: dict[str, Any]) -> float:
    return program.step(*local["inputs"], target=local["target"], **local["kwargs"])


def _measure_rank(rank: int, world: int, steps: int, workload: str = "gpt") -> list[dict[str, Any]]:
    torch.manual_seed(0)
    work = WORKLOADS[workload]
    hardware = autoshard.Hardware.measure()
    batch = work.batch()
    runs = []
    for name, mesh, plan in work.plans:
        model = work.model()
        program = autoshard.compile(
            model, autoshard.Mesh(**mesh), batch[0], batch[1], loss_fn=work.loss_fn, example_target=batch[2],
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), plan=plan, hardware=hardware,
        )  # fmt: skip
        local = _local(program, batch)
        for _ in range(2):
            _step(program, local)
        runs.append((name, program, local))
    # One step of each plan in turn, ``steps`` rounds, and the fastest of each plan's: whatever else the
    # machine does only ever adds to a step (Hardware.measure() times the same way), and its drift over the
    # minutes this takes falls on every plan alike instead of on the plans measured at that moment.
    times: list[list[float]] = [[] for _ in runs]
    # pipelines, each round: this rank's (start, end, seconds in its actions), on the machine's monotonic clock
    spans: list[list[tuple[float, float, float]]] = [[] for _ in runs]
    calibrations = [hardware]
    for round_ in range(steps):
        if round_ in CALIBRATE_BEFORE:  # calibrated again amid the rounds: the machine as they saw it
            calibrations.append(autoshard.Hardware.measure())
        for k in range(len(runs)):  # each round starts at another plan: none is always first after a calibration
            i = (round_ + k) % len(runs)
            _, program, local = runs[i]
            torch.distributed.barrier()
            start = time.perf_counter()
            _step(program, local)
            times[i].append(time.perf_counter() - start)
            stats = program.pipeline_stats
            spans[i].append((0.0, 0.0, 0.0) if stats is None else
                            (stats.started_at, stats.started_at + stats.step_seconds, stats.busy_seconds))  # fmt: skip
    rows = []
    for (name, program, local), seconds, waited, (_, mesh, _) in zip(runs, times, spans, work.plans):
        held = _held(program)
        peak = held + _peak_allocated(lambda p=program, local=local: _step(p, local))
        chosen = program.plan_report.chosen
        rows.append({
            "name": name, "plan": str(program.plan), "predicted": chosen.step_time,
            "measured": min(seconds), "rounds": seconds, "spans": waited, "predicted_bytes": chosen.memory.total,
            "peak_bytes": peak, "why": chosen.why, "time": str(chosen.time),
            "bubble": chosen.time.bubble + chosen.time.pp_comm, "hardware": hardware.to_json(),
            "fixed": program.plan, "mesh": mesh, "calibrations": [h.to_json() for h in calibrations],
        })  # fmt: skip
    return rows


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0.0] * len(xs)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def _predictions(rows: list[dict[str, Any]], hardware: autoshard.Hardware, workload: str = "gpt") -> list[Any]:
    """Each row's plan as the planner predicts it with ``hardware`` (offline: the same model and batch)."""
    work = WORKLOADS[workload]
    inputs, kwargs, target = work.batch()
    out = []
    for row in rows:
        model = work.model()
        fixed = autoshard.plan(model, autoshard.Mesh(**row["mesh"]), inputs, kwargs, loss_fn=work.loss_fn,
                               example_target=target, hardware=hardware, plan=row["fixed"])  # fmt: skip
        out.append(fixed.chosen)
    return out


def _compare(workload: str, steps: int) -> dict[str, Any]:
    """Measure ``workload``'s plans on its gloo ranks, predict them with each calibration, print the tables."""
    with LocalRanks(WORKLOADS[workload].ranks) as pool:
        per_rank = pool.run(_measure_rank, steps, workload)
    rows = []
    for i, row in enumerate(per_rank[0]):
        row = dict(row)
        row["measured"] = max(r[i]["measured"] for r in per_rank)
        row["peak_bytes"] = max(r[i]["peak_bytes"] for r in per_rank)
        row["rounds"] = [max(each) for each in zip(*(r[i]["rounds"] for r in per_rank))]  # the slowest rank's
        # The bubble as the planner counts it: the pipelines' span (every rank's from the barrier before the
        # step, one clock for the machine's ranks) less the busiest rank's seconds in its actions, in
        # the round where the step was fastest.
        fastest_round = min(range(len(row["rounds"])), key=row["rounds"].__getitem__)
        spans = [r[i]["spans"][fastest_round] for r in per_rank]
        span = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
        row["measured_bubble"] = span - max(busy for *_, busy in spans)
        rows.append(row)
    # The machine's speed drifts by tens of percent over minutes, and each calibration sees it at one moment,
    # while the measured steps are the fastest of rounds spread over the run. So the ranks calibrate
    # several times amid the rounds, and the predictions are those of the calibration that saw the machine
    # fastest (the smallest predicted total: chosen without looking at the measured steps).
    calibrations = [autoshard.Hardware.from_json(text) for text in rows[0]["calibrations"]]
    predicted = [_predictions(rows, hardware, workload) for hardware in calibrations]
    for row, again in zip(rows, predicted[0]):  # offline, the first calibration predicts what compile did
        assert abs(again.step_time / row["predicted"] - 1) < 1e-9, (row["name"], again.step_time, row["predicted"])
    fastest = min(range(len(calibrations)), key=lambda i: sum(c.step_time for c in predicted[i]))
    if os.environ.get("PLANNER_RUN_JSON"):  # every calibration and measurement, to replay the predictions offline
        keep = [{**r, "fixed": str(r["fixed"])} for r in rows]
        path = Path(os.environ["PLANNER_RUN_JSON"])
        if workload != "gpt":  # each workload its own file: run.json, run.experts.json
            path = path.with_name(f"{path.stem}.{workload}{path.suffix}")
        path.write_text(json.dumps(keep, indent=1))
    measured = [r["measured"] for r in rows]
    print(f"\n{len(calibrations)} calibrations (before the rounds, and before rounds {CALIBRATE_BEFORE}):")
    for i, again in enumerate(predicted):
        times = [c.step_time for c in again]
        errors = " ".join(f"{p / m - 1:+.0%}" for p, m in zip(times, measured))
        print(f"  {'*' if i == fastest else ' '} {i}: predicted total {sum(times) * 1e3:.0f} ms, Spearman "
              f"{_spearman(times, measured):.3f}, errors {errors}")  # fmt: skip
    for row, chosen in zip(rows, predicted[fastest]):
        row.update(predicted=chosen.step_time, predicted_bytes=chosen.memory.total, time=str(chosen.time))
        row["bubble"] = chosen.time.bubble + chosen.time.pp_comm  # the sends' share of the idle time too
        row["hardware"] = rows[0]["calibrations"][fastest]
    print(f"\n| plan | predicted ms | measured ms | error | predicted MiB | peak MiB | error |\n|{'---|' * 7}")
    for r in rows:
        t_err = r["predicted"] / r["measured"] - 1
        m_err = r["predicted_bytes"] / r["peak_bytes"] - 1
        print(
            f"| {r['name']} | {r['predicted'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} | {t_err:+.0%} | "
            f"{r['predicted_bytes'] / 2**20:.1f} | {r['peak_bytes'] / 2**20:.1f} | {m_err:+.0%} |"
        )
    pipelines = [r for r in rows if "pp" in r["mesh"]]
    if pipelines:
        print(
            f"\n| pipeline | predicted bubble + sends ms | measured span less the busiest rank's busy ms | error |"
            f"\n|{'---|' * 4}"
        )
    for r in pipelines:
        print(f"| {r['name']} | {r['bubble'] * 1e3:.1f} | {r['measured_bubble'] * 1e3:.1f} | "
              f"{r['bubble'] / max(r['measured_bubble'], 1e-9) - 1:+.0%} |")  # fmt: skip
    for r in rows:
        print(f"  {r['name']}: predicted {r['time']}")
    print(f"  hardware (calibration {fastest}): {rows[0]['hardware']}")
    rho = _spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    worst_time = max(abs(r["predicted"] / r["measured"] - 1) for r in rows)
    worst_bytes = max(abs(r["predicted_bytes"] / r["peak_bytes"] - 1) for r in rows)
    print(f"\nSpearman {rho:.3f}; worst step-time error {worst_time:.0%}; worst peak-memory error {worst_bytes:.0%}")
    return {"rows": rows, "spearman": rho, "worst_time": worst_time, "worst_bytes": worst_bytes}


def bench_measured(report: Any = None, steps: int = 20) -> dict[str, Any]:
    """The GPT's plans (dp, ZeRO, recomputation, tp, pipelines) predicted against measured."""
    result = _compare("gpt", steps)
    rows, rho, worst_time, worst_bytes = (result[k] for k in ("rows", "spearman", "worst_time", "worst_bytes"))
    if report is not None:
        report(f"planner: predicted vs measured step time, {len(rows)} plans on 4 gloo ranks (Spearman)",
               f"{rho:.3f}", "1.0 (same order)", rho, ">= 0.8")  # fmt: skip
        report("planner: worst step-time error", f"{worst_time:.0%}", "measured", worst_time, "<= 0.25")
        report("planner: worst peak-memory error", f"{worst_bytes:.0%}", "profiler peak", worst_bytes, "<= 0.15")
    return result


def bench_experts(report: Any = None, steps: int = 20) -> dict[str, Any]:
    """The Mixtral-shaped MoE's plans (dp, expert parallelism ep=2 and 4, with ZeRO-1) predicted against measured."""
    result = _compare("experts", steps)
    if report is not None:
        worst = result["worst_time"]
        report(f"planner: worst step-time error of the ep plans, {len(result['rows'])} plans of a Mixtral-shaped "
               f"MoE on 4 gloo ranks", f"{worst:.0%}", "measured", worst, "<= 0.25")  # fmt: skip
    return result


def bench_own_cores(report: Any = None, steps: int = 20) -> dict[str, Any]:
    """The GPT's plans on 2 ranks with a core each (dp, tp, 1F1B, ZB-H1, ZBV) predicted against measured: the
    zero-bubble schedules' bubbles where no rank waits on the scheduler for a processor."""
    result = _compare("own_cores", steps)
    if report is not None:
        rows, worst = result["rows"], result["worst_time"]
        report(f"planner: worst step-time error, {len(rows)} plans on 2 gloo ranks with a core each", f"{worst:.0%}",
               "measured", worst, "<= 0.25")  # fmt: skip
        for r in rows:
            if "zb" in r["name"]:
                error = r["bubble"] / max(r["measured_bubble"], 1e-9) - 1
                report(f"planner: {r['name']} bubble (the busiest rank's idle time in the step), 2 ranks with a "
                       f"core each", f"{r['bubble'] * 1e3:.1f} ms predicted", f"{r['measured_bubble'] * 1e3:.1f} ms "
                       f"measured (step {r['measured'] * 1e3:.0f} ms)", error, "-0.2 .. 0.2")  # fmt: skip
    return result


def bench_plan_70b(report: Any = None) -> float:
    """Capture, analysis and the full search for Llama-2-70B on 1024 ranks of H100 (meta device)."""
    config = {
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
    }  # fmt: skip
    return _plan_llama("Llama-2-70B", config, 1024, (1024, 4096), {"param_dtype": torch.bfloat16}, 60, report)


def bench_plan_405b(report: Any = None) -> float:
    """The same for a Llama-3-405B-shaped model on 16,384 ranks of H100, 2048 sequences of 8192 tokens, nothing
    fixed: the whole space (about 52,000 plans, most of them over 80 GiB)."""
    config = {
        "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    }  # fmt: skip
    return _plan_llama("Llama-3-405B", config, 16384, (2048, 8192), {}, 30, report)


def _plan_llama(
    name: str, config: dict[str, int], world: int, batch: tuple[int, int], fixed: dict[str, Any], budget: float,
    report: Any,
) -> float:  # fmt: skip
    """Seconds of ``autoshard.plan`` (capture, analysis, search) for a Llama of ``config`` on the meta device,
    ``batch`` (rows, tokens) on ``world`` H100s, reported against ``budget`` seconds."""
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    ids = torch.zeros(*batch, dtype=torch.long, device="meta")
    start = time.perf_counter()
    plans = autoshard.plan(
        model, world, (ids,), {"labels": ids, "use_cache": False},
        hardware=autoshard.Hardware.preset("h100-80gb"), plan=fixed,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(plans.table(5, 0))
    print(f"{name}, {world} x H100: {plans.searched} plans costed, capture + analysis + plan {seconds:.1f} s")
    if report is not None:
        report(f"plan {name} for {world} ranks ({plans.searched} plans)", f"{seconds:.1f} s", f"{budget:g} s budget",
               seconds / budget, "< 1.0")  # fmt: skip
    return seconds


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (SC'21, arXiv:2104.04473), Table 1: GPT models (vocabulary 51,200, sequence 2,048) on DGX A100 80GB
# nodes (8 GPUs, NVLink; 8 x 200 Gb/s InfiniBand HDR per node), mixed precision, activation
# recomputation; throughput per GPU including the recomputed forward.
# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU)
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
]


def bench_published(report: Any = None) -> list[dict[str, Any]]:
    """Predicted TFLOP/s per GPU of each published configuration against the published figure, and the
    planner's own choice for the same GPUs and batch."""
    import transformers

    transformers.logging.set_verbosity_error()
    a100 = autoshard.Hardware.preset("a100-80gb")
    # Megatron-LM as it ran then (DDP_impl "local"): train_step runs every microbatch's forward and backward,
    # then model.allreduce_gradients(), so no part of the data-parallel reduction overlaps backward (overlap
    # came to Megatron-core later, --overlap-grad-reduce). The published plans are costed on that runtime: its
    # reduction issued as if synchronous. The planner's own choice runs on autoshard's, which overlaps.
    megatron_runtime = a100.with_(blocking=(*a100.blocking, "all_reduce", "reduce_scatter"))
    rows = []
    print("\n| model | published plan | published TFLOP/s | predicted | error | planner's choice | predicted |")
    print(f"|{'---|' * 7}")
    for billions, heads, hidden, layers, tp, pp, gpus, batch, published in MEGATRON:
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=51200,
                                         n_positions=2048)  # fmt: skip
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
        kwargs = {"labels": ids, "use_cache": False}
        mesh = autoshard.Mesh(dp=gpus // (tp * pp), tp=tp, pp=pp)
        # 16-bit weights as Megatron trains them; their fp32 masters live in ZeRO-1 shards here (the same
        # traffic as an all-reduce: a reduce-scatter and an all-gather)
        fixed = {"recompute": "full", "param_dtype": torch.bfloat16, "zero": 1}
        theirs = autoshard.plan(model, mesh, (ids,), kwargs, hardware=megatron_runtime, global_batch_size=batch,
                                plan=fixed)  # fmt: skip
        ours = autoshard.plan(model, gpus, (ids,), kwargs, hardware=a100, global_batch_size=batch,
                              plan={"param_dtype": torch.bfloat16})  # fmt: skip
        # Nor did it shard the optimizer (the distributed optimizer came to Megatron-LM in 2022): every data-parallel
        # rank stepped all of its weights, where ZeRO-1 here (for the fp32 masters) steps 1/dp of them.
        replicated = theirs.chosen.time.optimizer * (mesh.dp - 1)
        predicted = theirs.chosen.tflops_per_device * theirs.chosen.step_time / (theirs.chosen.step_time + replicated)
        error = predicted / published - 1
        rows.append({"model": f"{billions}B", "published": published, "predicted": predicted, "error": error,
                     "theirs": theirs.chosen, "ours": ours.chosen})  # fmt: skip
        print(f"| GPT {billions}B | {theirs.winner} | {published} | {predicted:.0f} | {error:+.0%} | {ours.winner} | "
              f"{ours.chosen.tflops_per_device:.0f} TFLOP/s, {ours.chosen.step_time / theirs.chosen.step_time:.2f}x "
              f"the published plan's step |")  # fmt: skip
    worst = max(abs(r["error"]) for r in rows)
    mean = sum(r["error"] for r in rows) / len(rows)
    slower = max(r["ours"].step_time / r["theirs"].step_time for r in rows)
    print(f"\nworst TFLOP/s error {worst:.0%}, mean signed {mean:+.1%}; the planner's choice at most {slower:.2f}x "
          f"the published plan's step")  # fmt: skip
    if report is not None:
        report("planner: Megatron-LM's published A100 runs, worst TFLOP/s/GPU error", f"{worst:.0%}",
               "published (Narayanan et al. 2021, Table 1)", worst, "<= 0.10")  # fmt: skip
        report("planner: the same, mean signed error", f"{mean:+.1%}", "published", mean, "-0.05 .. 0.05")
        report("planner: its choice's predicted step vs the published plan's", f"{slower:.2f}x", "published plan",
               slower, "<= 1.0")  # fmt: skip
    return rows


BENCHMARKS = {
    "measured": bench_measured, "experts": bench_experts, "own_cores": bench_own_cores, "published": bench_published,
    "plan_70b": bench_plan_70b, "plan_405b": bench_plan_405b,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    args = parser.parse_args()
    for name in args.only or list(BENCHMARKS):
        BENCHMARKS[name]()


if __name__ == "__main__":
    main()
