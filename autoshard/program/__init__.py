"""Program: what compile() returns, this rank's share of the distributed training program.

A thin facade: the plan and graphs come from the compiler (autoshard.compiler.Compiled); under a
process group the rank's components live in ``runtime`` (autoshard.runtime.rank.RankRuntime), and
state and checkpoints (program/state.py, program/across_ranks.py, autoshard/checkpoint/) and forward calls
(runtime/forward.py) live in their own modules.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx

from autoshard.distributed.comm import CommCounter, is_comm_failure
from autoshard.errors import DistributedError, InputError, first_line
from autoshard.inspection.metrics import Monitor, StepMetrics
from autoshard.program.data import check_rows
from autoshard.program.data import data_loader as rank_data_loader
from autoshard.program.rank_view import RankProgram
from autoshard.program.state import StateMethods
from autoshard.runtime.forward import ForwardRunner
from autoshard.runtime.pipeline import PipelineStats
from autoshard.runtime.rank import RankRuntime

if TYPE_CHECKING:
    from autoshard.compiler.compiled import Compiled

__all__ = ["Program", "RankProgram"]  # RankProgram lives in autoshard/program/rank_view.py


class Program(StateMethods):
    """This rank's compiled training program. Build one with ``autoshard.compile``."""

    def __init__(self, compiled: Compiled, optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None) -> None:
        self.compiled = compiled
        self.plan = compiled.plan
        self.mesh = compiled.plan.mesh
        self.plan_report = compiled.report  # the planner's candidates and why the winner won
        self.cost = compiled.cost
        self.schedule = compiled.schedule
        self.tp_report = compiled.tp_report
        self.analysis_log = compiled.analysis_log
        self.placements = compiled.placements
        self.comm = CommCounter()
        self._data_checks = compiled.check_data
        self.training = True
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.runtime: RankRuntime | None = None
        self._forward: ForwardRunner | None = None
        self.monitor: Monitor | None = None
        if self.is_meta or (not self._distributed and self.mesh.size > 1):
            return  # planning and inspection only
        self.runtime = RankRuntime(compiled, optimizer_factory, self.comm)
        self._forward = ForwardRunner(self.runtime)
        self.monitor = Monitor(self)  # program.metrics, the progress line, program.profile

    # ---- inspection -------------------------------------------------------------------------
    @property
    def captured_graph(self) -> fx.GraphModule:
        """The whole model and loss as captured, analysed and rewritten, before any pipeline split."""
        return self.compiled.captured.gm

    @property
    def graph_modules(self) -> list[fx.GraphModule]:
        """This rank's rewritten graph(s): with pp > 1 the graphs of its pipeline stages."""
        return self._graphs_of(self.rank)

    def _graphs_of(self, rank: int) -> list[fx.GraphModule]:
        if self.schedule is None:
            return [self.compiled.captured.gm]
        pp = self.mesh.coords(rank)["pp"]
        return [s.gm for s in self.compiled.stages if self.schedule.rank_of(s.stage) == pp]

    @property
    def compile_seconds(self) -> float | None:
        """With torch_compile: seconds this rank spent compiling its graphs so far (AOTAutograd and the backend)."""
        return None if self.runtime is None or self.runtime.compiler is None else self.runtime.compiler.seconds

    @property
    def compiled_graphs(self) -> list[Any]:
        """With torch_compile: each forward and backward graph as the backend got it (runtime/compiled.py)."""
        return [] if self.runtime is None or self.runtime.compiler is None else list(self.runtime.compiler.graphs)

    @property
    def is_meta(self) -> bool:
        return any(p.is_meta for p in self.compiled.model.parameters())

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer: the user's parameter groups and hyper-parameters (ZeRO: over fp32 shards)."""
        return None if self.runtime is None else self.runtime.optimizer

    @property
    def pipeline_stats(self) -> PipelineStats | None:
        """The last step's pipeline measurements on this rank (wall time, busy time, activations held)."""
        return None if self.runtime is None or self.runtime.runner is None else self.runtime.runner.stats

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step before clipping (None unless max_grad_norm is set)."""
        norm = None if self.runtime is None else self.runtime.last_grad_norm
        return None if norm is None else float(norm)

    @property
    def last_step_memory(self) -> dict[str, int]:
        """Bytes this rank held in the last step, by category (parameters, gradients, optimizer)."""
        return {} if self.runtime is None else dict(self.runtime.last_step_memory)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's trainable tensors: the model's parameters it holds, or with ZeRO-3 its flat shards."""
        rt = self.runtime
        if rt is not None and self.plan.zero == 3:
            yield from ((f"zero3.shards.{g}", s) for g, s in rt.holder.runtime.shards.items())
            return
        seen: set[int] = set()
        for name, param in self.compiled.model.named_parameters():
            if id(param) not in seen and self.placements[name].held_on(self.mesh.coords(self.rank), self.plan.ep):
                seen.add(id(param))
                yield name, param

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from (p for _, p in self.named_parameters())

    def for_rank(self, rank: int) -> RankProgram:
        """Rank ``rank``'s graphs and parameter placements; works offline for any mesh size."""
        coords = self.mesh.coords(rank)
        names = dict(self.compiled.model.named_parameters(remove_duplicate=False))
        held = {key: p for key, p in self.placements.items() if key in names and p.held_on(coords, self.plan.ep)}
        placements = {key: p.by_dim() for key, p in held.items()}
        return RankProgram(rank, coords, tuple(self._graphs_of(rank)), placements)

    def explain(self) -> str:
        """The plan, why it won, costs per layer, the mesh, pipeline stages and tensor-parallel placements."""
        from autoshard.inspection.explain import explain

        return explain(self)

    def __repr__(self) -> str:
        return f"<autoshard.Program {self.plan} rank={self.rank} of {self.mesh}>"

    # ---- running ------------------------------------------------------------------------------
    def _runtime(self, what: str) -> RankRuntime:
        if self.runtime is not None:  # every step comes here: not a walk over the model's parameters
            return self.runtime
        if self.is_meta:
            raise DistributedError(
                f"{what} needs real parameters, but the model is on the meta device: this program is for "
                f"planning and inspection; build the model on a real device and compile again to train"
            )
        raise DistributedError(
            f"{what} needs a process group of {self.mesh.size} ranks, but none is initialized: this program "
            f"was compiled offline for inspection; call torch.distributed.init_process_group() before "
            f"autoshard.compile (e.g. under torchrun --nproc-per-node {self.mesh.size})"
        )

    # ---- data per rank (program/data.py) --------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of every global batch it trains on."""
        return self.mesh.coords(self.rank)["dp"]

    @property
    def dp_size(self) -> int:
        """How many shares a global batch is cut into (the data-parallel degree)."""
        return self.plan.dp

    def data_loader(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        **kwargs: Any,
    ) -> torch.utils.data.DataLoader:
        """A DataLoader of this rank's share of every global batch of ``global_batch_size`` rows (a
        DistributedSampler over the dp ranks: every rank of a tp group or pipeline gets the same rows; a rank
        whose stages read no input loads nothing). ``kwargs`` go to the DataLoader (``collate_fn``,
        ``num_workers``, ...); call ``loader.sampler.set_epoch(epoch)`` each epoch to reshuffle."""
        runtime = self._runtime("data_loader()")
        return rank_data_loader(runtime, self.dp_rank, self.dp_size, dataset, global_batch_size, shuffle, seed,
                                drop_last, **kwargs)  # fmt: skip

    def local_batch(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows of a global batch (contiguous slices in dp-rank order)."""
        if not isinstance(global_tensor, torch.Tensor) or global_tensor.dim() == 0:
            raise InputError(f"local_batch takes a tensor with a batch dimension, got {type(global_tensor).__name__}")
        rows, dp = global_tensor.shape[0], self.plan.dp
        if rows % dp:
            raise InputError(
                f"a batch of {rows} rows is not divisible by dp={dp}; use a global batch that is a multiple of {dp}"
            )
        index, per = self.mesh.coords(self.rank)["dp"], rows // dp
        return global_tensor[index * per : (index + 1) * per]

    def step(self, *inputs: torch.Tensor, target: Any = None, **kwargs: torch.Tensor) -> float:
        """Forward, backward, gradient sync and optimizer step on this rank's local batch.

        Returns the global mean loss (the mean of the dp ranks' local mean losses), equal on every rank.
        """
        runtime = self._runtime("step()")
        call = self.compiled.captured.call
        flat = call.flatten_inputs(inputs, kwargs) + call.flatten_target(target)
        call.check_against(flat, runtime.input_shapes)
        try:
            if self._data_checks > 0:  # the first steps: the ranks that share rows got the same ones
                self._data_checks -= 1
                self.comm.last_op = "check_rows"  # the all-gather of what each rank was handed
                check_rows(runtime, flat)
            loss = runtime.step(flat)
        except RuntimeError as error:  # a peer died or stalled: say where, in one line
            if not is_comm_failure(error):
                raise
            first = first_line(error, 300)
            raise DistributedError(
                f"rank {self.rank}: step {runtime.steps + 1} failed in {self.comm.last_op or 'a collective'} "
                f"(timeout {self.compiled.timeout:g}s; another rank died or stalled): {first}"
            ) from error
        self.monitor.after_step(loss, flat)
        return loss

    @property
    def metrics(self) -> StepMetrics | None:
        """The last step measured on this rank: tokens/s, TFLOP/s per rank, MFU, time split, peak memory."""
        return None if self.monitor is None else self.monitor.last

    def profile(self, path: str | os.PathLike, steps: int = 2) -> Path:
        """Record the next ``steps`` steps into a Chrome trace on every rank (``path`` with ``.rank<r>``)."""
        self._runtime("profile()")
        return self.monitor.profile(path, steps)

    def report(self, path: str | os.PathLike) -> Path | None:
        """One self-contained HTML page: plan, memory, timeline, layers, graphs. Under a process group call
        it on every rank (rank 0 writes it, with every rank's measurements)."""
        from autoshard.inspection.report import write_report

        return write_report(self, path)

    def train(self, mode: bool = True) -> Program:
        """Forward calls compute as in training (dropout on); ``step()`` always trains."""
        self.training = mode
        return self

    def eval(self) -> Program:
        """Forward calls compute as the model in eval mode: dropout off, batch norm on its running statistics."""
        return self.train(False)

    def __call__(self, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        """Forward only, without autograd: the model's outputs for this rank's local inputs, on every rank
        (non-tensor outputs are None)."""
        self._runtime("a forward call")
        call = self.compiled.captured.call
        outputs = self._forward(call.flatten_inputs(inputs, kwargs), self.training)
        return call.unflatten_outputs(outputs)
