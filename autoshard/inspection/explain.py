"""``program.explain()``: the plan and why, costs per layer, the mesh, stages, placements and the runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard.graph_ops import context as cp_ops
from autoshard.graph_ops import experts as ep_ops
from autoshard.graph_ops import tp as tp_ops
from autoshard.ir.meta import LAYER, MODEL_PREFIX, RECOMPUTE, evaluate_expr, get_expert, get_layer, get_shape
from autoshard.ir.placements import OnRank, OnStages, Shard
from autoshard.passes import tp_rewrite
from autoshard.passes.infra import all_nodes

if TYPE_CHECKING:
    from autoshard.ir.placements import ParamPlacement
    from autoshard.program import Program

__all__ = ["expert_lines", "explain", "fmt_count"]


def fmt_count(value: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return str(value)


def explain(program: Program) -> str:
    report, cost = program.plan_report, program.cost
    sizes = report.sizes
    size_str = ", ".join(f"{k}={v}" for k, v in sizes.items())
    chosen = report.chosen
    ev = cost.evaluate(**sizes)
    lines = [
        f"autoshard program for {program.compiled.captured.model_name} on {program.mesh}",
        report.assumed(),
        f"plan: {program.plan}",
        f"why:  {report.reason}",
        f"predicted per rank at the global batch ({size_str}) on {report.hardware.name}: "
        f"{chosen.memory.total / 2**30:.3f} GiB, {chosen.step_time * 1e3:.4g} ms per step, "
        f"{chosen.tflops_per_device:.3g} TFLOP/s per device, MFU {chosen.mfu:.1%}; bottleneck {chosen.why}",
        "",
        "candidates (best first):",
        report.table(),
        "",
        "the top candidates, part by part:",
        report.breakdown(),
        "",
        f"whole model: forward {cost.flops_fwd} FLOPs = {fmt_count(int(ev.flops_fwd))}, "
        f"backward {cost.flops_bwd} = {fmt_count(int(ev.flops_bwd))}",
        f"             parameters {fmt_count(cost.param_bytes)}B, "
        f"activations {cost.activation_bytes} B = {fmt_count(int(ev.activation_bytes))}B",
        "",
        f"{'layer':<28} {'forward FLOPs':<34} {'at ' + size_str:>14} {'params':>9} {'activations':>12}",
    ]
    for lc, lv in zip(cost.layers, ev.layers):
        expr = str(lc.flops_fwd)
        expr = expr if len(expr) <= 34 else expr[:31] + "..."
        lines.append(
            f"{lc.name:<28} {expr:<34} {fmt_count(int(lv.flops_fwd)):>14} "
            f"{fmt_count(lc.param_bytes) + 'B':>9} {fmt_count(int(lv.activation_bytes)) + 'B':>12}"
        )
    lines += ["", *_saved_for_backward(program)]
    if program.mesh.size <= 16:
        lines += ["", "mesh:", program.mesh.table()]
    lines += ["", *_placements(program)]
    if program.schedule is not None:
        lines += ["", *_stages(program)]
    if program.tp_report is not None:
        lines += ["", *_tensor_parallel(program)]
    if program.plan.ep > 1:
        lines += ["", *expert_lines(program)]
    if program.plan.cp > 1:
        lines += ["", *context_lines(program)]
    if program.runtime is not None:
        lines += ["", f"this rank ({program.rank}): {program.runtime.holder.describe()}"]
    lines += _torch_compile(program)
    lines += ["", "passes:"] + [f"  {line}" for line in program.analysis_log]
    return "\n".join(lines)


def _torch_compile(program: Program) -> list[str]:
    """How the rank graphs run: eagerly, or compiled (what each compiled graph communicates, the time it took)."""
    request = program.compiled.torch_compile
    if request is None:
        return []
    compiler = program.runtime.compiler if program.runtime is not None else None
    if compiler is None or not compiler.graphs:
        lines = ["", f"rank graphs: {request} (compiled on the first step)"]
    else:
        lines = ["", f"rank graphs: {request}, compiled in {compiler.seconds:.2f} s on this rank:"]
        lines += [f"  {graph}" for graph in compiler.graphs]
    optimizer = program.runtime.optimizer if program.runtime is not None else None
    if optimizer is not None and request.fuses_pointwise:
        fused = all(group.get("fused") for group in optimizer.param_groups)
        kernel = "torch's fused kernel (fused and foreach left open)" if fused else "the kernel its settings choose"
        lines.append(f"  optimizer: {type(optimizer).__name__} on {kernel}")
    return lines


def _saved_for_backward(program: Program) -> list[str]:
    """What autograd keeps per graph call, by layer and category, at the example's rows per call."""
    plan, sizes = program.plan, dict(program.plan_report.sizes)
    rows = sizes["B"] // plan.dp // plan.microbatches
    at = {**sizes, "B": rows}
    recompute = plan.recompute
    if isinstance(recompute, tuple):
        recompute = "blocks " + ", ".join(recompute)
    elif isinstance(recompute, float):
        recompute = f"budget {recompute}"
    lines = [
        f"saved for backward (passes.saved_tensors; recompute {recompute}), per graph call of B={rows} rows"
        + (f", S={at['S']}" if "S" in at else "")
        + ":"
    ]
    lines += _recompute_lines(program, at)
    for name, memory in program.cost.saved_for_backward:
        value = memory.evaluate(**at)
        lines.append(
            f"  {name}: kept {memory.kept} = {fmt_count(value['kept'])}B"
            + (f"; + {memory.transient} = {fmt_count(value['transient'])}B while a region recomputes"
               if value["transient"] else "")
        )  # fmt: skip
        for layer in memory.layers:
            parts = ", ".join(f"{category} {fmt_count(n)}B" for category, n in layer.evaluate(**at).items())
            lines.append(f"    {layer.layer:<28} {fmt_count(value[layer.layer]) + 'B':>9}  {parts}")
        if memory.unaccounted:
            lines.append(f"    not probed (their saves not counted): {', '.join(memory.unaccounted)}")
    return lines


