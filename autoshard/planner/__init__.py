"""The planner: enumerate plans for a world size, predict per-rank memory and step time, pick one.

    report = autoshard.plan(model, 64, (ids,), {"labels": ids}, hardware=autoshard.Hardware.preset("h100-80gb"))
    best = report[0]          # candidates best first: .plan .step_time .memory .mfu .why .max_batch()

The pieces: ``profile`` reads the captured graph once (FLOPs, bytes, the collectives tensor parallelism
inserts per degree, what backward keeps per recompute choice, per layer, repeated blocks costed once);
``costing`` turns a profile and a plan into memory and time (simulating the pipeline schedule);
``search`` enumerates plans under their constraints and ranks them; ``report`` holds the answer.
"""

from autoshard.planner.api import plan
from autoshard.planner.report import Candidate, Memory, PlanReport, StepTime
from autoshard.planner.search import choose_plan, default_microbatches

__all__ = ["Candidate", "Memory", "PlanReport", "StepTime", "choose_plan", "default_microbatches", "plan"]
