"""The GPU check suite: what only a CUDA device can show (``python -m pytest -m gpu tests/test_gpu.py``).

Skipped where torch sees no CUDA device (CI). On a machine with one GPU the ranks share it: NCCL
refuses two ranks on one device, so their collectives run on gloo through host memory
(autoshard/distributed/gloo_via_host.py) while every tensor of the program lives on the GPU; with a GPU per rank
they run on NCCL. The main plans of the equivalence grid are compared with single-device training on
the same GPU; one rank runs on NCCL; the CUDA allocator is compared with the saved-tensor accounting;
offload keeps its host state in pinned memory; ``Hardware.measure()`` calibrates the device.

With AUTOSHARD_GPU_RECORD=<file> each test appends what it measured (one JSON object a line), which
bench/gpu.py folds into its table. AUTOSHARD_GPU_REHEARSAL=1 runs the suite on the CPU instead (ranks
through the same host-staged process group, the CUDA-only checks skipped): a rehearsal before GPU time.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
import torch
from cases import train_plan, train_single_device
from compiled_cases import train_compiled

import autoshard
from autoshard.distributed import gloo_via_host
from autoshard.launch import LocalRanks

REHEARSAL = bool(os.environ.get("AUTOSHARD_GPU_REHEARSAL"))
DEVICE = "cpu" if REHEARSAL else "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not REHEARSAL and not torch.cuda.is_available(), reason="the GPU suite needs a CUDA device"),
]
cuda_only = pytest.mark.skipif(REHEARSAL, reason="measures the CUDA allocator")

# Losses and parameters against one device on the same GPU. CUDA picks kernels by shape (a sharded matmul
# may reduce in another order than the whole one), so the bounds are looser than the CPU suite's 1e-5;
# a wrong gradient or a missed reduction moves parameters by the learning rate (1e-3) a step.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4

PLANS = {  # id: (family, mesh, plan, torch_compile), grouped by world size (one pool of ranks at a time)
    "dp2": ("gpt2", {"dp": 2}, {}, False),
    "dp2-zero1": ("llama", {"dp": 2}, {"zero": 1}, False),
    "dp2-zero2": ("gpt2", {"dp": 2}, {"zero": 2}, False),
    "dp2-zero3-offload": ("llama", {"dp": 2}, {"zero": 3, "offload": True}, False),
    "dp2-recompute-full": ("llama", {"dp": 2}, {"recompute": "full"}, False),
    "tp2-sequence-parallel": ("gpt2", {"tp": 2}, {"sequence_parallel": True}, False),
    "pp2-1f1b": ("gpt2", {"pp": 2}, {"schedule": "1f1b", "microbatches": 2}, False),
    "dp2xtp2-zero3-sp": ("llama", {"dp": 2, "tp": 2}, {"zero": 3, "sequence_parallel": True}, False),
    "dp2xtp2-torch-compile": ("gpt2", {"dp": 2, "tp": 2}, {}, True),
    "dp2xtp2xpp2-zero1": ("gpt2", {"dp": 2, "tp": 2, "pp": 2}, {"zero": 1, "microbatches": 2}, False),
}


def record(**row: Any) -> None:
    path = os.environ.get("AUTOSHARD_GPU_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def gpu_ranks():
    pools: dict[int, LocalRanks] = {}

    def get(world: int) -> LocalRanks:
        if world not in pools:
            for other in list(pools):  # one pool at a time: each rank holds a CUDA context
                pools.pop(other).close()
            if REHEARSAL:
                pools[world] = LocalRanks(world, backend=gloo_via_host.BACKEND).start()
                pools[world].run(_stage_host_tensors)
            else:
                pools[world] = LocalRanks(world, device=DEVICE).start()
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()


def _stage_host_tensors(rank: int, world: int) -> None:
    gloo_via_host.GlooViaHost.stage_host_tensors = True


def _device_index() -> str:
    return "cpu" if REHEARSAL else f"cuda:{torch.cuda.current_device()}"


@functools.cache
def reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, state = train_single_device(family, layers=2, device=DEVICE)
    return losses, {k: v.cpu() for k, v in state.items()}


def _on_gpu(rank: int, world: int, family: str, mesh: dict, plan: dict, compiled: bool) -> dict[str, Any]:
    """One rank of a plan with its model and batches on the GPU; where its tensors ended up."""
    if compiled:
        result = train_compiled(rank, world, family, mesh, plan, "inductor", layers=2, device=DEVICE)
    else:
        result = train_plan(rank, world, family, mesh, plan, layers=2, device=DEVICE)
    devices = {str(v.device) for v in result["state"].values()}
    return {"losses": result["losses"], "state": {k: v.cpu() for k, v in result["state"].items()}, "devices": devices}


def _offload_memory(rank: int, world: int) -> dict[str, Any]:
    from cases import build_case, compile_case

    case = build_case("llama", layers=2, device=DEVICE)
    program = compile_case(case, autoshard.Mesh(dp=world), plan={"zero": 2, "offload": True})
    batch = case.batches[0]
    program.step(program.local_batch(batch.inputs[0]), labels=program.local_batch(batch.kwargs["labels"]))
    masters = program.runtime.holder.masters
    state = [t for s in program.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "masters_on": sorted({str(m.device) for m in masters.tensors.values()}),
        # what crosses the bus is pinned: the masters (copied up after the step) and the gradients' host buffers
        "pinned": all(t.is_pinned() for t in masters.host_tensors()),
        "state_on": sorted({str(t.device) for t in state if t.dim() > 0}),
        "params_on": sorted({str(p.device) for p in program.parameters()}),
    }


def test_offload_keeps_the_host_state_in_pinned_memory(gpu_ranks) -> None:
    for result in gpu_ranks(2).run(_offload_memory):
        assert result["masters_on"] == ["cpu"] and result["state_on"] == ["cpu"]
        assert result["pinned"] or REHEARSAL  # a CPU-only machine pins nothing
        assert result["params_on"] == [_device_index()]


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_on_the_gpu_equals_single_device_training(gpu_ranks, name: str) -> None:
    family, mesh, plan, compiled = PLANS[name]
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    pool = gpu_ranks(world)
    results = pool.run(_on_gpu, family, mesh, plan, compiled)
    ref_losses, ref_state = reference(family)
    loss_gap = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref_losses))
    state = results[0]["state"]
    param_gap = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    record(kind="equivalence", plan=name, family=family, world=world, backend=pool.backend,
           loss_rel_gap=loss_gap, param_max_abs_gap=param_gap)  # fmt: skip
    assert results[0]["devices"] <= {"cuda:0", _device_index()}, results[0]["devices"]
    assert state.keys() == ref_state.keys()
    assert loss_gap <= LOSS_RTOL, (name, results[0]["losses"], ref_losses)
    assert param_gap <= PARAM_ATOL, name


def _nccl_step(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    result = train_plan(rank, world, "llama", {"dp": world}, {"zero": 1}, layers=2, device=DEVICE)
    return {"losses": result["losses"], "backend": dist.get_backend(),
            "state": {k: v.cpu() for k, v in result["state"].items()}}  # fmt: skip


def test_one_rank_on_nccl_equals_single_device_training() -> None:
    with LocalRanks(1, backend="gloo" if REHEARSAL else "nccl") as pool:
        (result,) = pool.run(_nccl_step)
    ref_losses, ref_state = reference("llama")
    assert result["backend"] == ("gloo" if REHEARSAL else "nccl")
    assert result["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    gap = max((result["state"][k] - v).abs().max().item() for k, v in ref_state.items())
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref_losses))
    record(kind="equivalence", plan="one rank, NCCL, ZeRO-1", family="llama", world=1, backend=result["backend"],
           loss_rel_gap=loss_gap, param_max_abs_gap=gap)  # fmt: skip
    assert gap <= PARAM_ATOL


def _gpt_block_bytes(layers: int, batch: int, seq: int, width: int, heads: int) -> tuple[int, int]:
    """What the forward of a bf16 GPT-2 (CUDA kernels, eager attention, dropout 0.1) leaves allocated on the
    CUDA allocator beyond its outputs, and what passes.saved_tensors accounts for its middle block."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=1024, n_positions=1024, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, activation_function="gelu_pytorch_tanh", attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, 1024, (batch, seq), device=DEVICE)
    program = autoshard.compile(model, 1, (ids,), {"labels": ids, "use_cache": False},
                                hardware=autoshard.Hardware.preset("h200"))  # fmt: skip
    gm = program.for_rank(0).graph_modules[0]
    gm(ids, ids)  # warm, then freed: cuBLAS's workspace comes from the caching allocator at the first matmul
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs = gm(ids, ids)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    kept -= sum(o.untyped_storage().nbytes() for o in outputs if isinstance(o, torch.Tensor))
    accounted = program.cost.saved_for_backward[0][1].evaluate(B=batch, S=seq)["transformer.h.1"]
    del outputs
    return kept, int(accounted)