def _recompute_lines(program: Program, at: dict[str, int]) -> list[str]:
    """What the plan's recomputation frees and repeats (passes.recompute.Deals); a choice that frees nothing
    is said to, with what to do instead."""
    choice = program.plan.recompute
    if choice == "none":
        return []
    graphs = [s.gm for s in program.compiled.stages] or [program.captured_graph]
    regions = [n.meta[RECOMPUTE] for gm in graphs for n in gm.graph.nodes if RECOMPUTE in n.meta]
    freed = sum(evaluate_expr(r.freed, at) for r in regions)
    flops = sum(evaluate_expr(r.flops, at) for r in regions)
    forward = evaluate_expr(program.cost.flops_fwd, at)
    share = f" ({100 * flops / forward:.1f}% of a forward)" if forward else ""
    remade = sum(1 for r in regions if r.remade)  # matmuls' inputs made again, not regions
    counted = f"{len(regions) - remade} regions" + (f" and {remade} matmul inputs made again" if remade else "")
    if freed > 0:
        return [f"  recompute {choice}: {counted} free {fmt_count(freed)}B a call and repeat "
                f"{fmt_count(flops)}FLOP{share} in backward"]  # fmt: skip
    why = (
        "no attention here keeps more bytes per FLOP than its block does (a fused attention kernel keeps only "
        "its inputs and a log-sum-exp), so nothing is recomputed"
        if choice == "selective" and not regions
        else f"its {len(regions)} regions keep their inputs, which is what they would have kept, and repeat "
        f"{fmt_count(flops)}FLOP{share}"
    )
    return [f"  recompute {choice} frees nothing here: {why}; use recompute='none', or 'full' to keep less"]


