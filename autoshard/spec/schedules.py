"""Pipeline schedules as plain data: per rank an ordered list of actions, printable and validated.

An action is ``{stage}{F|B|W}{microbatch}`` (``1F0``: stage 1, forward, microbatch 0). With ``v``
virtual stages per rank there are ``pp * v`` stages and stage ``s`` runs on rank ``s % pp``
(interleaved 1F1B's looping placement), or with the V placement of ZBV (two stages a rank) stage
``s < pp`` on rank ``s`` and the others back up, stage ``s`` on rank ``2 * pp - 1 - s``. A schedule
is valid when, under the rules below, every rank can run its list in order without waiting forever;
``validate`` checks this for all ranks before anything runs and names the rule a bad schedule breaks:

1. every stage runs one forward and one backward of every microbatch, on the rank that owns it
   (and, in a schedule that splits backward, one W of each);
2. a rank runs the forward of a (stage, microbatch) before its backward, and its backward before its W;
3. data dependencies: F(s, m) needs F(s-1, m); B(s, m) needs B(s+1, m) (the last stage: F(s, m));
   activations and gradients travel as send/recv, so each rank's order must let every receive
   be matched by a send that some rank can reach: simulating all ranks must finish (no deadlock).

Zero-bubble schedules split each backward in two (Qi et al., ICLR 2024): ``B`` computes the gradient
of the stage's inputs, which the previous stage waits for, and ``W`` the gradients of the weights of
its matrix multiplies, which nothing waits for and which fill what would be the bubble. A schedule
splits backward when it has any ``W``; then every (stage, microbatch) has one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from autoshard.errors import PlanError

__all__ = ["SEVERAL_STAGES", "SPLIT_BACKWARD", "V_SCHEDULES", "Action", "Schedule", "ScheduleError"]

_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")
SPLIT_BACKWARD = ("zb_h1", "zb_h2", "zbv", "dualpipev")  # the named schedules whose backward is split into B and W
V_SCHEDULES = ("zbv", "dualpipev")  # the named schedules of two stages a rank, placed as a V
SEVERAL_STAGES = ("interleaved_1f1b", *V_SCHEDULES)  # the named schedules of several stages a rank


class ScheduleError(PlanError):
    """A pipeline schedule that cannot run: the message names the broken rule."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str  # "F", "B" or "W"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"{text!r} is not an action; write stage, F, B or W, microbatch: e.g. 1F0")
        return cls(int(match[1]), match[2], int(match[3]))

    def needs(self, n_stages: int) -> Action | None:
        """The action whose result this one needs: on another stage, received (None for the first forward);
        for W, its own B."""
        if self.kind == "W":
            return Action(self.stage, "B", self.microbatch)
        if self.kind == "F":
            return Action(self.stage - 1, "F", self.microbatch) if self.stage > 0 else None
        if self.stage == n_stages - 1:
            return Action(self.stage, "F", self.microbatch)
        return Action(self.stage + 1, "B", self.microbatch)


