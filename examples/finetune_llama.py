"""Fine-tune a small Llama with ZeRO-3 and full activation recomputation, one process per rank.

    torchrun --nproc-per-node 4 examples/finetune_llama.py --steps 30

Every rank holds 1/dp of the parameters, gradients and optimizer state (ZeRO-3 gathers each layer's
weights when it runs), and each decoder layer keeps only its input for backward and recomputes the
rest. The task: every token is followed by its successor in a fixed permutation (the demo's task),
the labels are the inputs (Hugging Face shifts them), so the loss falls from ln(256) = 5.55 within
a few dozen steps. Rank 0 prints each loss and, at the end, the single-device loss of the same steps.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

import autoshard
from autoshard.demo import successor_batch
from autoshard.launch import init_from_torchrun


def build_llama() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def single_device(steps: int, batch: int, seq: int) -> list[float]:
    model, losses = build_llama(), []
    opt = optimizer(model.parameters())
    for step in range(steps):
        ids, _ = successor_batch(step, batch, seq)
        opt.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    device = init_from_torchrun()
    model = build_llama().to(device)
    ids, _ = successor_batch(0, args.batch, args.seq)
    program = autoshard.compile(
        model,
        autoshard.Mesh(dp=dist.get_world_size()),
        example_inputs=(ids.to(device),),
        example_kwargs={"labels": ids.to(device), "use_cache": False},
        optimizer=optimizer,
        plan={"zero": 3, "recompute": "full"},
    )
    rank = dist.get_rank()
    if rank == 0:
        print(f"plan: {program.plan}", flush=True)
    losses = []
    for step in range(args.steps):
        ids, _ = successor_batch(step, args.batch, args.seq)
        local = program.local_batch(ids.to(device))
        losses.append(program.step(local, labels=local))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]!r}", flush=True)
    if rank == 0:
        reference = single_device(args.steps, args.batch, args.seq)
        print(f"{'step':>4}  {'autoshard':>10}  {'single device':>13}")
        for step, (mine, ref) in enumerate(zip(losses, reference)):
            print(f"{step:>4}  {mine:>10.5f}  {ref:>13.5f}")
        print(f"largest loss difference {max(abs(a - b) for a, b in zip(losses, reference)):.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
