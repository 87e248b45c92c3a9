"""``program.report(path)``: one self-contained HTML page about a compiled program.

Sections: the plan and why it won, with the other candidates; memory per rank as stacked bars by
category (the planner's prediction for the most loaded rank, and what each rank held in its last
step once the program has run); the pipeline schedule per rank, predicted by the cost model beside
measured over the last step; FLOPs, parameters and collectives per layer; each stage's rewritten
graph with collectives, sends and receives and ZeRO gathers highlighted. Under a process group every
rank calls it (its measurements are gathered) and rank 0 writes the file; offline, only predictions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from autoshard.inspection.explain import expert_lines, fmt_count
from autoshard.inspection.html import esc, graph_code, memory_bars, page, table, timeline
from autoshard.passes import tp_rewrite

if TYPE_CHECKING:
    from autoshard.planner.report import Candidate, PlanReport
    from autoshard.program import Program

__all__ = ["collect_measured", "render", "write_report"]


def collect_measured(program: Program) -> list[dict[str, Any]]:
    """Every rank's last-step measurements (a collective under a process group; [] offline)."""
    if program.runtime is None:
        return []
    monitor = program.monitor
    mine = {
        "rank": program.rank,
        "coords": program.mesh.coords(program.rank),
        "memory": program.last_step_memory,
        "metrics": monitor.last.to_dict() if monitor.last is not None else None,
        "timeline": monitor.timelines[-1] if monitor.timelines else [],
    }
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * program.mesh.size
    dist.all_gather_object(everyone, mine, group=program.runtime.world_group)
    return everyone


def write_report(program: Program, path: str | os.PathLike) -> Path | None:
    measured = collect_measured(program)
    if program.rank != 0:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(program, measured), encoding="utf-8")
    return out


def render(program: Program, measured: list[dict[str, Any]]) -> str:
    report = program.plan_report
    chosen = report.chosen
    name = program.compiled.captured.model_name
    sections = [
        ("Plan", _plan(program)),
        ("Candidates", _candidates(report)),
        ("Memory per rank", _memory(program, measured)),
    ]
    if program.schedule is not None:
        sections.append(("Pipeline timeline", _timelines(program, chosen, measured)))
    if any(m["metrics"] for m in measured):
        sections.append(("Throughput measured", _throughput(measured)))
    if program.plan.ep > 1:
        sections.append(("Experts", "<pre>" + esc("\n".join(expert_lines(program))) + "</pre>"))
    sections += [("Layers", _layers(program)), ("Graphs", _graphs(program))]
    return page(f"autoshard report: {name} on {program.mesh}", sections)


def _plan(program: Program) -> str:
    report, chosen = program.plan_report, program.plan_report.chosen
    sizes = ", ".join(f"{k}={v}" for k, v in report.sizes.items())
    rows = [
        ["plan", str(program.plan)],
        ["why", report.reason],
        ["hardware", report.hardware.name],
        ["global batch", sizes],
        ["predicted memory per rank", f"{chosen.memory.total / 2**30:.3f} GiB"],
        ["predicted step time", f"{chosen.step_time * 1e3:.4g} ms"],
        ["predicted TFLOP/s per device", f"{chosen.tflops_per_device:.3g}"],
        ["predicted MFU", f"{chosen.mfu:.1%}"],
        ["bottleneck", chosen.why],
        ["ranks", f"{program.mesh.size} ({program.mesh})"],
    ]
    cells = "".join(f'<tr><td class="key">{esc(k)}</td><td id="plan-{esc(k.split()[-1])}">{esc(v)}</td></tr>'
                    for k, v in rows)  # fmt: skip
    return f"<table>{cells}</table>"


def _candidates(report: PlanReport, top: int = 12) -> str:
    rows = [
        [str(c.plan), f"{c.memory.total / 2**30:.3f}", f"{c.step_time * 1e3:.4g}", f"{c.tflops_per_device:.3g}",
         f"{c.mfu:.1%}", "yes" if c.fits else "no", c.why]
        for c in report.candidates[:top]
    ]  # fmt: skip
    more = len(report.candidates) - top
    note = f'<p class="muted">{more} more candidates; {report.searched} plans costed</p>' if more > 0 else ""
    header = ["plan", "GiB/rank", "step ms", "TFLOP/s", "MFU", "fits", "why"]
    return table(header, rows, numeric={1, 2, 3, 4}, marked=0) + note


