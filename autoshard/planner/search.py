"""The search: every plan the constraints allow, costed, ranked; the winner and why.

Constraints: dp x tp x pp = the world size; tp divides the attention heads; pp (times the virtual stages)
at most the repeated blocks, and interleaving divides them; microbatches divide each dp rank's rows
(interleaving: a multiple of pp); ZeRO only where dp > 1, offload and lower-precision parameters only
with ZeRO; sequence parallelism only with tp > 1. The candidates returned are the best plan of each mesh
shape and ZeRO stage, best first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from autoshard.errors import PlanError
from autoshard.planner.costing import Costing, Unfit
from autoshard.planner.degrees import default_microbatches, divisors, factorizations, geometric
from autoshard.planner.report import Candidate, PlanReport, fmt_bytes
from autoshard.spec.mesh import Mesh
from autoshard.spec.plan import Plan, is_mixed_precision
from autoshard.spec.schedules import SEVERAL_STAGES, V_SCHEDULES

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

__all__ = ["choose_plan", "default_microbatches", "factorizations"]

SIMPLER_WITHIN = 0.03  # prefer the simpler of two plans predicted this close (the model is not finer)
BUDGETS = (0.75, 0.5, 0.25)  # recomputation budgets tried (the share of the activation bytes kept)


# A cp rank keeps at least this many tokens of each sequence: below, the ring's sends outweigh what splitting
# the sequence saves, and the search does not try it (a user may still fix cp).
CP_MIN_TOKENS = 1024


def context_degrees(world: int, seq: int | None, heads: int) -> list[int]:
    """The cp degrees the search tries: 1, and for a model with attention each divisor of the world that splits
    the sequence into 2 x cp chunks of at least CP_MIN_TOKENS / 2 tokens."""
    if not seq or not heads:
        return [1]
    return [1] + [c for c in range(2, world + 1) if world % c == 0 and seq % (2 * c) == 0 and seq // c >= CP_MIN_TOKENS]


def _shapes(world_or_mesh: int | Mesh, overrides: dict[str, Any], cps: list[int]) -> list[tuple[int, int, int, int]]:
    """(dp, tp, pp, cp) shapes: the mesh's, or every factorization of the world that the fixed fields allow
    (cp > 1 without tp, as the runtime composes it)."""
    if isinstance(world_or_mesh, Mesh):
        mesh = world_or_mesh
        for dim in ("dp", "tp", "pp", "cp"):
            if dim in overrides and overrides[dim] != mesh.degree(dim):
                raise PlanError(
                    f"plan asks for {dim}={overrides[dim]} but the mesh has {dim}={mesh.degree(dim)}; "
                    f"drop {dim} from the plan or change the mesh"
                )
        return [(mesh.dp, mesh.tp, mesh.pp, mesh.cp)]
    if "cp" in overrides:
        cps = [overrides["cp"]]
        if world_or_mesh % cps[0]:
            raise PlanError(f"cp={cps[0]} does not divide the world size {world_or_mesh}; choose a cp that divides it")
    shapes = [
        (*s, cp)
        for cp in cps
        for s in factorizations(world_or_mesh // cp)
        if all(overrides.get(d, v) == v for d, v in zip(("dp", "tp", "pp"), s)) and (cp == 1 or s[1] == 1)
    ]
    if not shapes:
        raise PlanError(
            f"no dp x tp x pp factorization of world size {world_or_mesh} matches the plan's fixed degrees "
            f"{ {k: overrides[k] for k in ('dp', 'tp', 'pp', 'cp') if k in overrides} }"
        )
    return shapes


def _options(name: str, overrides: dict[str, Any], default: Iterable[Any]) -> list[Any]:
    return [overrides[name]] if name in overrides else list(default)


def _simplicity(plan: Plan) -> tuple:
    """Fewer parallel dimensions, then lower ZeRO stage, no offload, no recomputation, 1F1B: simpler."""
    dims = (plan.tp > 1) + (plan.pp > 1) + (plan.cp > 1)
    interleaved = plan.virtual_stages > 1
    return (dims, plan.zero, plan.offload, plan.recompute != "none", plan.schedule != "1f1b", interleaved,
            plan.microbatches, plan.sequence_parallel)  # fmt: skip


def enumerate_plans(
    shapes: list[tuple[int, int, int, int]],
    overrides: dict[str, Any],
    costing: Costing,
    rows: int,
    fixed_mesh: bool,
    refused: dict[str, None] | None = None,
) -> Iterable[Plan]:
    """Every plan the constraints allow (a fixed mesh or fixed fields are taken as given: compile checks them).
    ``refused``: collects, in words, each constraint that ruled plans out (the error when none is left)."""
    refused = {} if refused is None else refused
    mixed = is_mixed_precision(overrides.get("param_dtype"))
    needs_zero = overrides.get("offload") or mixed
    for dp, tp, pp, cp in shapes:
        if not fixed_mesh and not costing.allows(tp=tp, pp=pp):
            refused[costing.refusal(tp=tp, pp=pp) or ""] = None
            continue
        local = rows // dp if rows % dp == 0 else 0
        if not local and not fixed_mesh:
            refused[f"dp={dp} does not divide the global batch of {rows}"] = None
            continue
        if dp % overrides.get("ep", 1):
            refused[f"ep={overrides['ep']} does not divide dp={dp} (ep groups are carved out of dp)"] = None
            continue
        experts = costing.profile.experts if tp == cp == 1 else 0  # ep splits the experts of a model without tp
        eps = _options("ep", overrides, [e for e in divisors(dp) if experts and experts % e == 0] or [1])
        zeros = _options("zero", overrides, [1, 2, 3] if needs_zero else [0, 1, 2, 3])
        for zero, ep in ((z, e) for z in zeros for e in eps):
            for offload in _options("offload", overrides, [False, True] if zero else [False]):
                if zero > 0 and dp * cp == 1 and not offload and "zero" not in overrides:
                    continue  # one rank: ZeRO shards nothing, but ZeRO-Offload still moves the optimizer out
                for sp in _options("sequence_parallel", overrides, [False, True] if tp > 1 else [False]):
                    if sp and tp == 1:
                        continue
                    recomputes = _options("recompute", overrides, ["none", "selective", "full"])
                    for recompute, cp_attention in itertools.product(
                        recomputes, _cp_attention_options(cp, overrides, costing)
                    ):
                        options = _pipeline_options(pp, local, overrides, costing, fixed_mesh, refused)
                        for fields in options:
                            base = {
                                **overrides,
                                "dp": dp,
                                "tp": tp,
                                "pp": pp,
                                "cp": cp,
                                "cp_attention": cp_attention,
                                "ep": ep,
                                "zero": zero,
                                "offload": offload,
                            }
                            yield Plan(**{**base, "sequence_parallel": sp, "recompute": recompute, **fields})


def _cp_attention_options(cp: int, overrides: dict[str, Any], costing: Costing) -> list[str]:
    """Ring attention, unless the attention drops probabilities (which the ring does not draw); all-to-all where
    it can split the heads and the key/value heads over cp."""
    heads, kv_heads = costing.profile.heads, costing.profile.kv_heads or costing.profile.heads
    splits = cp > 1 and heads and heads % cp == 0 and kv_heads % cp == 0
    options = ["all_to_all"] if splits else []
    if not (options and costing.profile.attention_dropout):
        options.insert(0, "ring")  # (with dropout and no all-to-all, compile says why)
    return _options("cp_attention", overrides, options)


def _pipeline_options(
    pp: int,
    local: int,
    overrides: dict[str, Any],
    costing: Costing,
    fixed_mesh: bool,
    refused: dict[str, None],
) -> Iterable[dict[str, Any]]:
    fixed_m = overrides.get("microbatches")
    if pp == 1:
        if not fixed_mesh and {"schedule", "virtual_stages"} & set(overrides):
            refused["a pipeline schedule or virtual stages were asked for, which pp=1 does not run"] = None
            return
        for m in [fixed_m] if fixed_m else [d for d in divisors(local) if d <= 64] or [1]:
            yield {"microbatches": m}
        return
    schedules = _options("schedule", overrides, ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv"])
    for schedule in schedules:
        if not isinstance(schedule, str):
            yield {"schedule": schedule}
            continue
        if "pp_cuts" in overrides and overrides["pp_cuts"] is not None:  # the cuts fix the stage count
            stages = len(overrides["pp_cuts"]) + 1
            vs = [stages // pp] if stages % pp == 0 else [1]
            v_shaped = schedule in V_SCHEDULES
            if (schedule in SEVERAL_STAGES) != (vs[0] > 1) or (v_shaped and vs[0] != 2):
                continue
        elif schedule == "interleaved_1f1b":
            vs = _options("virtual_stages", overrides, [v for v in (2, 3, 4, 6, 8) if costing.allows(pp=pp * v)])
            if not vs:
                refused[f"interleaved_1f1b at pp={pp} needs {2 * pp} or more blocks; there are {costing.blocks}"] = None
        elif schedule in V_SCHEDULES:  # dualpipev: only where asked for (it is not among the defaults)
            vs = [2] if costing.allows(pp=2 * pp) else []
            if not vs:
                refused[
                    f"{schedule} at pp={pp} needs {2 * pp} blocks (two stages a rank); there are {costing.blocks}"
                ] = None
        else:
            if overrides.get("virtual_stages", 1) != 1:
                refused[f"virtual_stages={overrides['virtual_stages']} needs interleaved_1f1b (or zbv: 2)"] = None
                continue
            vs = [1]
        # Unequal stages (the ends lighter) where pp x v does not divide the blocks: asked for, or a fixed mesh.
        asked = fixed_mesh or "virtual_stages" in overrides or overrides.get("schedule") in SEVERAL_STAGES
        for v in vs:
            if v > 1 and not asked and costing.blocks % (pp * v):
                refused[
                    f"{schedule}: the {costing.blocks} blocks do not divide into pp x virtual_stages = {pp * v} "
                    "stages (ask for the schedule to plan uneven stages)"
                ] = None
                continue
            step = pp if schedule == "interleaved_1f1b" else 1
            if fixed_m:
                ms = [fixed_m]
            else:
                ms = sorted(
                    {m for m in geometric(local) if m % step == 0} | {default_microbatches(local, pp, schedule)}
                )
                ms = [m for m in ms if local % m == 0 and m >= step] or [step]
            if schedule == "dualpipev":  # at least as many microbatches as stages
                if max(ms) < 2 * pp:
                    refused[f"dualpipev at pp={pp} needs {2 * pp} microbatches or more; the batch gives {max(ms)}"] = (
                        None
                    )
                ms = [m for m in ms if m >= 2 * pp]
            for m in ms:
                yield {"schedule": schedule, "virtual_stages": v, "microbatches": m}


def choose_plan(
    world_or_mesh: int | Mesh,
    overrides: dict[str, Any],
    costing: Costing,
    sizes: dict[str, int],
    hardware: Hardware,
) -> PlanReport:
    """Cost every plan; return the best of each mesh shape and ZeRO stage, best first, and why the winner won."""
    Plan.check_overrides(overrides)
    fixed_mesh = isinstance(world_or_mesh, Mesh)
    world = world_or_mesh.size if fixed_mesh else world_or_mesh
    shapes = _shapes(world_or_mesh, overrides, context_degrees(world, sizes.get("S"), costing.heads))
    rows = sizes.get("B", 1)
    if fixed_mesh:
        _validate(world_or_mesh, overrides, rows)
    best: dict[tuple[int, ...], Candidate | Unfit] = {}  # (plans that do not fit: their memory alone)
    everything: list[Candidate | Unfit] = []
    searched = 0
    refused: dict[str, None] = {}
    kept_all: dict[str, bool] = {}  # a plan without recomputation -> whether it fits
    plans = enumerate_plans(shapes, overrides, costing, rows, fixed_mesh, refused)
    for plan in _in_search_order(plans, fixed_mesh, rows):
        if plan is None:  # a fixed mesh: a level of changes from the defaults had a plan that fits
            if any(c.fits for c in everything):
                break
            continue
        searched += 1
        candidate = costing.candidate(plan, with_timeline=False, unfit_memory_only=True)
        everything += [candidate] if fixed_mesh else []
        if plan.recompute == "none":
            kept_all[repr(plan)] = candidate.fits
        key = (plan.dp, plan.tp, plan.pp, plan.cp, plan.zero)
        if key not in best or _rank(candidate) < _rank(best[key]):
            best[key] = candidate
    # A shape's best, fully recomputed as nothing else fits: a budget may fit and repeat less (that plan alone).
    for key, chosen in list(best.items()):
        unfit = kept_all.get(repr(replace(chosen.plan, recompute="none"))) is False
        for budget in BUDGETS if chosen.plan.recompute == "full" and unfit else ():
            searched += 1
            candidate = costing.candidate(replace(chosen.plan, recompute=budget), False, unfit_memory_only=True)
            everything += [candidate] if fixed_mesh else []
            best[key] = min(best[key], candidate, key=_rank)
    if not best:
        fixed = {k: v for k, v in overrides.items() if k in ("tp", "pp", "dp", "schedule", "virtual_stages")}
        where = f"on {world_or_mesh}" if fixed_mesh else f"of world size {world_or_mesh}"
        broken = "; ".join(r for r in list(refused)[:4] if r) or (
            f"tp dividing the {costing.heads} heads, pp at most the {costing.blocks} blocks, dp dividing the "
            f"batch of {rows}"
        )
        raise PlanError(
            f"no plan {where} meets the constraints: {broken}; use another world size"
            + (f", or other values for the fixed {fixed}" if fixed else "")
        )
    ranked = sorted(best.values(), key=_rank)
    if fixed_mesh:  # the mesh is the user's: change the fewest defaults that make it fit, then the fastest
        fitting = sorted((c for c in everything if c.fits), key=lambda c: (_changes(c.plan, rows), c.step_time))
        if fitting:
            ranked = [fitting[0], *(c for c in ranked if c is not fitting[0])]
    else:
        ranked = _prefer_simpler(ranked)
    ranked = [costing.candidate(c.plan) for c in ranked]  # the ones kept, now with their pipeline timelines
    winner = ranked[0]
    if not winner.fits and not fixed_mesh:
        raise PlanError(_no_fit_message(world_or_mesh, winner, hardware))
    fitting = [c for c in ranked if c.fits]
    if not winner.fits:  # the mesh was given: plan it anyway (it may be for inspection), and say so
        reason = (
            f"the mesh is fixed and no plan of it fits {fmt_bytes(hardware.memory_bytes)} per rank: "
            + _no_fit_message(world_or_mesh, winner, hardware)
        )
        return PlanReport(tuple(ranked), reason, dict(sizes), hardware, searched)
    runner_up = fitting[1] if len(fitting) > 1 else None
    plain = winner.plan.tp == winner.plan.pp == 1 and winner.plan.zero == 0
    reason = (
        f"the model fits {fmt_bytes(hardware.memory_bytes)} per rank with plain data parallelism, which is "
        if plain
        else f"{winner.plan} fits {fmt_bytes(hardware.memory_bytes)} per rank and is "
    )
    of = f"of {len(fitting)} fitting candidate(s) ({searched} plans costed)"
    if runner_up is not None and runner_up.step_time < winner.step_time:  # kept for being simpler
        reason += (
            f"the simplest predicted within {SIMPLER_WITHIN:.0%} of the fastest {of}; {runner_up.plan} is predicted "
            f"{1 - runner_up.step_time / winner.step_time:.1%} faster, within what the cost model resolves, and "
            "is not as simple"
        )
    else:
        reason += f"the fastest predicted {of}"
        if runner_up is not None:
            slower = runner_up.step_time / winner.step_time
            reason += f"; the next best, {runner_up.plan}, is predicted {slower:.2f}x slower"
    return PlanReport(tuple(ranked), reason, dict(sizes), hardware, searched)


def _in_search_order(plans: Iterable[Plan], fixed_mesh: bool, rows: int) -> Iterable[Plan | None]:
    """Every plan; on a fixed mesh by how many defaults each changes, a None after each level (the search
    stops at the first level where something fits: a fixed mesh keeps the defaults that fit)."""
    if not fixed_mesh:
        yield from plans
        return
    levels: dict[int, list[Plan]] = {}
    for plan in plans:
        levels.setdefault(_changes(plan, rows), []).append(plan)
    for level in sorted(levels):
        yield from levels[level]
        yield None


def _validate(mesh: Mesh, overrides: dict[str, Any], rows: int) -> None:
    """The fixed fields on this mesh, the rest at their defaults, make a valid plan (else Plan says why)."""
    fields = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp, **overrides}
    if mesh.pp > 1 and "microbatches" not in fields:
        fields["microbatches"] = default_microbatches(rows // mesh.dp, mesh.pp, fields.get("schedule", "1f1b"))
    Plan(**fields)


def _rank(c: Candidate | Unfit) -> tuple:
    return (not c.fits, c.step_time if c.fits else c.memory.total)


def _changes(plan: Plan, rows: int) -> int:
    """How many fields a plan sets away from their defaults (a fixed mesh keeps the defaults that fit)."""
    default_m = default_microbatches(rows // plan.dp, plan.pp, plan.schedule) if plan.pp > 1 else 1
    return sum((
        plan.zero > 0, plan.offload, plan.sequence_parallel, plan.recompute != "none", plan.schedule != "1f1b",
        plan.virtual_stages != 1, plan.microbatches != default_m,
    ))  # fmt: skip


def _prefer_simpler(ranked: list[Candidate | Unfit]) -> list[Candidate | Unfit]:
    """Among the fitting plans predicted within SIMPLER_WITHIN of the fastest, the simplest goes first."""
    if not ranked or not ranked[0].fits:
        return ranked
    close = [c for c in ranked if c.fits and c.step_time <= ranked[0].step_time * (1 + SIMPLER_WITHIN)]
    first = min(close, key=lambda c: (_simplicity(c.plan), c.step_time))
    return [first, *(c for c in ranked if c is not first)]


def _no_fit_message(world_or_mesh: int | Mesh, least: Candidate, hardware: Hardware) -> str:
    parts = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in least.memory.items() if n)
    over = least.memory.total / hardware.memory_bytes
    fixes = []
    if least.plan.recompute != "full":
        fixes.append('recomputation (plan={"recompute": "full"})')
    if not least.plan.offload and least.plan.dp > 1:
        fixes.append('offload (plan={"zero": 3, "offload": True})')
    fixes += [f"about {over:.1f}x the ranks", "a smaller batch (example_inputs or global_batch_size)"]
    return (
        f"no plan for {world_or_mesh} fits {fmt_bytes(hardware.memory_bytes)} per rank on {hardware.name}: the "
        f"smallest found, {least.plan}, needs {fmt_bytes(least.memory.total)} per rank ({parts}); to make it fit "
        f"use " + ", or ".join(fixes)
    )
