"""The rule of thumb, as the cost model arrives at it on real model configurations (meta device, vendor
hardware figures): nothing here tells the planner which strategy a scenario wants.

    fits one device                   -> plain data parallelism
    one device, does not fit          -> ZeRO with offload
    one node, does not fit            -> ZeRO, pp or tp
    the largest layer does not fit    -> tp or ZeRO-3 (pp cannot split a layer)
    many nodes, fast links            -> ZeRO, or pp + tp + dp
    slow inter-node links             -> dp + tp + pp with ZeRO-1
"""

from __future__ import annotations

import re

import pytest
import torch

import autoshard

A100 = autoshard.Hardware.preset("a100-80gb")
H100 = autoshard.Hardware.preset("h100-80gb")


def llama(layers: int, hidden: int, heads: int, mlp: int, vocab: int = 32000) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def gpt2(layers: int, hidden: int, heads: int, vocab: int = 50257) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=1024)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def plan(model, world, rows, seq, hardware, **kw):
    ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    return autoshard.plan(model, world, (ids,), {"labels": ids, "use_cache": False}, hardware=hardware, **kw)


@pytest.fixture(scope="module")
def wide_llama():
    """Four blocks of a 70B-class width (hidden 8192, 64 heads, MLP 28672): 4.4B parameters."""
    return llama(4, 8192, 64, 28672)


@pytest.fixture(scope="module")
def big_llama():
    """Six such blocks: 6.3B parameters, 101 GB of fp32 weights, gradients and Adam state (Llama-2-7B's size)."""
    return llama(6, 8192, 64, 28672)


def test_a_model_that_fits_one_device_trains_plain_data_parallel() -> None:
    report = plan(gpt2(12, 768, 12), 8, 64, 1024, A100)
    assert report.winner == autoshard.Plan(dp=8)
    assert "with plain data parallelism" in report.reason


def test_one_device_that_does_not_fit_offloads_the_optimizer(big_llama) -> None:
    report = plan(big_llama, 1, 1, 2048, A100)
    assert report.winner.zero >= 1 and report.winner.offload
    assert report.chosen.fits and report.chosen.memory.optimizer == 0  # Adam's moments live on the host


def test_one_node_that_does_not_fit_shards_the_model_states(big_llama) -> None:
    report = plan(big_llama, 8, 8, 2048, A100)
    plain = next(c for c in report if c.plan.zero == 0 and (c.plan.tp, c.plan.pp) == (1, 1))
    assert not plain.fits
    winner = report.winner
    assert report.chosen.fits and (winner.zero > 0 or winner.pp > 1 or winner.tp > 1)


def test_a_layer_larger_than_a_device_is_split_by_tp_or_zero3() -> None:
    # A 3M-token vocabulary: embedding and head 49 GB each in fp32, so one of them with its gradient is past
    # a device (80 GB) however ZeRO-1 or 2 shard the rest, and pipeline stages cannot split a layer. (At 1.5M
    # a pipeline with ZeRO-1 fits: 24.6 GB each, the embedding on the first stage, the head on the last.)
    report = plan(llama(2, 4096, 32, 11008, vocab=3_000_000), 8, 8, 512, A100)
    pipelines_only = [c for c in report if c.plan.tp == 1 and c.plan.zero < 3]
    assert not any(c.fits for c in pipelines_only)
    assert report.chosen.fits and (report.winner.tp > 1 or report.winner.zero == 3)


def test_many_nodes_with_fast_links_use_zero_or_three_dimensions(wide_llama) -> None:
    report = plan(wide_llama, 64, 64, 2048, H100, plan={"param_dtype": torch.bfloat16})
    w = report.winner
    assert report.chosen.fits
    assert w.zero > 0 or (w.dp > 1 and w.tp > 1 and w.pp > 1)


def test_slow_inter_node_links_take_dp_tp_and_pp_with_zero_1(wide_llama) -> None:
    slow = H100.with_(name="H100, 2.5 GB/s between nodes", inter_bandwidth=H100.inter_bandwidth / 20)
    report = plan(wide_llama, 64, 64, 2048, slow, plan={"param_dtype": torch.bfloat16})
    w = report.winner
    assert report.chosen.fits and w.dp > 1 and w.tp > 1 and w.pp > 1 and w.zero == 1
    assert w.tp <= slow.devices_per_node  # tensor parallelism stays inside a node