@cuda_only
def test_a_gpt_block_keeps_what_the_accounting_and_korthikanti_say() -> None:
    """One bf16 GPT block (the difference of 3 and 2 blocks) on the CUDA allocator, against
    passes.saved_tensors and Korthikanti et al.'s sbh(34 + 5as/h) bytes."""
    b, s, h, a = 4, 512, 1024, 16
    three, accounted = _gpt_block_bytes(3, b, s, h, a)
    two, _ = _gpt_block_bytes(2, b, s, h, a)
    measured = three - two
    published = s * b * h * (34 + 5 * a * s / h)
    record(kind="activations", what=f"one bf16 GPT block, b={b} s={s} h={h} a={a}", measured=measured,
           accounted=accounted, korthikanti=published)  # fmt: skip
    assert measured == pytest.approx(accounted, rel=0.10)
    assert measured == pytest.approx(published, rel=0.10)


def test_hardware_measure_calibrates_the_gpu() -> None:
    measured = autoshard.Hardware.measure()
    preset = autoshard.Hardware.preset("h200")
    peak = dict(measured.peak_flops)["float32" if REHEARSAL else "bfloat16"]
    device = "cpu" if REHEARSAL else torch.cuda.get_device_name()
    record(kind="hardware", device=device, measured=json.loads(measured.to_json()), preset=json.loads(preset.to_json()))
    if not REHEARSAL:
        assert measured.kernels == "cuda" and measured.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert (1e9 if REHEARSAL else 1e12) < peak < 5e15 and 1e10 < measured.memory_bandwidth < 2e13
    assert 1e9 < measured.host_bandwidth < 1e12 and 1e9 < measured.host_memory_bandwidth < 1e12
    assert 0 < measured.op_overhead < 1e-3
