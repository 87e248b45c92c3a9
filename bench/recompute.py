"""Activation recomputation measured: kept bytes and step time per recompute choice, against the accounting.

A GPT-2-style model (eager attention, dropout 0.1, S = 512) runs its compiled graph forward and
backward on this machine. Kept bytes are measured at the allocator (the profiler's memory events):
what a forward leaves allocated beyond its outputs. passes.saved_tensors predicts the same with CPU
kernels. The same model with fused attention (sdpa, no dropout): selective recomputation against none.
The published per-layer formulas (Korthikanti et al. 2022) are compared with the accounting
of a GPT block in bf16 with CUDA kernels (one-byte dropout masks), compiled offline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from allocations import allocation_trace, caching_allocator, malloc_net

import autoshard
from autoshard.launch import LocalRanks
from autoshard.planner.hardware import Hardware

CHOICES: tuple[Any, ...] = ("none", "selective", "full")


def _gpt(
    layers: int,
    width: int,
    heads: int,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.1,
    attention: str = "eager",
) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=1024, n_positions=1024, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout, activation_function="gelu_pytorch_tanh", attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def _build(
    choice: Any,
    batch: int,
    seq: int,
    layers: int,
    width: int,
    heads: int,
    dropout: float = 0.1,
    attention: str = "eager",
) -> dict[str, Any]:
    """The compiled graph of one recompute choice, its input, and its accounting at this batch."""
    model = _gpt(layers, width, heads, dropout=dropout, attention=attention)
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids, "use_cache": False}
    program = autoshard.compile(
        model, 1, example_inputs=(ids,), example_kwargs=kwargs, plan={"recompute": choice},
        hardware=Hardware.preset("cpu"),
    )  # fmt: skip
    gm = program.for_rank(0).graph_modules[0]
    return {"gm": gm, "ids": ids, "predicted": program.cost.saved_for_backward[0][1].evaluate(B=batch, S=seq)}


def _kept(run: dict[str, Any]) -> int:
    """Bytes one forward leaves allocated beyond its outputs (then its backward runs, freeing them)."""
    gm, ids = run["gm"], run["ids"]
    outputs, net, _ = allocation_trace(lambda: gm(ids, ids))
    kept = net - sum(o.untyped_storage().nbytes() for o in outputs if isinstance(o, torch.Tensor))
    outputs[0].backward()
    return kept


def _step_seconds(run: dict[str, Any]) -> float:
    gm, ids = run["gm"], run["ids"]
    for p in gm.parameters():
        p.grad = None
    start = time.perf_counter()
    gm(ids, ids)[0].backward()
    return time.perf_counter() - start


def _korthikanti(report: Callable[..., None]) -> None:
    """The accounting of one GPT block (the middle one) in bf16 on CUDA kernels vs the published formulas."""
    b, s, h, a, t = 4, 512, 1024, 16, 2
    model = _gpt(3, h, a, torch.bfloat16)
    ids = torch.randint(0, 1024, (b, s), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids, "use_cache": False}
    cases = {
        "no parallelism, no recompute": ({}, {}, s * b * h * (34 + 5 * a * s / h)),
        f"tp={t}": ({"tp": t}, {}, s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
        f"tp={t}, sequence parallel": ({"tp": t}, {"sequence_parallel": True}, s * b * h / t * (34 + 5 * a * s / h)),
        "full recomputation": ({}, {"recompute": "full"}, 2 * s * b * h),
    }
    for name, (mesh, plan, published) in cases.items():
        program = autoshard.compile(
            model, autoshard.Mesh(**mesh) if mesh else 1, example_inputs=(ids,), example_kwargs=kwargs, plan=plan,
            hardware=Hardware.preset("a100-80gb"),
        )  # fmt: skip
        ours = program.cost.saved_for_backward[0][1].evaluate(B=b, S=s)["transformer.h.1"]
        report(
            f"bytes kept by one GPT block in bf16 (s={s}, b={b}, h={h}, a={a}), {name}",
            f"{ours / 2**20:.2f} MiB (passes.saved_tensors)", f"{published / 2**20:.2f} MiB (Korthikanti et al.)",
            ours / published, "0.90 .. 1.10",
        )  # fmt: skip


def _step_times(runs: dict[str, dict[str, Any]], rounds: int = 8) -> dict[str, float]:
    """The fastest of ``rounds`` warm steps per choice, the choices in turn (so they share whatever else the
    machine does), with freed memory reused as a GPU's caching allocator reuses it. The fastest, not the
    median: on this shared 2-core machine other work only ever adds to a step (one choice's steps here
    ranged from 2.8 to 4.2 s within a run), so the minimum is the estimate of the step's own cost."""
    times: dict[str, list[float]] = {choice: [] for choice in runs}
    with caching_allocator():
        for run in runs.values():
            _step_seconds(run)  # warm: the first step allocates what later ones reuse
        for _ in range(rounds):
            for choice, run in runs.items():
                times[choice].append(_step_seconds(run))
    return {choice: min(t) for choice, t in times.items()}