def test_no_world_size_that_fits_names_the_smallest_memory_and_the_fixes(big_llama) -> None:
    small = A100.with_(name="A100 16GB", memory_bytes=16 * 2**30)
    with pytest.raises(autoshard.PlanError) as info:
        plan(big_llama, 2, 2, 4096, small)
    message = str(info.value)
    assert re.search(r"no plan for 2 fits 16\.00 GiB per rank on A100 16GB: the smallest found, Plan\(.*\), needs "
                     r"\d+\.\d+ GiB per rank \(weights [\d.]+ GiB, .*activations", message)  # fmt: skip
    assert "x the ranks" in message and "a smaller batch" in message


def test_a_pipeline_whose_bubble_matters_takes_a_zero_bubble_schedule(wide_llama) -> None:
    """Slow links keep dp small and the pipeline deep enough that its bubble shows: W fills it."""
    slow = H100.with_(name="H100, 2.5 GB/s between nodes", inter_bandwidth=H100.inter_bandwidth / 20)
    fields = {"param_dtype": torch.bfloat16, "pp": 2, "tp": 8}
    report = plan(wide_llama, 64, 64, 2048, slow, plan=fields)
    assert report.chosen.fits and report.winner.schedule in ("zb_h1", "zb_h2", "zbv")
    one_f_one_b = plan(wide_llama, 64, 64, 2048, slow, plan={**fields, "schedule": "1f1b"})
    assert report.chosen.step_time < one_f_one_b.chosen.step_time
    assert report.chosen.time.bubble < one_f_one_b.chosen.time.bubble


def mixtral(layers: int, experts: int) -> torch.nn.Module:
    """Mixtral-8x7B's widths (hidden 4096, 32 heads over 8 KV heads, experts of MLP 14336, top 2)."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=experts, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def test_a_mixture_of_experts_splits_its_experts_inside_a_node() -> None:
    """Mixtral-8x7B-shaped on 64 H100s: replicated experts cost every rank all of their gradients' traffic;
    ep spreads them over the fast links of a node."""
    chosen = plan(mixtral(4, 8), 64, 256, 4096, H100).winner
    assert chosen.ep > 1 and chosen.ep * chosen.tp <= H100.devices_per_node, chosen


@pytest.mark.slow  # long (15-35 s): under -m slow
def test_expert_parallelism_crosses_nodes_only_over_fast_links() -> None:
    """32 experts: with the preset's inter-node links ep spans nodes (a rank holds fewer experts); with those
    links 20x slower the all-to-alls keep inside a node (the winner there splits the experts over tp = 8 inside
    a node instead, ep = 1, 5% ahead of ep = 8 inside a node; either keeps them in)."""
    model = mixtral(4, 32)
    fast = plan(model, 64, 256, 4096, H100).winner
    slow = plan(model, 64, 256, 4096, H100.with_(inter_bandwidth=H100.inter_bandwidth / 20))
    assert fast.ep * fast.tp > H100.devices_per_node, fast
    assert slow.winner.ep * slow.winner.tp <= H100.devices_per_node, slow.winner
    expert_plans = [c.plan for c in slow.candidates if c.plan.ep > 1]  # the best of those that use ep at all
    assert expert_plans and expert_plans[0].ep * expert_plans[0].tp <= H100.devices_per_node, expert_plans[:3]


@pytest.mark.slow  # 16 s: capture and search at 128k tokens
def test_long_sequences_split_over_context_parallel_ranks() -> None:
    """A Llama-3-8B-shaped model (GQA, 32 blocks) at sequences of 128k tokens on 64 H100s: a rank cannot keep a
    whole sequence's activations, and splitting it over cp ranks (a ring per attention) beats splitting the
    weights; the planner picks cp >= 4."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = plan(model, 64, 8, 131072, H100, plan={"param_dtype": torch.bfloat16})
    assert report.winner.cp >= 4, report.table()
    assert report.chosen.time.cp_comm > 0 and report.chosen.fits


def test_a_long_sequence_is_planned_over_cp_and_a_short_one_is_not() -> None:
    """The search tries cp where each rank keeps at least 2 x 512 tokens of a sequence: at 32k tokens, four
    sequences on 16 ranks split each over cp (activations and attention both 1/cp a rank, the ring's sends
    counted); at 512 tokens no cp is tried."""
    model = llama(2, 2048, 16, 5632)
    report = plan(model, 16, 4, 32768, H100)
    assert any(c.plan.cp > 1 for c in report.candidates)
    best_cp = min((c for c in report.candidates if c.plan.cp > 1), key=lambda c: c.step_time)
    assert best_cp.time.cp_comm > 0
    short = plan(model, 16, 16, 512, H100)
    assert all(c.plan.cp == 1 for c in short.candidates)
