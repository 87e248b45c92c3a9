"""Data-parallel training of a small GPT with autoshard, one process per rank.

    torchrun --nproc-per-node 4 examples/train_dp.py --steps 20

gloo on CPU, NCCL when every rank has a GPU (autoshard.launch.init_from_torchrun). Each rank builds
the same model (same seed), autoshard.compile captures and plans it, and program.step trains on this
rank's slice of the batch.
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
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    device = init_from_torchrun()  # NCCL and cuda:LOCAL_RANK with GPUs, gloo on CPU

    torch.manual_seed(0)
    model = TinyGPT().to(device)
    gen = torch.Generator().manual_seed(1)  # every rank draws the same global batches

    def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    ids, target = global_batch()
    program = autoshard.compile(
        model,
        dist.get_world_size(),
        example_inputs=(ids,),
        loss_fn=next_token_loss,
        example_target=target,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
    if dist.get_rank() == 0:
        print(program.explain().split("\n\ncandidates:")[0], flush=True)
    for step in range(args.steps):
        loss = program.step(program.local_batch(ids), target=program.local_batch(target))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
        ids, target = global_batch()
    state = program.full_state_dict()
    if dist.get_rank() == 0:
        print(f"trained {len(state)} tensors, e.g. blocks.0.fc.weight {tuple(state['blocks.0.fc.weight'].shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