@dataclass(frozen=True)
class Schedule:
    """Per rank, the ordered actions it runs in one training step."""

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    ranks: tuple[tuple[Action, ...], ...]
    placement: str = "loop"  # "loop": stage s on rank s % pp; "v": down the ranks and back up (two a rank)

    def __post_init__(self) -> None:
        if self.placement not in ("loop", "v"):
            raise ScheduleError(f"placement={self.placement!r} must be 'loop' or 'v'")
        if self.placement == "v" and self.virtual_stages != 2:
            raise ScheduleError(f"the V placement puts two stages on each rank; virtual_stages={self.virtual_stages}")

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        if self.placement == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    @property
    def last_rank(self) -> int:
        """The rank the last stage (the loss, the outputs) runs on: pp - 1, or 0 at the end of a V."""
        return self.rank_of(self.n_stages - 1)

    @property
    def splits_backward(self) -> bool:
        """Whether backward runs as B (input gradients) and W (weight gradients), apart."""
        return any(a.kind == "W" for actions in self.ranks for a in actions)

    def __hash__(self) -> int:
        # Schedules key the planner's simulation caches; rehashing thousands of actions on every lookup
        # was a third of a 1024-rank search. Kept per process only (string hashes differ between processes).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.pp, self.microbatches, self.virtual_stages, self.ranks, self.placement))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in actions) for r, actions in enumerate(self.ranks))

    @classmethod
    def parse(
        cls,
        text: str,
        name: str = "custom",
        microbatches: int | None = None,
        virtual_stages: int = 1,
        placement: str = "loop",
    ) -> Schedule:
        """Read back what ``str(schedule)`` prints (``placement``: "v" for stages placed as ZBV places them)."""
        ranks = []
        for line in text.strip().splitlines():
            _, _, body = line.partition(":")
            ranks.append(tuple(Action.parse(tok) for tok in body.split()))
        mbs = microbatches if microbatches is not None else 1 + max(a.microbatch for r in ranks for a in r)
        return cls(name, len(ranks), mbs, virtual_stages, tuple(ranks), placement)

    def timeline(self) -> list[list[Action | None]]:
        """Simulate: each action takes one time unit once what it needs is done; raise on deadlock."""
        n_stages = self.n_stages
        done: dict[Action, int] = {}  # action -> time step it finished
        cursor = [0] * self.pp
        grid: list[list[Action | None]] = [[] for _ in range(self.pp)]
        total = sum(len(r) for r in self.ranks)
        t = 0
        while len(done) < total:
            progressed = []
            for rank, actions in enumerate(self.ranks):
                if cursor[rank] == len(actions):
                    grid[rank].append(None)
                    continue
                action = actions[cursor[rank]]
                need = action.needs(n_stages)
                if need is None or done.get(need, t) < t:
                    progressed.append((rank, action))
                    grid[rank].append(action)
                else:
                    grid[rank].append(None)
            if not progressed:
                waiting = ", ".join(
                    f"rank {r} waits at {self.ranks[r][cursor[r]]} for {self.ranks[r][cursor[r]].needs(n_stages)}"
                    for r in range(self.pp)
                    if cursor[r] < len(self.ranks[r])
                )
                raise ScheduleError(f"rule 3: {self.name} deadlocks at time {t}: {waiting}")
            for rank, action in progressed:
                done[action] = t
                cursor[rank] += 1
            t += 1
        for row in grid:  # trailing idle slots after the last rank finished
            del row[t:]
        return grid

    def check_for(self, pp: int) -> Schedule:
        """This (custom) schedule, checked for a pipeline of ``pp`` ranks and validated; raises ScheduleError."""
        if self.pp != pp:
            raise ScheduleError(f"the custom schedule has {self.pp} ranks but pp={pp}; write one row per rank")
        self.validate()
        return self

    def validate(self) -> None:
        """Check rules 1-3 for every rank; raise ScheduleError naming the first broken rule."""
        if len(self.ranks) != self.pp:
            raise ScheduleError(f"rule 1: {self.name} lists {len(self.ranks)} ranks for pp={self.pp}")
        kinds = "FBW" if self.splits_backward else "FB"
        expected = {Action(s, k, m) for s in range(self.n_stages) for k in kinds for m in range(self.microbatches)}
        seen: set[Action] = set()
        for rank, actions in enumerate(self.ranks):
            for action in actions:
                if action not in expected:
                    raise ScheduleError(f"rule 1: {self.name} rank {rank} runs {action}, which is not in this pipeline")
                if self.rank_of(action.stage) != rank:
                    raise ScheduleError(
                        f"rule 1: {self.name} runs {action} on rank {rank}, but stage {action.stage} lives on "
                        f"rank {self.rank_of(action.stage)}"
                    )
                if action in seen:
                    raise ScheduleError(f"rule 1: {self.name} runs {action} twice")
                seen.add(action)
                if action.kind == "B" and Action(action.stage, "F", action.microbatch) not in seen:
                    raise ScheduleError(f"rule 2: {self.name} rank {rank} runs {action} before its forward")
                if action.kind == "W" and Action(action.stage, "B", action.microbatch) not in seen:
                    raise ScheduleError(
                        f"rule 2: {self.name} rank {rank} runs {action} before its backward "
                        f"{Action(action.stage, 'B', action.microbatch)} (W needs the gradients B computes)"
                    )
        missing = sorted(expected - seen)
        if missing:
            raise ScheduleError(f"rule 1: {self.name} never runs {', '.join(map(str, missing[:4]))}")
        self.timeline()

    def table(self) -> str:
        """The schedule as a rank x time table ('.' is idle)."""
        grid = self.timeline()
        width = max(len(str(a)) for row in grid for a in row if a is not None)
        lines = [f"{self.name}: pp={self.pp}, microbatches={self.microbatches}, virtual stages={self.virtual_stages}"]
        for rank, row in enumerate(grid):
            cells = " ".join(f"{str(a) if a else '.':>{width}}" for a in row)
            lines.append(f"rank {rank}: {cells}")
        return "\n".join(lines)

    def idle_fraction(self) -> list[float]:
        """Per rank, the share of the step's time slots it sits idle (unit-time actions)."""
        grid = self.timeline()
        return [sum(a is None for a in row) / len(row) for row in grid]

    def stages_by_last_backward(self, rank: int) -> list[int]:
        """The stages of ``rank`` in the order their last backward (W, where split) runs: when their
        gradients are complete."""
        last_kind = "W" if self.splits_backward else "B"
        last = {a.stage: i for i, a in enumerate(self.ranks[rank]) if a.kind == last_kind}
        return sorted(last, key=last.__getitem__)

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most microbatches whose forward ran and backward has not (activations held); where
        backward is split, until its W (what W reads, the matmuls' inputs, stays until then)."""
        peaks = []
        ends = "W" if self.splits_backward else "B"
        for actions in self.ranks:
            live = peak = 0
            for action in actions:
                live += 1 if action.kind == "F" else -1 if action.kind == ends else 0
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def held_counts(self) -> list[tuple[tuple[int, int, int], ...]]:
        """Per rank, the triples (microbatches holding forward's activations, microbatches holding what their W
        reads, whether one is in its B) that no other moment of the rank exceeds in all three. A microbatch in
        its B counts in forward's while the gradients its W will read build up beside them (the inputs W reads
        are forward's own saved tensors). Without a split backward, (peak_in_flight, 0, 0)."""
        if not self.splits_backward:
            return [((peak, 0, 0),) for peak in self.peak_in_flight()]
        out = []
        for actions in self.ranks:
            forward = waiting = 0
            seen: set[tuple[int, int, int]] = set()
            for action in actions:
                if action.kind == "F":
                    forward += 1
                elif action.kind == "B":
                    seen.add((forward, waiting, 1))  # during B
                    forward, waiting = forward - 1, waiting + 1
                elif action.kind == "W":
                    waiting -= 1
                seen.add((forward, waiting, 0))
            out.append(_frontier(seen))
        return out


def _frontier(moments: set[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """The moments (forward's, W's, one in B) that no other holds at least as much as in every count, most
    forward first: a sweep per value of the last count (0 or 1; a search builds schedules of thousands of
    actions), less the moments with none in B that a moment with one in B covers."""

    def sweep(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        kept: list[tuple[int, int]] = []
        for pair in sorted(pairs, key=lambda p: (-p[0], -p[1])):
            if not kept or pair[1] > kept[-1][1]:
                kept.append(pair)
        return kept

    in_b = sweep([(f, w) for f, w, b in moments if b])
    none = [(f, w) for f, w in sweep([(f, w) for f, w, b in moments if not b])
            if not any(g >= f and v >= w for g, v in in_b)]  # fmt: skip
    return tuple(sorted([(f, w, 1) for f, w in in_b] + [(f, w, 0) for f, w in none], reverse=True))
