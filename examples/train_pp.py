"""Pipeline-parallel training of a small GPT with autoshard, one process per rank.

    torchrun --nproc-per-node 4 examples/train_pp.py --pp 2 --schedule 1f1b --microbatches 4

The mesh is dp x pp = world size. autoshard cuts the model into pp stages of balanced cost, each
rank runs its stage's graph in the schedule's order, and activations and their gradients travel
between neighbouring ranks. Rank 0 prints the plan, the stages and the schedule as a table.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import init_from_torchrun


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks per pipeline)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    device = init_from_torchrun()  # NCCL and cuda:LOCAL_RANK with GPUs, gloo on CPU
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide the world size {world}")
    torch.manual_seed(0)
    virtual = 2 if args.schedule == "interleaved_1f1b" else 1
    model = TinyGPT(layers=2 * args.pp * virtual).to(device)
    gen = torch.Generator().manual_seed(1)  # every rank draws the same global batches

    def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    ids, target = global_batch()
    program = autoshard.compile(
        model,
        autoshard.Mesh(dp=world // args.pp, pp=args.pp),
        example_inputs=(ids,),
        loss_fn=next_token_loss,
        example_target=target,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        plan={"schedule": args.schedule, "microbatches": args.microbatches, "virtual_stages": virtual},
    )
    if dist.get_rank() == 0:
        text = program.explain()
        print(text.split("\n\ncandidates:")[0], flush=True)
        print(text[text.index("pipeline stages:") : text.index("\n\npasses:")], flush=True)
    for step in range(args.steps):
        loss = program.step(program.local_batch(ids), target=program.local_batch(target))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
        ids, target = global_batch()
    state = program.full_state_dict()  # gathered from every stage onto rank 0
    if dist.get_rank() == 0:
        print(f"trained {len(state)} tensors across {args.pp} stages")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
