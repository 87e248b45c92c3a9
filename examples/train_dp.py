"""Data-parallel training of a small GPT with autoshard, one process per rank.

    torchrun --nproc-per-node 4 examples/train_dp.py --steps 20
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 3 \
        examples/train_dp.py --steps 20 --checkpoint-dir ckpt

With --checkpoint-dir it saves every --every steps and, started again (by torchrun after a rank
failed, or by hand), resumes from the latest complete checkpoint there by itself.

gloo on CPU, NCCL when every rank has a GPU (autoshard.launch.init_from_torchrun). Each rank builds
the same model (same seed), autoshard.compile captures and plans it, and program.step trains on this
rank's slice of the batch (the loop is in training_loop.py, shared by the examples).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from training_loop import add_loop_args, batches, train

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import init_from_torchrun


def main() -> None:
    parser = argparse.ArgumentParser()
    add_loop_args(parser)
    args = parser.parse_args()

    device = init_from_torchrun()  # NCCL and cuda:LOCAL_RANK with GPUs, gloo on CPU

    torch.manual_seed(0)
    model = TinyGPT().to(device)

    global_batch = batches(args, device)
    ids, target = global_batch(0)
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
    state = train(program, global_batch, args)
    if dist.get_rank() == 0:
        print(f"trained {len(state)} tensors, e.g. blocks.0.fc.weight {tuple(state['blocks.0.fc.weight'].shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
