"""Tensor-parallel training of a small GPT with autoshard, one process per rank.

    torchrun --nproc-per-node 4 examples/train_tp.py --tp 2 --sequence-parallel
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 3 \
        examples/train_tp.py --tp 2 --checkpoint-dir ckpt

The mesh is dp x tp = world size. autoshard finds Megatron's layout on its own: the fused QKV and the
first MLP linear column-parallel, the attention output and second MLP linear row-parallel, the tied
embedding and LM head vocab-parallel with a vocab-parallel cross-entropy. Rank 0 prints the plan and
each weight's placement; every rank holds 1/tp of each sharded weight.

With --checkpoint-dir it saves every --every steps and resumes from the latest checkpoint there
by itself when started again (by torchrun after a rank failed, or by hand).
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
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (ranks per model replica)")
    parser.add_argument("--sequence-parallel", action="store_true", help="norms and dropout on sequence shards")
    add_loop_args(parser)
    args = parser.parse_args()

    device = init_from_torchrun()  # NCCL and cuda:LOCAL_RANK with GPUs, gloo on CPU
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    torch.manual_seed(0)
    model = TinyGPT().to(device)

    global_batch = batches(args, device)
    ids, target = global_batch(0)
    program = autoshard.compile(
        model,
        autoshard.Mesh(dp=world // args.tp, tp=args.tp),
        example_inputs=(ids,),
        loss_fn=next_token_loss,
        example_target=target,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        plan={"sequence_parallel": args.sequence_parallel},
    )
    if dist.get_rank() == 0:
        text = program.explain()
        print(text.split("\n\ncandidates:")[0], flush=True)
        print(text[text.index("tensor parallel (") : text.index("\n\npasses:")], flush=True)
    state = train(program, global_batch, args)
    if dist.get_rank() == 0:
        print(f"trained {len(state)} tensors, sharded over tp={args.tp}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
