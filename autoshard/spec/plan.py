"""The plan: which parallel strategy each mesh dimension runs, as a frozen, printable record."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.errors import PlanError
from autoshard.spec.mesh import Mesh
from autoshard.spec.schedules import SEVERAL_STAGES, SPLIT_BACKWARD, V_SCHEDULES, Schedule

__all__ = [
    "CP_ATTENTION",
    "DROPOUT_MASKS",
    "RECOMPUTE",
    "SCHEDULES",
    "Plan",
    "is_mixed_precision",
    "parse_dtype",
    "resolve_plan",
    "splits_backward",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev")
LOW_PRECISION = (torch.bfloat16, torch.float16)
RECOMPUTE = ("none", "full", "selective")
CP_ATTENTION = ("ring", "all_to_all")
DROPOUT_MASKS = ("per_rank", "single_device")


DTYPE_FIELDS = ("param_dtype", "autocast", "reduce_dtype")
_DTYPE_NAMES = {
    **dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16", "half"), torch.float16),
    **dict.fromkeys(("fp32", "float32", "float"), torch.float32),
}


def parse_dtype(field: str, value: Any) -> torch.dtype | None:
    """A dtype plan field as a torch.dtype, from one or a name ("bf16", "bfloat16", "torch.bfloat16", ...)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower().removeprefix("torch.")]
    raise PlanError(
        f"plan field {field}={value!r} is not a dtype: write torch.bfloat16, or a name such as 'bf16', "
        f"'bfloat16', 'fp16' or 'fp32'"
    )


