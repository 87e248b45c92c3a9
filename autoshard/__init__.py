"""autoshard: compile a single-device PyTorch model into a distributed training program.

program = autoshard.compile(model, autoshard.Mesh(dp=4), example_inputs=(input_ids,), optimizer=...)
loss = program.step(program.local_batch(input_ids), target=...)
"""

from autoshard.checkpoint import latest_checkpoint
from autoshard.compiler import compile
from autoshard.errors import (
    AutoshardError,
    CaptureError,
    CompileError,
    DistributedError,
    InputError,
    MeshError,
    MissingMetaError,
    PlanError,
)
from autoshard.inspection.verify import VerifyReport, verify
from autoshard.ir.cost import LayerCost, ModelCost
from autoshard.ir.placements import Partial, Replicate, Shard
from autoshard.planner import Candidate, Memory, PlanReport, StepTime, plan
from autoshard.planner.hardware import Hardware
from autoshard.program import Program, RankProgram
from autoshard.spec.mesh import Mesh
from autoshard.spec.plan import Plan
from autoshard.spec.schedules import Schedule

__all__ = [
    "AutoshardError",
    "Candidate",
    "CaptureError",
    "CompileError",
    "DistributedError",
    "Hardware",
    "InputError",
    "LayerCost",
    "Memory",
    "Mesh",
    "MeshError",
    "MissingMetaError",
    "ModelCost",
    "Partial",
    "Plan",
    "PlanError",
    "PlanReport",
    "Program",
    "RankProgram",
    "Replicate",
    "Schedule",
    "Shard",
    "StepTime",
    "VerifyReport",
    "compile",
    "latest_checkpoint",
    "plan",
    "verify",
]

__version__ = "0.1.0"
