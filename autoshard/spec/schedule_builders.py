"""The named pipeline schedules, built as data (autoshard/spec/schedules.py) and validated there.

``gpipe``, ``one_f_one_b`` and ``interleaved_1f1b`` run one backward an action; the zero-bubble ones
split it into B and W: ``zb_h1`` in 1F1B's order, ``zb_h2`` with a longer warm-up at twice the
activations, ``zbv`` on two stages a rank placed as a V, ``dualpipev`` on the same V with its two halves'
forward and backward crossing.
``build_schedule`` makes one by name, as a plan names it.
"""

from __future__ import annotations

from autoshard.spec.schedules import SEVERAL_STAGES, V_SCHEDULES, Action, Schedule, ScheduleError

__all__ = ["build_schedule", "dualpipev", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb_h1", "zb_h2", "zbv"]


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (backwards in reverse microbatch order)."""
    ranks = tuple(
        tuple(Action(r, "F", m) for m in range(microbatches))
        + tuple(Action(r, "B", m) for m in reversed(range(microbatches)))
        for r in range(pp)
    )
    return Schedule("gpipe", pp, microbatches, 1, ranks)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """Warm up with pp-1-rank forwards, then alternate one forward and one backward, then cool down."""
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, microbatches)
        actions = [Action(r, "F", m) for m in range(warmup)]
        f, b = warmup, 0
        while f < microbatches:
            actions += [Action(r, "F", f), Action(r, "B", b)]
            f, b = f + 1, b + 1
        actions += [Action(r, "B", m) for m in range(b, microbatches)]
        ranks.append(tuple(actions))
    return Schedule("1f1b", pp, microbatches, 1, tuple(ranks))


def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: each rank holds v stages (r, r+pp, ...) and cycles through them
    in groups of pp microbatches, which shrinks the bubble by a factor v."""
    if virtual_stages < 1:
        raise ScheduleError(f"virtual_stages={virtual_stages} must be at least 1")
    if microbatches % pp:
        raise ScheduleError(
            f"interleaved 1F1B needs microbatches divisible by pp: {microbatches} microbatches, pp={pp}; "
            f"use a multiple of {pp}"
        )
    v = virtual_stages
    total = microbatches * v

    def forward(rank: int, k: int) -> Action:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        return Action(chunk * pp + rank, "F", group * pp + within % pp)

    def backward(rank: int, k: int) -> Action:
        group, within = divmod(k, pp * v)
        chunk = v - 1 - within // pp
        return Action(chunk * pp + rank, "B", group * pp + within % pp)

    ranks = []
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        actions = [forward(r, k) for k in range(warmup)]
        f, b = warmup, 0
        while f < total:
            actions += [forward(r, f), backward(r, b)]
            f, b = f + 1, b + 1
        actions += [backward(r, k) for k in range(b, total)]
        ranks.append(tuple(actions))
    return Schedule("interleaved_1f1b", pp, microbatches, v, tuple(ranks))


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B's forwards and input-gradient backwards (B) in 1F1B's order, with the
    weight-gradient steps (W) held back. Rank r keeps up to r W's pending and runs one after each B beyond
    that, the rest at its end: the later ranks pass gradients back without their W's in the way, which
    shortens the cool-down every earlier rank waits through, and fill their own tail with them. Every
    rank then holds at most pp microbatches (forward run, W not yet): 1F1B's first rank's count.
    With F, B and W of one time unit each, pp=4 and 8 microbatches idle 11% of the step against 1F1B's 27%."""
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, microbatches)
        actions = [Action(r, "F", m) for m in range(warmup)]
        pending: list[int] = []  # microbatches whose B ran and W has not
        # 1F1B's order of forwards and backwards: warm-up forwards, then one forward and one backward, then
        # the remaining backwards (None: no forward in that slot).
        steady = [(f, f - warmup) for f in range(warmup, microbatches)]
        cooldown = [(None, b) for b in range(microbatches - warmup, microbatches)]
        for forward, backward in steady + cooldown:
            if forward is not None:
                actions.append(Action(r, "F", forward))
            actions.append(Action(r, "B", backward))
            pending.append(backward)
            if len(pending) > r:  # rank r keeps up to r W's back
                actions.append(Action(r, "W", pending.pop(0)))
        actions += [Action(r, "W", m) for m in pending]
        ranks.append(tuple(actions))
    return Schedule("zb_h1", pp, microbatches, 1, tuple(ranks))