def is_mixed_precision(param_dtype: torch.dtype | None) -> bool:
    """Computing in a lower precision than fp32 (so fp32 master weights are kept apart)."""
    return param_dtype not in (None, torch.float32)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"plan field {name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class Plan:
    """Degrees and options of one distributed training program.

    dp, tp, pp        data, tensor and pipeline parallel degrees; their product (with cp) is the world size
    cp                context parallel degree: every sequence is split over cp ranks (two chunks each, i and
                      2cp-1-i of 2cp, so causal attention is balanced); attention runs as ring attention (K/V
                      blocks passed round the cp ranks), every other op on the rank's own tokens; parameters
                      are replicated over cp and their gradients reduced over dp x cp (passes/context_parallel.py)
    cp_attention      how attention sees the whole sequence under cp: "ring" (K/V blocks passed round the cp
                      ranks, overlapped with the block in hand) or "all_to_all" (the sequence traded for heads,
                      DeepSpeed Ulysses: heads and K/V heads must divide by cp)
    ep                expert parallel degree, carved out of dp (it divides dp): each group of ep consecutive dp
                      ranks holds E / ep of a mixture of experts' E experts and sends each token to the rank
                      of its expert with an all-to-all; dense layers stay data parallel over all dp ranks,
                      each expert over the dp / ep ranks that hold it (graph_ops/experts.py)
    zero              ZeRO stage over the dp group (0: plain data parallel)
    offload           keep optimizer state and its update on the CPU
    schedule          pipeline schedule (used when pp > 1): one of SCHEDULES, or a Schedule of your own
                      (autoshard.Schedule.parse("rank 0: 0F0 0B0 ...")), validated at compile
    microbatches      microbatches per step; each dp rank's batch must divide into them. With pp > 1 they fill
                      the pipeline; with pp = 1 they are gradient accumulation (k forward/backward passes, one
                      gradient synchronization)
    virtual_stages    stages per pipeline rank (interleaved 1F1B); the model is cut into pp * virtual_stages
    pp_cuts           names of the blocks (or graph nodes) that start stages 1.. (("transformer.h.6",)); None: balanced
    bucket_mb         size of a data-parallel gradient bucket in MiB (the first to fill: at most 1 MiB)
    max_grad_norm     clip gradients to this global L2 norm before the optimizer step (None: no clipping)
    param_dtype       compute dtype of parameters (e.g. torch.bfloat16); fp32 masters stay in the optimizer
                      shards (needs zero >= 1). The model is converted in place. None: the model's dtype.
    sequence_parallel with tp > 1: layer norms, dropout and residual adds work on sequence shards, and the
                      all-reduces of tensor parallelism become all-gathers and reduce-scatters
    recompute         activations recomputed in backward instead of kept: "none"; "full" (each block keeps only
                      its input); "selective" (keep the outputs of matmuls with weights and of communication,
                      recompute attention, norms, dropout and pointwise ops, where that frees memory); a budget
                      in (0, 1): keep at most that share of the bytes autograd would keep, recomputing the spans
                      that repeat the least work for it (passes/recompute_budget.py); or a tuple of block names
                      (full recomputation of just those blocks)
    dropout_masks     "per_rank": each rank draws its own dropout masks (fast); "single_device": every rank
                      draws each mask for the global batch as one device would and keeps its slice, so
                      training with dropout equals single-device training bit for bit (costs draws at
                      global size on every rank; graph_ops/masks.py)
    autocast          run every graph under torch.autocast in this dtype (e.g. torch.bfloat16): matmuls in
                      bf16, parameters, gradients and the optimizer in fp32 (the alternative to param_dtype)
    reduce_dtype      the dtype gradients are reduced in over dp (None: their own): torch.float32 with bf16
                      parameters sums in full precision; torch.bfloat16 with autocast halves the bytes moved
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_attention: str = "ring"
    ep: int = 1
    zero: int = 0
    offload: bool = False
    schedule: str | Schedule = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    pp_cuts: tuple[str, ...] | None = None
    bucket_mb: float = 25.0
    max_grad_norm: float | None = None
    param_dtype: torch.dtype | None = None
    sequence_parallel: bool = False
    recompute: str | float | tuple[str, ...] = "none"
    dropout_masks: str = "per_rank"
    autocast: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in DTYPE_FIELDS:  # "bf16", "bfloat16", "torch.bfloat16": the dtype
            object.__setattr__(self, name, parse_dtype(name, getattr(self, name)))
        if isinstance(self.schedule, Schedule):
            # A schedule of one's own fixes the microbatches and virtual stages (compile refuses a
            # plan that asks for other numbers alongside it).
            object.__setattr__(self, "microbatches", self.schedule.microbatches)
            object.__setattr__(self, "virtual_stages", self.schedule.virtual_stages)
        elif self.schedule not in SCHEDULES:
            raise PlanError(
                f"plan field schedule={self.schedule!r} must be one of {SCHEDULES} or an autoshard.Schedule"
            )
        for name in ("dp", "tp", "pp", "cp", "ep", "microbatches", "virtual_stages"):
            _positive_int(name, getattr(self, name))
        if self.dp % self.ep:
            raise PlanError(
                f"ep={self.ep} carves expert-parallel groups out of the data-parallel ranks, so it must divide "
                f"dp={self.dp}; choose ep among {[d for d in range(1, self.dp + 1) if self.dp % d == 0]}"
            )
        if self.schedule_name in V_SCHEDULES:  # two stages a rank, placed as a V: the schedule's own shape
            if self.virtual_stages not in (1, 2):
                raise PlanError(
                    f"schedule={self.schedule_name!r} runs two stages on each rank; "
                    f"virtual_stages={self.virtual_stages}"
                )
            object.__setattr__(self, "virtual_stages", 2)
        if self.pp == 1 and self.schedule_name in SEVERAL_STAGES:
            object.__setattr__(self, "virtual_stages", 1)  # pp=1 runs no schedule: the model is one stage
        if self.virtual_stages > 1 and self.schedule_name not in (*SEVERAL_STAGES, "custom"):
            raise PlanError(
                f"virtual_stages={self.virtual_stages} puts several stages on each rank, which only "
                f"schedule='interleaved_1f1b' runs; use that schedule or virtual_stages=1"
            )
        if self.pp_cuts is not None:
            if isinstance(self.pp_cuts, str) or not all(isinstance(c, str) for c in self.pp_cuts):
                raise PlanError(f"plan field pp_cuts={self.pp_cuts!r} must be a list of block or node names")
            object.__setattr__(self, "pp_cuts", tuple(self.pp_cuts))  # hashable, printable
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"plan field zero={self.zero!r} must be one of 0, 1, 2, 3")
        if not isinstance(self.offload, bool):
            raise PlanError(f"plan field offload={self.offload!r} must be True or False")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or self.bucket_mb <= 0:
            raise PlanError(f"plan field bucket_mb={self.bucket_mb!r} must be a positive number of MiB")
        if self.max_grad_norm is not None and (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, (int, float))
            or self.max_grad_norm <= 0
        ):
            raise PlanError(f"plan field max_grad_norm={self.max_grad_norm!r} must be a positive number or None")
        if self.param_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise PlanError(f"plan field param_dtype={self.param_dtype!r} must be torch.bfloat16, float16 or float32")
        if self.mixed_precision and self.zero == 0:
            raise PlanError(
                f"param_dtype={self.param_dtype} keeps fp32 master weights in ZeRO's optimizer shards: "
                f"it needs zero=1, 2 or 3"
            )
        if self.offload and self.zero == 0:
            raise PlanError("offload=True keeps ZeRO's optimizer shards on the CPU: it needs zero=1, 2 or 3")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"plan field sequence_parallel={self.sequence_parallel!r} must be True or False")
        if isinstance(self.recompute, (list, tuple)):
            if not self.recompute or not all(isinstance(b, str) for b in self.recompute):
                raise PlanError(f"plan field recompute={self.recompute!r} must name blocks (e.g. ('transformer.h.0',))")
            object.__setattr__(self, "recompute", tuple(self.recompute))
        elif isinstance(self.recompute, float):
            if not 0.0 < self.recompute < 1.0:
                raise PlanError(
                    f"plan field recompute={self.recompute!r} as a budget is the share of activation bytes to keep: "
                    f"between 0 and 1, both excluded (recompute='full' keeps the least)"
                )
        elif self.recompute not in RECOMPUTE:
            raise PlanError(
                f"plan field recompute={self.recompute!r} must be one of {RECOMPUTE}, a budget between 0 and 1 (the "
                f"share of activation bytes to keep) or a tuple of block names"
            )
        if self.dropout_masks not in DROPOUT_MASKS:
            raise PlanError(f"plan field dropout_masks={self.dropout_masks!r} must be one of {DROPOUT_MASKS}")
        for name in ("autocast", "reduce_dtype"):
            if getattr(self, name) not in (None, *LOW_PRECISION, *((torch.float32,) if name == "reduce_dtype" else ())):
                allowed = "torch.bfloat16 or float16" + (", float32" if name == "reduce_dtype" else "")
                raise PlanError(f"plan field {name}={getattr(self, name)!r} must be {allowed}, or None")
        if self.autocast is not None and self.mixed_precision:
            raise PlanError(
                f"autocast={self.autocast} computes in low precision from fp32 parameters, param_dtype="
                f"{self.param_dtype} stores them in low precision: use one of the two"
            )
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel=True shards activations across the tp group: it needs tp > 1")
        if self.cp_attention not in CP_ATTENTION:
            raise PlanError(f"plan field cp_attention={self.cp_attention!r} must be one of {CP_ATTENTION}")
        if self.cp > 1:
            others = {"ep": self.ep}
            if any(v > 1 for v in others.values()):
                raise PlanError(
                    f"cp={self.cp} composes with dp, tp, pp and ZeRO in this version, not yet with "
                    + ", ".join(f"{k}={v}" for k, v in others.items() if v > 1)
                    + "; use cp with dp, tp and pp (Mesh(dp=.., cp=.., tp=.., pp=..)), or that dimension without cp"
                )
            if self.dropout_masks != "per_rank":
                raise PlanError(
                    f"dropout_masks={self.dropout_masks!r} draws each mask for the global batch as one device does; "
                    f"under cp={self.cp} this version draws each rank's own (dropout_masks='per_rank')"
                )

    @property
    def schedule_name(self) -> str:
        return "custom" if isinstance(self.schedule, Schedule) else self.schedule

    @property
    def v_placement(self) -> bool:
        """Whether the pipeline's stages sit as a V (zbv: rank r holds stages r and 2pp-1-r)."""
        if self.pp == 1:  # one stage: no pipeline, whatever the schedule's name
            return False
        return self.schedule.placement == "v" if isinstance(self.schedule, Schedule) else self.schedule in V_SCHEDULES

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)

    @property
    def mixed_precision(self) -> bool:
        return is_mixed_precision(self.param_dtype)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def first_bucket_bytes(self) -> int:
        """The first gradient bucket to fill is smaller, so its reduction starts early in backward (DDP's 1 MiB,
        ``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""
        return min(self.bucket_bytes, 2**20)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        """The fields a user fixed, checked (names, values, and how the fixed ones fit together) before
        anything touches the model; dtype names parsed. The planner fills the rest so that they fit."""
        fields = cls.field_names()
        for name in overrides:
            if name not in fields:
                near = difflib.get_close_matches(name, fields, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise PlanError(f"unknown plan field {name!r}; {hint}the fields are {list(fields)}")
        fixed = {k: parse_dtype(k, v) if k in DTYPE_FIELDS else v for k, v in overrides.items()}
        # What the fixed fields need of the others, where those are left to the planner.
        context: dict[str, Any] = {}
        if "zero" not in fixed and (is_mixed_precision(fixed.get("param_dtype")) or fixed.get("offload") is True):
            context["zero"] = 1
        if "dp" not in fixed and isinstance(fixed.get("ep"), int) and fixed["ep"] > 1:
            context["dp"] = fixed["ep"]
        if "tp" not in fixed and fixed.get("sequence_parallel") is True:
            context["tp"] = 2
        if "schedule" not in fixed and isinstance(fixed.get("virtual_stages"), int) and fixed["virtual_stages"] > 1:
            context["schedule"] = "interleaved_1f1b"
        cls(**{**context, **fixed})  # raises the field's own PlanError
        return fixed

    def __str__(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"zero={self.zero}"]
        if self.cp > 1:
            parts.insert(1, f"cp={self.cp}" + (f" ({self.cp_attention})" if self.cp_attention != "ring" else ""))
        if self.ep > 1:
            parts.insert(1, f"ep={self.ep}")
        if self.offload:
            parts.append("offload")
        if self.pp > 1:
            parts += [f"schedule={self.schedule_name}", f"microbatches={self.microbatches}"]
            if self.virtual_stages > 1:
                parts.append(f"virtual_stages={self.virtual_stages}")
            if self.pp_cuts is not None:
                parts.append(f"pp_cuts={list(self.pp_cuts)}")
        elif self.microbatches > 1:
            parts.append(f"microbatches={self.microbatches}")
        parts.append(f"bucket={self.bucket_mb:g}MiB")
        if self.max_grad_norm is not None:
            parts.append(f"max_grad_norm={self.max_grad_norm:g}")
        if self.param_dtype is not None:
            parts.append(f"param_dtype={str(self.param_dtype).removeprefix('torch.')}")
        if self.sequence_parallel:
            parts.append("sequence_parallel")
        if self.dropout_masks != "per_rank":
            parts.append(f"dropout_masks={self.dropout_masks}")
        for name in ("autocast", "reduce_dtype"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={str(getattr(self, name)).removeprefix('torch.')}")
        if self.recompute != "none":
            parts.append(f"recompute={list(self.recompute) if isinstance(self.recompute, tuple) else self.recompute}")
        return "Plan(" + ", ".join(parts) + ")"


def resolve_plan(plan: Any) -> dict[str, Any]:
    """The fields a user fixed (``"auto"``: none), from a Plan or a dict, checked."""
    if isinstance(plan, str) and plan == "auto":
        return {}
    if isinstance(plan, Plan):
        return {name: getattr(plan, name) for name in Plan.field_names()}  # asdict would unpack a Schedule
    if isinstance(plan, dict):
        plan = Plan.check_overrides(plan)
        schedule = plan.get("schedule")
        if isinstance(schedule, Schedule):
            for name in ("microbatches", "virtual_stages"):
                if name in plan and plan[name] != getattr(schedule, name):
                    raise PlanError(
                        f"plan asks for {name}={plan[name]} but its schedule has {getattr(schedule, name)}; "
                        f"drop {name} from the plan (the schedule sets it)"
                    )
        return dict(plan)
    raise PlanError(f'plan must be "auto", an autoshard.Plan, or a dict of Plan fields, got {plan!r}')


def splits_backward(plan: Plan) -> bool:
    """Whether the plan's pipeline runs backward as B and W apart (a zero-bubble schedule)."""
    if plan.pp == 1:
        return False
    if isinstance(plan.schedule, Schedule):
        return plan.schedule.splits_backward
    return plan.schedule in SPLIT_BACKWARD