def _memory(program: Program, measured: list[dict[str, Any]]) -> str:
    chosen = program.plan_report.chosen
    predicted = [("predicted (most loaded rank)", {k: v for k, v in chosen.memory.items() if v})]
    held = [(f"rank {m['rank']} measured", {k: v for k, v in m["memory"].items() if v}) for m in measured[:64]]
    text = memory_bars(predicted + held, chosen.capacity)
    if not measured:
        text += (
            '<p class="muted">Measured bars appear once the program has run a step (report under a process group).</p>'
        )
    return text


def _timelines(program: Program, chosen: Candidate, measured: list[dict[str, Any]]) -> str:
    schedule = program.schedule
    predicted = [(f"pp rank {p}", list(lane)) for p, lane in enumerate(chosen.timeline)]
    title = "predicted by the cost model"
    if not predicted:  # the schedule's own simulation, each action the cost model's compute per action
        grid = schedule.timeline()
        slot = chosen.time.compute / max(1, max(len(r) for r in schedule.ranks))
        predicted = [(f"pp rank {p}", [(str(a), t * slot, (t + 1) * slot) for t, a in enumerate(row) if a])
                     for p, row in enumerate(grid)]  # fmt: skip
        title = "predicted (the schedule's simulation, each action the cost model's compute per action)"
    lanes: dict[int, list] = {}
    for m in measured:
        coords = m["coords"]
        if coords["dp"] == 0 and coords["tp"] == 0 and m["timeline"]:
            lanes[coords["pp"]] = m["timeline"]
    seen = [(f"pp rank {p}", lanes[p]) for p in sorted(lanes)]
    text = timeline(predicted, title) + timeline(seen, "measured, last step")
    return text + f"<details><summary>schedule table</summary><pre>{esc(schedule.table())}</pre></details>"


def _throughput(measured: list[dict[str, Any]]) -> str:
    rows = []
    for m in measured:
        x = m["metrics"]
        if x:
            ms = [f"{x[k] * 1e3:.2f}" for k in ("step_seconds", "compute_seconds", "comm_seconds", "bubble_seconds")]
            rate = [f"{x['tokens_per_second']:,.0f}", f"{x['tflops_per_rank']:.3g}", f"{x['mfu']:.2%}"]
            rows.append([m["rank"], x["step"], *ms, *rate])
    header = ["rank", "step", "step ms", "compute ms", "exposed comm ms", "bubble ms", "tokens/s", "TFLOP/s", "MFU"]
    return table(header, rows, numeric=set(range(9)))


def _layers(program: Program) -> str:
    cost, sizes = program.cost, program.plan_report.sizes
    ev = cost.evaluate(**{k: v for k, v in sizes.items() if k in cost.symbols})
    comm: dict[str, dict[str, int]] = {}
    if program.tp_report is not None:
        comm = tp_rewrite.collectives_by_layer(program.captured_graph)
    rows = []
    for lc, lv in zip(cost.layers, ev.layers):
        counts = ", ".join(f"{n} {k}" for k, n in sorted(comm.get(lc.name, {}).items()))
        rows.append([lc.name, fmt_count(int(lv.flops_fwd)), fmt_count(int(lv.flops_bwd)), fmt_count(lc.param_bytes)
                     + "B", fmt_count(int(lv.activation_bytes)) + "B", counts])  # fmt: skip
    total = f"<p>whole model: forward {fmt_count(int(ev.flops_fwd))} FLOPs, backward {fmt_count(int(ev.flops_bwd))}</p>"
    header = ["layer", "forward FLOPs", "backward FLOPs", "params", "activations", "tp collectives"]
    return total + table(header, rows, numeric={1, 2, 3, 4})


def _graphs(program: Program) -> str:
    legend = ('<p><span class="tp">collectives</span> · <span class="pp">sends and receives</span> · '
              '<span class="zero">ZeRO gathers</span></p>')  # fmt: skip
    parts = []
    if program.schedule is None:
        parts.append(("every rank runs one graph", program.captured_graph.code))
    else:
        for stage in program.compiled.stages:
            p = program.schedule.rank_of(stage.stage)
            ranks = program.mesh.groups("pp")
            count = sum(1 for group in ranks for r in group if program.mesh.coords(r)["pp"] == p)
            parts.append((f"stage {stage.stage} (pp rank {p}, {count} ranks)", stage.gm.code))
    body = "".join(f"<details{' open' if i == 0 else ''}><summary>{esc(title)}</summary>{graph_code(code)}</details>"
                   for i, (title, code) in enumerate(parts))  # fmt: skip
    return f'<div class="graph-legend">{legend}</div>{body}'
