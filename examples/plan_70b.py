"""Plan Llama-2-70B for 1024 GPUs offline and write the HTML report: no GPU, no weights, no process group.

    python examples/plan_70b.py --world 1024 --hardware h100-80gb --report llama70b-1024.html

The model is built on the meta device from its published configuration (80 layers, hidden 8192, 64
heads with 8 KV heads, MLP 28672, vocabulary 32000), captured and costed at a global batch of
--batch sequences of --seq tokens; the planner ranks every dp x tp x pp factorization of 1024 with
each ZeRO stage, and the page shows the candidates, the predicted memory per rank and the pipeline
schedule, and each stage's rewritten graph. --layers builds fewer layers for a quick look.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import autoshard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--hardware", default="h100-80gb")
    parser.add_argument("--batch", type=int, default=1024, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--report", default="llama70b-1024.html")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=args.layers, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=args.seq,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    start = time.perf_counter()
    program = autoshard.compile(
        model, args.world, example_inputs=(ids,), example_kwargs={"labels": ids, "use_cache": False},
        hardware=autoshard.Hardware.preset(args.hardware),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    chosen = program.plan_report.chosen
    params = sum(p.numel() for p in model.parameters())
    print(f"Llama-2-70B shape, {args.layers} layers, {params / 1e9:.2f}B parameters, on {args.world} x {args.hardware}")
    print(f"planned in {seconds:.1f} s: {program.plan}")
    print(f"predicted: {chosen.memory.total / 2**30:.1f} GiB per rank, {chosen.step_time:.3f} s per step, "
          f"MFU {chosen.mfu:.1%}; {chosen.why}")  # fmt: skip
    print(program.plan_report.table(top=5))
    print(f"report: {program.report(args.report)}")


if __name__ == "__main__":
    main()