def bench_recompute(report: Callable[..., None], batch: int = 4, seq: int = 512) -> None:
    layers, width, heads = 2, 1024, 16
    runs = {choice: _build(choice, batch, seq, layers, width, heads) for choice in CHOICES}
    results = {choice: {"kept": _kept(run), "predicted": run["predicted"]} for choice, run in runs.items()}
    seconds = _step_times(runs)
    # Without dropout as well: a CPU draws masks slowly (a serial generator; about 40% of this forward at
    # dropout 0.1), and a replayed forward draws them again (on a GPU one parallel kernel draws a mask).
    plain = _step_times({choice: _build(choice, batch, seq, layers, width, heads, dropout=0.0) for choice in CHOICES})
    described = f"GPT-2-style, {layers} blocks, width {width}, {heads} heads, eager attention, {batch}x{seq}"
    name = f"{described}, dropout 0.1"
    for choice, r in results.items():
        report(
            f"{name}, recompute {choice}: activation bytes kept by forward, measured vs accounted",
            f"{r['kept'] / 2**20:.1f} MiB measured", f"{r['predicted']['kept'] / 2**20:.1f} MiB accounted",
            r["kept"] / r["predicted"]["kept"], "0.85 .. 1.15",
        )  # fmt: skip
    none = results["none"]
    for choice, floor, ceiling in (("full", 4.0, 1.40), ("selective", 1.5, 1.15)):
        r = results[choice]
        report(f"{name}: kept bytes, recompute none / {choice}", f"{none['kept'] / 2**20:.1f} MiB",
               f"{r['kept'] / 2**20:.1f} MiB", none["kept"] / r["kept"], f">= {floor}")  # fmt: skip
        for label, times in (("dropout 0.1", seconds), ("dropout 0", plain)):
            report(f"{described}, {label}: step time, recompute {choice} / none", f"{times[choice] * 1e3:.0f} ms",
                   f"{times['none'] * 1e3:.0f} ms", times[choice] / times["none"], f"<= {ceiling}")  # fmt: skip
    # Fused attention (scaled_dot_product_attention without dropout keeps q, k, v, its output and a log-sum-exp):
    # selective recomputation weighs what the kernel keeps and keeps it, so it costs what no recomputation does.
    fused = {c: _build(c, batch, seq, layers, width, heads, 0.0, "sdpa") for c in ("none", "selective")}
    fused_kept = {c: _kept(run) for c, run in fused.items()}
    fused_times = _step_times(fused)
    fused_name = f"GPT-2-style, {layers} blocks, width {width}, {heads} heads, fused attention (sdpa), {batch}x{seq}"
    selective, none_ms = fused_times["selective"], fused_times["none"]
    report(f"{fused_name}, dropout 0: step time, recompute selective / none", f"{selective * 1e3:.0f} ms",
           f"{none_ms * 1e3:.0f} ms", selective / none_ms, "<= 1.05")  # fmt: skip
    report(f"{fused_name}, dropout 0: kept bytes, recompute selective / none",
           f"{fused_kept['selective'] / 2**20:.1f} MiB", f"{fused_kept['none'] / 2**20:.1f} MiB",
           fused_kept["selective"] / fused_kept["none"], "reported")  # fmt: skip
    # Gradient accumulation: a step of k microbatches keeps one microbatch's activations at a time.
    for k in (2, 4):
        r = {"kept": _kept(_build("none", batch // k, seq, layers, width, heads))}
        report(f"{name}: kept bytes per forward, microbatches={k} / 1", f"{r['kept'] / 2**20:.1f} MiB",
               f"{none['kept'] / 2**20:.1f} MiB", r["kept"] / none["kept"], f"~ 1/{k}")  # fmt: skip
    for attention, dropout in (("eager", 0.1), ("sdpa", 0.0)):
        _budgets(report, attention, dropout, batch, seq)
    _korthikanti(report)
    _sequence_parallel(report)


def _sp_rank_kept(rank: int, world: int, layers: int, batch: int, seq: int, width: int) -> dict[str, Any]:
    """What one forward of a tp rank (sequence parallel, every block recomputed) leaves allocated for backward,
    and what the compiler's accounting says it keeps, in all and per block."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024, max_position_embeddings=seq, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
    program = autoshard.compile(
        transformers.LlamaForCausalLM(config), autoshard.Mesh(tp=world), (ids,), {"labels": ids, "use_cache": False},
        plan={"sequence_parallel": True, "recompute": "full"}, hardware=Hardware.preset("cpu"),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
    )  # fmt: skip
    program.step(ids, labels=ids, use_cache=False)  # warm: what the first step makes once is not a forward's
    gm = program.runtime.graphs[0]

    held = {t.untyped_storage()._cdata for t in [*gm.parameters(), *gm.buffers(), ids]}
    saved: dict[int, int] = {}  # what autograd keeps: the distinct storages of the saved tensors

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in held:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs, net = malloc_net(lambda: gm(ids, ids))
    kept = net - sum(o.untyped_storage().nbytes() for o in outputs if isinstance(o, torch.Tensor))
    outputs[0].backward()
    accounted = program.compiled.cost.saved_for_backward[0][1].evaluate(B=batch, S=seq)
    block = accounted[f"model.layers.{layers - 1}"]
    return {"allocator": kept, "saved": sum(saved.values()), "accounting": accounted["kept"], "block": block}


def _sequence_parallel(report: Callable[..., None], ranks: int = 4, batch: int = 2, seq: int = 2048) -> None:
    """A Llama block under tp with sequence parallelism and full recomputation keeps its input as this rank's
    sequence shard, 2sbh/t in bf16 (4sbh/t in fp32, as here), the region gathering it again in backward."""
    layers, width = 2, 1024
    with LocalRanks(ranks) as pool:
        results = pool.run(_sp_rank_kept, layers, batch, seq, width)
    shard = 4 * seq * batch * width / ranks
    name = f"Llama, {layers} blocks, width {width}, {batch}x{seq}, tp={ranks} sequence parallel, full recomputation"
    report(f"{name}: a block's kept bytes (accounting; the first block also keeps what the blocks share, the mask "
           f"and rotary tables, once) vs its input's sequence shard, 2sbh/t in bf16 (fp32 here)",
           f"{results[0]['block'] / 2**20:.2f} MiB", f"{shard / 2**20:.2f} MiB", results[0]["block"] / shard,
           "0.9 .. 1.1")  # fmt: skip
    worst = max(results, key=lambda r: abs(r["saved"] / r["accounting"] - 1))
    report(f"{name}: bytes a rank's forward keeps, what autograd saves (distinct storages) vs the accounting, the "
           f"rank furthest off", f"{worst['saved'] / 2**20:.2f} MiB", f"{worst['accounting'] / 2**20:.2f} MiB",
           worst["saved"] / worst["accounting"], "0.9 .. 1.1")  # fmt: skip
    off = max(results, key=lambda r: abs(r["allocator"] / r["accounting"] - 1))
    spread = ", ".join(f"{r['allocator'] / 2**20:.2f}" for r in results)
    report(f"{name}: the same at the allocator, the rank furthest off (all ranks {spread} MiB)",
           f"{off['allocator'] / 2**20:.2f} MiB", f"{off['accounting'] / 2**20:.2f} MiB",
           off["allocator"] / off["accounting"], "0.9 .. 1.1")  # fmt: skip


def _budgets(
    report: Callable[..., None], attention: str, dropout: float, batch: int, seq: int, layers: int = 8
) -> None:
    """Budgets on a deeper, narrower GPT (a budget is met to within one block's cheapest span; with 8 blocks
    that is under a tenth of the total): the bytes the allocator sees a forward keep against the budget's
    share of what no recomputation keeps, and the step against recomputing whole blocks (the first k, as
    Megatron's recompute_num_layers does) that keep as many bytes, the budget set to their share."""
    width, heads = 512, 8
    build = lambda choice: _build(choice, batch, seq, layers, width, heads, dropout, attention)  # noqa: E731
    none = _kept(build("none"))
    name = f"GPT-2-style, {layers} blocks, width {width}, {heads} heads, {attention} attention, dropout {dropout}"
    for budget in (0.75, 0.5, 0.25):
        kept = _kept(build(budget))
        report(f"{name}, {batch}x{seq}, recompute budget {budget}: activation bytes kept (allocator) / (budget x "
               f"none's)", f"{kept / 2**20:.1f} MiB", f"{budget * none / 2**20:.1f} MiB", kept / (budget * none),
               "0.9 .. 1.0")  # fmt: skip
    runs, shares = {}, {}
    for k in (layers // 4, layers // 2, 3 * layers // 4):
        runs[f"full {k}"] = build(tuple(f"transformer.h.{i}" for i in range(k)))
        shares[k] = _kept(runs[f"full {k}"]) / none
        runs[f"budget {k}"] = build(shares[k])
    times = _step_times(runs)
    for k, share in shares.items():
        ours, whole = times[f"budget {k}"], times[f"full {k}"]
        label = f"{name}: step time, recompute budget {share:.3f} / {k} of {layers} blocks recomputed whole"
        report(
            f"{label} (the same kept bytes)", f"{ours * 1e3:.0f} ms", f"{whole * 1e3:.0f} ms", ours / whole, "<= 0.9"
        )