def zb_h2(pp: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): one stage a rank, backward split into B and W, with more forwards in the
    warm-up than 1F1B's (rank r runs up to 2(pp-r)-1 before its first B: the start of the bubble fills)
    and the W's that nothing waits for moved to the tail, where 1F1B's cool-down idles. Rank r holds up to
    2pp-1 microbatches (forward run, W not yet): about twice 1F1B's first rank. Built by list scheduling
    (``_list_scheduled``), one stage a rank."""
    return _list_scheduled("zb_h2", pp, microbatches, [(r,) for r in range(pp)], 2 * pp - 1)


def zbv(pp: int, microbatches: int) -> Schedule:
    """ZBV (Qi et al. 2024, as torch.distributed.pipelining's ScheduleZBVZeroBubble orders it): two stages a
    rank placed as a V (rank r holds stages r and 2pp-1-r, so the first and the last stage share rank 0 and
    the turn at rank pp-1 is a hand-over inside one rank), backward split into B and W. Rank r warms up with
    2(pp-r)-1 forwards down the V, then r forwards alternating up and down, then pp-r of (F, B, W) on its
    stage up; in the steady state each stage runs F, B and W of one microbatch in turn; the cool-down runs
    the B's and leaves the W's last. Every rank holds at most 2pp stage-microbatches, 1F1B's first rank's
    activations (each stage is half of 1F1B's). Each B has a W's slack before the other rank needs its
    gradient, so a hand-over's latency is absorbed instead of idling the pipeline: with sends of a tenth of
    a stage's forward, pp=4 and 8 microbatches idle 0.34x of 1F1B's, against 0.54x for a schedule
    list-built for zero latency. With microbatches <= pp that order idles more than the list-built one
    (0.47x of 1F1B's at pp=4, m=4, against 0.26x), which is then used: it holds 2pp at most too."""
    if microbatches <= pp:  # too few for the steady state: list-built, as zb_h2
        return _list_scheduled("zbv", pp, microbatches, [(2 * pp - 1 - r, r) for r in range(pp)], 2 * pp)
    n_micro = max(2 * pp - 1, microbatches)  # the steady state's shape; microbatches past the last are dropped
    ranks = []
    for r in range(pp):
        ops = _zbv_rank(r, 2 * pp - 1 - r, pp - r, n_micro)
        ranks.append(tuple(Action(stage, kind, mb) for stage, kind, mb in ops if mb < microbatches))
    return Schedule("zbv", pp, microbatches, 2, tuple(ranks), placement="v")


def _zbv_rank(down: int, up: int, later: int, n_micro: int) -> list[tuple[int, str, int]]:
    """One rank's ZBV actions as (stage, kind, microbatch): ``down`` and ``up`` its stages, ``later`` the
    ranks from it to the V's turn (pp - r)."""
    ops: list[tuple[int, str, int]] = []
    f = {down: 0, up: 0}
    b = {down: 0, up: 0}

    def run(stage: int, kind: str) -> None:
        counter = f if kind == "F" else b
        ops.append((stage, kind, counter[stage]))
        counter[stage] += 1

    def backward_and_w(stage: int) -> None:
        ops.extend([(stage, "B", b[stage]), (stage, "W", b[stage])])
        b[stage] += 1

    for _ in range(2 * later - 1):
        run(down, "F")
    for _ in range(down):  # rank r: r forwards up, each with one more down
        run(up, "F")
        run(down, "F")
    for _ in range(later):
        run(up, "F")
        backward_and_w(up)
    while f[up] < f[down] or f[down] < n_micro:
        if f[down] < n_micro:
            run(down, "F")
        backward_and_w(down)
        run(up, "F")
        backward_and_w(up)
    w = dict(b)  # the W's still to run start where the B's stand now
    for _ in range(down):
        run(down, "B")
        run(up, "B")
    for _ in range(later):
        run(down, "B")
        ops.append((down, "W", w[down]))
        w[down] += 1
    ops += [(up, "W", i) for i in range(w[up], b[up])]
    ops += [(down, "W", i) for i in range(w[down], b[down])]
    return ops


def dualpipev(pp: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half, as torch.distributed.pipelining's ScheduleDualPipeV orders it):
    two stages a rank placed as a V, as zbv. Rank r warms up with 2(pp-1-r) forwards down the V and r+1 pairs
    down and up, then pp-1-r of (B, W, F) on its stage up; its steady state runs a forward of one stage with a
    whole backward (B then W) of the other, the two halves of the V crossing; the cool-down runs whole backwards,
    then, from the middle of the last ones, B's with their W's left to the end (zero bubble). Needs at least as
    many microbatches as stages (2pp)."""
    if microbatches < 2 * pp:
        raise ScheduleError(
            f"dualpipev needs at least as many microbatches as stages (2 x pp = {2 * pp}), got {microbatches}"
        )
    return Schedule("dualpipev", pp, microbatches, 2, tuple(_dualpipev_rank(r, pp, microbatches) for r in range(pp)),
                    placement="v")  # fmt: skip


def _dualpipev_rank(r: int, pp: int, microbatches: int) -> tuple[Action, ...]:
    """Rank r's DualPipeV actions: its stages ``down`` (r) and ``up`` (2pp-1-r)."""
    down, up = r, 2 * pp - 1 - r
    actions: list[Action] = []
    f = {down: 0, up: 0}
    b = {down: 0, up: 0}
    waiting: list[Action] = []  # the W's of B's run alone, oldest first

    def forward(stage: int) -> None:
        actions.append(Action(stage, "F", f[stage]))
        f[stage] += 1

    def backward(stage: int, whole: bool) -> None:  # whole: its W at once
        actions.append(Action(stage, "B", b[stage]))
        (actions if whole else waiting).append(Action(stage, "W", b[stage]))
        b[stage] += 1

    def a_waiting_w() -> None:
        if waiting:
            actions.append(waiting.pop(0))

    for _ in range(2 * (pp - 1 - r)):
        forward(down)
    for _ in range(r + 1):
        forward(down)
        forward(up)
    for _ in range(pp - 1 - r):
        backward(up, whole=False)
        a_waiting_w()
        forward(up)
    for _ in range(microbatches - 2 * pp + r + 1):  # the crossing: F of one stage with B, W of the other
        forward(down)
        backward(up, whole=True)
        forward(up)
        backward(down, whole=True)
    for _ in range(pp - 1 - r):
        backward(up, whole=True)
        forward(up)
        backward(down, whole=True)
    zero_bubble = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        backward(up, whole=not zero_bubble)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        backward(down, whole=not zero_bubble)
    for _ in range(pp - 1 - r):
        a_waiting_w()
        backward(down, whole=not zero_bubble)
    for _ in range(r + 1):
        a_waiting_w()
    return tuple(actions)


def _list_scheduled(name: str, pp: int, microbatches: int, stages_of: list[tuple[int, ...]], limit: int) -> Schedule:
    """List scheduling in time units where F, B and W take one each: a free rank runs the B whose gradient
    has arrived (the critical path), else the forward furthest along that has its input, if the rank holds
    fewer than ``limit`` stage-microbatches (forward run, W not yet), else its oldest pending W.
    ``stages_of[r]``: rank r's stages, in the order it prefers them."""
    virtual = len(stages_of[0])
    n = pp * virtual
    schedule_ranks: list[list[Action]] = [[] for _ in range(pp)]
    # Per stage and microbatch, the time unit its F and its B ran in (never: past every t). Kept as numbers, not
    # looked up by Action: a planner's search builds these for every pipeline depth and microbatch count.
    never = 3 * n * microbatches + 1
    ran = {"F": [[never] * microbatches for _ in range(n)], "B": [[never] * microbatches for _ in range(n)]}
    next_f, next_b = [0] * n, [0] * n  # per stage, the next microbatch to run F and B of
    pending_w: list[list[Action]] = [[] for _ in range(pp)]
    held = [0] * pp  # stage-microbatches whose forward ran and W has not
    left, t = 3 * n * microbatches, 0

    def ready(stage: int, kind: str, microbatch: int) -> bool:
        """What the action needs (Action.needs) ran before t: the previous stage's F, the next stage's B, or
        the last stage's own F."""
        if kind == "F":
            return stage == 0 or ran["F"][stage - 1][microbatch] < t
        return (ran["F"][stage] if stage == n - 1 else ran["B"][stage + 1])[microbatch] < t

    while left:
        progressed = False
        for r in range(pp):
            choice = None
            for stage in stages_of[r]:  # the B nearer the loss first: it unblocks the most
                if next_b[stage] < microbatches and ready(stage, "B", next_b[stage]):
                    choice = Action(stage, "B", next_b[stage])
                    break
            if choice is None and held[r] < limit:
                for stage in stages_of[r]:  # finishing a microbatch before taking on another
                    if next_f[stage] < microbatches and ready(stage, "F", next_f[stage]):
                        choice = Action(stage, "F", next_f[stage])
                        break
            if choice is None and pending_w[r]:
                choice = pending_w[r].pop(0)
            if choice is None:
                continue
            schedule_ranks[r].append(choice)
            left -= 1
            progressed = True
            if choice.kind == "F":
                ran["F"][choice.stage][choice.microbatch] = t
                next_f[choice.stage] += 1
                held[r] += 1
            elif choice.kind == "B":
                ran["B"][choice.stage][choice.microbatch] = t
                next_b[choice.stage] += 1
                pending_w[r].append(Action(choice.stage, "W", choice.microbatch))
            else:
                held[r] -= 1
        if not progressed:  # what finished before t is visible at t: nothing will change
            raise ScheduleError(f"{name} cannot be built for pp={pp}, microbatches={microbatches}")
        t += 1
    placement = "v" if virtual == 2 else "loop"
    return Schedule(name, pp, microbatches, virtual, tuple(tuple(row) for row in schedule_ranks), placement=placement)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1, validate: bool = True) -> Schedule:
    """Build and validate a named schedule; errors come before any rank sends. ``validate=False``: the
    planner's simulations, of schedules right by construction (compile validates the chosen one)."""
    if microbatches < 1:
        raise ScheduleError(f"microbatches={microbatches} must be at least 1")
    if name == "gpipe":
        schedule = gpipe(pp, microbatches)
    elif name == "1f1b":
        schedule = one_f_one_b(pp, microbatches)
    elif name == "interleaved_1f1b":
        schedule = interleaved_1f1b(pp, microbatches, virtual_stages)
    elif name == "zb_h1":
        schedule = zb_h1(pp, microbatches)
    elif name == "zb_h2":
        schedule = zb_h2(pp, microbatches)
    elif name in V_SCHEDULES:
        if virtual_stages != 2:
            raise ScheduleError(f"{name} runs two stages on each rank; virtual_stages={virtual_stages} must be 2")
        schedule = zbv(pp, microbatches) if name == "zbv" else dualpipev(pp, microbatches)
    else:
        raise ScheduleError(
            f"unknown schedule {name!r}; choose gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, zbv or dualpipev"
        )
    if name not in SEVERAL_STAGES and virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per rank; virtual_stages={virtual_stages} needs interleaved_1f1b")
    if validate:
        schedule.validate()
    return schedule
