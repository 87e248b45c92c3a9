"""Data-parallel training of a small GPT with autoshard, one process per rank.

    torchrun --nproc-per-node 4 examples/train_dp.py --steps 20
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train_dp.py --steps 20 --checkpoint-dir ckpt

With --checkpoint-dir it saves every --every steps and, started again (by torchrun after a rank
failed, or by hand), resumes from the latest complete checkpoint there by itself.

gloo on CPU, NCCL when every rank has a GPU (autoshard.launch.init_from_torchrun). Each rank builds
the same model (same seed), autoshard.compile captures and plans it, and program.step trains on this
rank's slice of the batch.
"""

from __future__ import annotations

import argparse
import os

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
    parser.add_argument("--checkpoint-dir", help="save here every --every steps; resume from the latest")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--fail-at-step", type=int, help="(testing) rank 1 exits there on the first attempt")
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
    first = 0
    latest = autoshard.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if latest is not None:
        first = program.load(latest)["next_step"]
        for _ in range(first):  # the data stream continues where the checkpoint left it
            ids, target = global_batch()
        if dist.get_rank() == 0:
            print(f"resumed from {latest} at step {first}", flush=True)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(first, args.steps):
        if step == args.fail_at_step and restarts == 0 and dist.get_rank() == 1:
            os._exit(1)  # a rank fails; torchrun --max-restarts starts the job again
        loss = program.step(program.local_batch(ids), target=program.local_batch(target))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss!r}", flush=True)
        ids, target = global_batch()
        if args.checkpoint_dir and (step + 1) % args.every == 0:
            program.save(f"{args.checkpoint_dir}/step-{step + 1}", extra={"next_step": step + 1})
    state = program.full_state_dict()
    if dist.get_rank() == 0:
        print(f"trained {len(state)} tensors, e.g. blocks.0.fc.weight {tuple(state['blocks.0.fc.weight'].shape)}")
        print(f"parameter sum {sum(float(v.double().sum()) for v in state.values())!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
