"""autoshard benchmarks: each line is a ratio measured side by side in one run.

    python bench/run.py            # all benchmarks
    python bench/run.py --only capture

Not a test: nothing here asserts a duration. Numbers depend on the machine; the ratios are the point.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import LocalRanks

RESULTS: list[tuple[str, str, str, float, str]] = []


def report(name: str, ours: str, theirs: str, ratio: float, target: str) -> None:
    RESULTS.append((name, ours, theirs, ratio, target))
    print(f"{name}: autoshard {ours} | reference {theirs} | ratio {ratio:.3f} (target {target})", flush=True)


def bench_capture_llama_7b() -> None:
    """Capture + analysis of Llama-2-7B on the meta device (no weights allocated)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32000, (64, 4096))
    start = time.perf_counter()
    program = autoshard.compile(model, 64, (ids,), {"labels": ids, "use_cache": False})
    seconds = time.perf_counter() - start
    nodes = len(program.graph_modules[0].graph.nodes)
    report(
        f"compile Llama-2-7B on meta ({nodes} nodes, {program.cost.param_bytes / 4 / 1e9:.2f}B params)",
        f"{seconds:.1f} s",
        "30 s budget",
        seconds / 30.0,
        "< 1.0",
    )


def _ddp_vs_autoshard(rank: int, world_size: int, cfg: dict[str, int], steps: int, rounds: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(rank)
        local = cfg["batch"] // world_size
        out = []
        for _ in range(n):
            tokens = torch.randint(0, cfg["vocab"], (local, cfg["seq"] + 1), generator=gen)
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        return out

    def model() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"], layers=cfg["layers"], max_seq=cfg["seq"])

    data = batches(steps)
    global_ids = torch.cat([data[0][0]] * world_size)
    global_target = torch.cat([data[0][1]] * world_size)
    program = autoshard.compile(
        model(),
        autoshard.Mesh(dp=world_size),
        example_inputs=(global_ids,),
        loss_fn=next_token_loss,
        example_target=global_target,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    ddp = DistributedDataParallel(model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def ddp_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        ddp_opt.zero_grad(set_to_none=True)
        loss = next_token_loss(ddp(ids), target)
        loss.backward()
        ddp_opt.step()

    def autoshard_step(ids: torch.Tensor, target: torch.Tensor) -> None:
        program.step(ids, target=target)

    timings: dict[str, list[float]] = {"autoshard": [], "ddp": []}
    for fn in (autoshard_step, ddp_step):  # warm-up
        for ids, target in data[:2]:
            fn(ids, target)
    for _ in range(rounds):  # alternate, so drift hits both alike
        for name, fn in (("autoshard", autoshard_step), ("ddp", ddp_step)):
            torch.distributed.barrier()
            start = time.perf_counter()
            for ids, target in data:
                fn(ids, target)
            torch.distributed.barrier()
            timings[name].append((time.perf_counter() - start) / len(data))
    return timings


def bench_dp_vs_ddp(ranks: int = 4) -> None:
    cfg = {"vocab": 4096, "dim": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16}
    with LocalRanks(ranks) as pool:
        timings = pool.run(_ddp_vs_autoshard, cfg, steps=5, rounds=4)[0]
    ours, theirs = statistics.median(timings["autoshard"]), statistics.median(timings["ddp"])
    params = sum(
        p.numel() for p in TinyGPT(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], cfg["seq"]).parameters()
    )
    report(
        f"dp={ranks} step, GPT {params / 1e6:.1f}M params, batch {cfg['batch']}x{cfg['seq']} (gloo, CPU)",
        f"{ours * 1e3:.1f} ms",
        f"DDP {theirs * 1e3:.1f} ms",
        ours / theirs,
        "<= 1.05",
    )


BENCHMARKS = {"capture": bench_capture_llama_7b, "dp": bench_dp_vs_ddp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    args = parser.parse_args()
    for name in args.only or list(BENCHMARKS):
        BENCHMARKS[name]()
    print("\n| benchmark | autoshard | reference | ratio | target |\n|---|---|---|---|---|")
    for name, ours, theirs, ratio, target in RESULTS:
        print(f"| {name} | {ours} | {theirs} | {ratio:.3f} | {target} |")


if __name__ == "__main__":
    main()
