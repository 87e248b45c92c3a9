"""autoshard on a GPU machine: one script for the single-GPU numbers, and NCCL equivalence and speed with several.

    python bench/gpu.py                              # a 1B-class Llama on cuda:0 (bf16 autocast), then NCCL
    python bench/gpu.py --device cpu --size tiny     # the same steps on the CPU, small (what CI runs)

One device: the Hugging Face model trained eagerly and with torch.compile, against autoshard's program
(dp = 1) run eagerly and with torch_compile=True: step time, tokens/s and MFU against the device's peak
(--peak-tflops, or the table below). Then ZeRO-1/2/3 with offload (one rank shards nothing, so the host
keeps the masters and optimizer state): the peak bytes allocated in a step against the ZeRO formulas.
With --ranks N (every GPU by default when there are several): dp=N compiled against single-device
training (losses and parameters), and its step time against DDP around torch.compile(model), on NCCL
(gloo on the CPU). Prints one markdown table; nothing here asserts a duration.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any

import torch

import autoshard
from autoshard.launch import LocalRanks

SIZES = {  # Llama shapes: "1b" is Llama-3.2-1B's body with a 32k vocabulary (0.97B parameters)
    "1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv": 8, "inter": 8192, "vocab": 32000, "seq": 2048, "batch": 4},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "inter": 128, "vocab": 256, "seq": 32, "batch": 4},
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}  # bf16 dense
ROWS: list[tuple[str, str, str, str, str]] = []


def row(name: str, step: float, tokens: int, flops: float, peak: float | None, extra: str = "") -> None:
    mfu = f"{flops / step / peak:.3f}" if peak else "n/a (no peak given)"
    ROWS.append((name, f"{step * 1e3:.1f} ms", f"{tokens / step:,.0f}", mfu, extra))
    print(f"{name}: {step * 1e3:.1f} ms/step, {tokens / step:,.0f} tokens/s, MFU {mfu} {extra}", flush=True)


def build(size: dict[str, int], device: torch.device, seed: int = 0) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=size["hidden"], num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"], intermediate_size=size["inter"], vocab_size=size["vocab"],
        max_position_embeddings=size["seq"], bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    with device:
        return transformers.LlamaForCausalLM(cfg)


def batches(size: dict[str, int], device: torch.device, n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen).to(device) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Any, data: list[torch.Tensor], device: torch.device, warmup: int = 2) -> float:
    for ids in data[:warmup]:
        step(ids)
    sync(device)
    times = []
    for ids in data[warmup:]:
        start = time.perf_counter()
        step(ids)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_step(model: torch.nn.Module, autocast: torch.dtype | None, device: torch.device) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, autocast, enabled=autocast is not None):
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()

    return step


def program_for(model: torch.nn.Module, ids: torch.Tensor, plan: dict[str, Any], **options: Any) -> autoshard.Program:
    return autoshard.compile(
        model, 1, (ids,), {"labels": ids, "use_cache": False}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        plan={"dp": 1, **plan}, **options,
    )  # fmt: skip


def single_device(args: argparse.Namespace, device: torch.device) -> None:
    size = SIZES[args.size]
    autocast = torch.bfloat16 if device.type == "cuda" else None
    data = batches(size, device, args.steps + 2)
    tokens = size["batch"] * size["seq"]
    probe = program_for(build(size, torch.device("meta")), data[0].cpu(), {})
    flops = 3 * float(probe.cost.evaluate(B=size["batch"], S=size["seq"]).flops_fwd)  # forward + 2x backward
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)
    print(f"{args.size} Llama ({sum(p.numel() for p in probe.compiled.model.parameters()) / 1e9:.2f}B params) on "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'the CPU'}, batch {size['batch']}x"
          f"{size['seq']}, {'bf16 autocast' if autocast else 'fp32'}", flush=True)  # fmt: skip
    row("Hugging Face, eager", timed(hf_step(build(size, device), autocast, device), data, device), tokens, flops, peak)
    compiled_hf = torch.compile(build(size, device), backend=args.backend)
    row("Hugging Face, torch.compile", timed(hf_step(compiled_hf, autocast, device), data, device), tokens, flops, peak)
    plan = {"autocast": autocast} if autocast else {}
    for label, options in (("eager", {}), (f"torch_compile ({args.backend})", {"backend": args.backend})):
        program = program_for(build(size, device), data[0], plan, **options)
        step = timed(lambda ids, p=program: p.step(ids, labels=ids), data, device)
        extra = f"compile {program.compile_seconds:.1f} s" if program.compile_seconds is not None else ""
        row(f"autoshard dp=1, {label}", step, tokens, flops, peak, extra)
    memory(size, device, data, plan)


def memory(size: dict[str, int], device: torch.device, data: list[torch.Tensor], plan: dict[str, Any]) -> None:
    """Peak bytes a ZeRO step allocates on the device (offload: masters and optimizer state on the host)."""
    for zero in (1, 2, 3):
        model = build(size, device)
        params = sum(p.numel() for p in model.parameters())
        program = program_for(model, data[0], {**plan, "zero": zero, "offload": True})
        program.step(data[0], labels=data[0])  # warm: the optimizer's state exists
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            program.step(data[1], labels=data[1])
            measured = torch.cuda.max_memory_allocated(device)
            what, formula = "peak allocated on the device", None
        else:  # the CPU has no allocator statistics: what the holder keeps on the device in a step
            program.step(data[1], labels=data[1])
            measured = program.last_step_memory["parameters"] + program.last_step_memory["gradients"]
            what, formula = "parameters + gradients held", 2 * 4 * params
        # With offload, the device keeps the fp32 parameters and gradients (2 x 4 bytes a parameter); the host
        # keeps fp32 masters and Adam's two moments (12 bytes a parameter): Rajbhandari et al.'s K = 12.
        held = program.last_step_memory
        activations = int(program.cost.evaluate(B=size["batch"], S=size["seq"]).activation_bytes)
        formula = formula or 2 * 4 * params + activations
        host = held.get("optimizer", 0)
        host_note = f"host: optimizer {host / 2**20:.1f} MiB vs 12 B/param {12 * params / 2**20:.1f} MiB"
        ROWS.append((f"ZeRO-{zero} + offload, one rank: {what}", f"{measured / 2**20:.1f} MiB",
                     f"formula {formula / 2**20:.1f} MiB", f"{measured / formula:.3f}", host_note))  # fmt: skip
        print(ROWS[-1], flush=True)


def _equivalence(rank: int, world: int, size_name: str, backend: str, steps: int) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    size = SIZES[size_name]
    data = batches(size, device, steps)
    local = size["batch"] // world
    program = autoshard.compile(
        build(size, device), autoshard.Mesh(dp=world), (data[0],), {"labels": data[0], "use_cache": False},
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), torch_compile=True, backend=backend,
    )  # fmt: skip
    losses = []
    for ids in data:
        mine = ids[rank * local : (rank + 1) * local]
        losses.append(program.step(mine, labels=mine))
    state = program.full_state_dict()
    ref = build(size, device)
    step = hf_step(ref, None, device)
    ref_losses = []
    for ids in data:
        with torch.no_grad():
            ref_losses.append(ref(ids, labels=ids, use_cache=False).loss.item())
        step(ids)
    worst = max(((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()), default=0.0) if state else 0
    return {"losses": losses, "ref": ref_losses, "worst": worst}


def several(args: argparse.Namespace, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    with LocalRanks(args.ranks, backend=backend) as pool:
        result = pool.run(_equivalence, args.size, args.backend, 3)[0]
    gap = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], result["ref"]))
    ROWS.append((f"dp={args.ranks} torch_compile on {backend} vs one device: losses, parameters",
                 f"loss rel. gap {gap:.2e}", f"max |param diff| {result['worst']:.2e}", "", ""))  # fmt: skip
    print(ROWS[-1], flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 1b on cuda, tiny on cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU")
    parser.add_argument("--ranks", type=int, default=None, help="dp ranks for the NCCL checks (0: skip)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device; pass --device cpu")
    args.size = args.size or ("1b" if device.type == "cuda" else "tiny")
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.device_count() > 1 else 0
    # One rank in a process group of its own: ZeRO's holders (and NCCL) run their collectives on it.
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)  # fmt: skip
    try:
        single_device(args, device)
    finally:
        dist.destroy_process_group()
    if args.ranks > 1:
        several(args, device)
    print(f"\n{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    print("| run | step | tokens/s | MFU or ratio | notes |\n|---|---|---|---|---|")
    for cells in ROWS:
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