def _placements(program: Program) -> list[str]:
    """How many tensors (and bytes) lie which way along each mesh dimension."""
    counts: dict[str, int] = {}
    for placement in program.placements.values():
        if placement.trainable:
            kind = ", ".join(f"{dim} {p}" for dim, p in placement.by_dim().items() if _notable(p))
            counts[kind or "replicated everywhere"] = counts.get(kind or "replicated everywhere", 0) + 1
    lines = ["parameter placements (trainable tensors, per mesh dimension):"]
    lines += [f"  {n:>4} x {kind}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    tied = sorted({p.pp.ranks for p in program.placements.values() if p.tied})
    for ranks in tied:
        keys = [k for k, p in program.placements.items() if p.tied and p.pp.ranks == ranks]
        lines.append(f"  tied across pipeline ranks {list(ranks)} (gradients summed there): {', '.join(keys)}")
    return lines


def _notable(placement: ParamPlacement) -> bool:
    return isinstance(placement, (Shard, OnStages, OnRank))


def _stages(program: Program) -> list[str]:
    schedule = program.schedule
    lines = ["pipeline stages:"]
    for stage in program.compiled.stages:
        layers = [get_layer(n) for n in stage.gm.graph.nodes if n.op == "get_attr" and LAYER in n.meta]
        blocks = list(dict.fromkeys(x for x in layers if x.rsplit(".", 1)[-1].isdigit()))
        span = f"{blocks[0]} .. {blocks[-1]}" if blocks else "no blocks"
        lines.append(
            f"  stage {stage.stage} on pp rank {schedule.rank_of(stage.stage)}: {span}, "
            f"{len(stage.parameter_targets)} parameters; receives {len(stage.recv)}, sends {len(stage.send)} tensor(s)"
        )
    if schedule.microbatches * schedule.virtual_stages <= 16:
        lines += ["", schedule.table()]
    return lines


def context_lines(program: Program) -> list[str]:
    """What cp does: each rank's tokens, the attentions that see the whole sequence and what they move."""
    plan, sizes, report = program.plan, dict(program.plan_report.sizes), program.compiled.cp_report
    seq, rows = sizes.get("S", 0), sizes["B"] // plan.dp // plan.microbatches
    chunk = seq // (2 * plan.cp) if seq else 0
    ring = plan.cp_attention == "ring"
    lines = [
        f"context parallel (cp={plan.cp}, {plan.cp_attention.replace('_', '-')} attention): each rank computes "
        f"{seq // plan.cp if seq else '1/cp of the'} tokens of every sequence of {seq}, chunks i and "
        f"{2 * plan.cp - 1}-i of {2 * plan.cp} ({chunk} tokens each, balanced under a causal mask); gradients are "
        f"reduced over dp x cp "
        f"= {plan.dp * plan.cp} ranks",
        f"  {report}" if report is not None else "",
    ]
    graphs = [s.gm for s in program.compiled.stages] or [program.captured_graph]
    kinds = (cp_ops.ring_attention, cp_ops.all_to_all_attention)
    at = {**sizes, "B": rows}
    for node in (n for gm in graphs for n in gm.graph.nodes if n.target in kinds):
        q, k, v = (get_shape(a).tensor for a in node.args[1:4])
        kv = evaluate_expr(k.nbytes + v.nbytes, at)
        if ring:
            # K/V cp - 1 hops forward and cp - 2 backward (it starts on the block forward ended on), and the
            # gradients cp - 1 hops home (graph_ops/ring_attention.py)
            moved = (3 * plan.cp - 4) * kv
            what = (
                f"K/V blocks {fmt_count(int(kv))}B a hop, {plan.cp - 1} forward, {plan.cp - 2} backward, and "
                f"{plan.cp - 1} of the gradients"
            )
        else:
            moved = 2 * (2 * evaluate_expr(q.nbytes, at) + kv) * (plan.cp - 1) / plan.cp
            what = "q, k, v and the output traded for heads, forward and backward"
        lines.append(f"  {get_layer(node):<30} {node.name}: {fmt_count(int(moved))}B a rank a step ({what})")
    return [line for line in lines if line]


def expert_lines(program: Program) -> list[str]:
    """The MoE layers ep splits: experts a rank, the rows each dispatch moves, and the last step's measured load."""
    plan, sizes = program.plan, dict(program.plan_report.sizes)
    at = {**sizes, "B": sizes["B"] // plan.dp // plan.microbatches}
    lines = [
        f"expert parallel (ep={plan.ep} out of dp={plan.dp}): each group of {plan.ep} consecutive dp ranks splits "
        f"every MoE layer's experts, each expert is data parallel over the {plan.dp // plan.ep} ranks holding it; "
        f"per layer and microbatch a gather of the row counts and 2 all-to-alls forward (dispatch, combine), 2 backward"
    ]
    measured = program.metrics.expert_load if program.metrics is not None else {}
    graphs = [s.gm for s in program.compiled.stages] or [program.captured_graph]
    for node in (n for gm in graphs for n in gm.graph.nodes if n.target in (ep_ops.dispatch, ep_ops.dispatch_rows)):
        record = get_expert(node)
        if node.target is ep_ops.dispatch:
            rows = get_shape(node).tensors[0]
            moved, what = evaluate_expr(rows.nbytes, at), f"rows {rows}"
        else:  # a loop over experts: one gather of rows an expert
            gathers = [get_shape(r).tensor for r in node.args[1]]
            moved, what = sum(evaluate_expr(t.nbytes, at) for t in gathers), f"a loop: rows {gathers[0]} an expert"
        load = f", expert load max/mean {measured[record.layer]:.2f} (last step)" if record.layer in measured else ""
        lines.append(
            f"  {record.layer:<30} {record.experts} experts, {record.experts // record.ep} a rank; each dispatch "
            f"and combine moves {fmt_count(int(moved))}B a rank ({what}){load}"
        )
    return lines


def _tensor_parallel(program: Program) -> list[str]:
    report, gm = program.tp_report, program.captured_graph
    lines = [f"tensor parallel (tp={report.degree}):"]
    for target, placement in report.weights.items():
        if isinstance(placement, Shard):
            key = target.removeprefix(MODEL_PREFIX)
            shape = program.placements[key].shape if key in program.placements else "?"
            lines.append(f"  {key:<52} {str(placement):<8} full {tuple(shape)}")
    for target, why in report.replicated.items():
        lines.append(f"  {target.removeprefix(MODEL_PREFIX):<52} {'R':<8} replicated: {why}")
    lines.append("  collectives per layer:")
    for layer, counts in tp_rewrite.collectives_by_layer(gm).items():
        lines.append(f"    {layer:<30} " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    losses = [n for n in all_nodes(gm) if n.target is tp_ops.vocab_parallel_cross_entropy]
    if losses:
        lines.append(
            f"  vocab-parallel cross-entropy ({len(losses)}): per row, an all-reduce of the max logit and one of "
            f"the sum of exponentials with the target's logit; the logits stay sharded"
        )
    if report.partial_grad_params:
        lines.append(
            f"  {len(report.partial_grad_params)} replicated weights used on shards (norms, split biases): "
            f"gradients summed over tp in one all-reduce after backward"
        )
    if report.unruled:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(report.unruled.items()))
        lines.append(f"  ops without a sharding rule (inputs replicated): {ops}")
    if report.fallbacks:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(report.fallbacks.items()))
        lines.append(f"  ops whose rule found no valid placement (replicated): {ops}")
    return lines
