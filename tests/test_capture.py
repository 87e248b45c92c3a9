"""Capture: model and loss as one graph, dynamic batch, offline programs (tier 1/2)."""

from __future__ import annotations

import time

import pytest
import torch
from cases import build_case

import autoshard
from autoshard.capture import capture


def test_graph_takes_flat_tensors_and_returns_loss_first() -> None:
    case = build_case("gpt2")
    batch = case.batches[0]
    captured = capture(case.model, batch.inputs, batch.kwargs)
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2  # input_ids, labels; use_cache=False is baked in
    assert captured.call.const_kwargs == {"use_cache": False}
    assert captured.example_sizes == {"B": 8, "S": 12}
    loss, output_loss, logits = captured.gm(*batch.inputs, batch.kwargs["labels"])  # output: .loss, .logits
    eager = case.model(*batch.inputs, **batch.kwargs)
    torch.testing.assert_close(loss, eager.loss)
    torch.testing.assert_close(output_loss, eager.loss)
    torch.testing.assert_close(logits, eager.logits)


def test_parameters_keep_their_names_and_ties() -> None:
    case = build_case("gpt2")
    captured = capture(case.model, case.batches[0].inputs, case.batches[0].kwargs)
    targets = {n.target for n in captured.gm.graph.nodes if n.op == "get_attr"}
    assert "model.transformer.h.0.attn.c_attn.weight" in targets
    gm = captured.gm
    assert gm.get_parameter("model.lm_head.weight") is gm.get_parameter("model.transformer.wte.weight")


@pytest.mark.parametrize("family", ["mlp", "gpt2", "llama", "bert"])
def test_captured_graph_runs_any_batch_and_sequence(family: str) -> None:
    case = build_case(family)
    batch = case.batches[0]
    program = autoshard.compile(
        case.model, 1, batch.inputs, batch.kwargs, loss_fn=case.loss_fn, example_target=batch.target
    )
    for rows in (1, 3, 8):
        inputs = tuple(x[:rows] for x in batch.inputs)
        kwargs = {k: v[:rows] for k, v in batch.kwargs.items() if isinstance(v, torch.Tensor)}
        if family != "mlp":  # a shorter sequence too
            inputs = tuple(x[:, :7].contiguous() for x in inputs)
            kwargs = {k: v[:, :7].contiguous() for k, v in kwargs.items()}
        out = program(*inputs, **kwargs)
        eager = case.model(*inputs, **kwargs, **{k: v for k, v in batch.kwargs.items() if k == "use_cache"})
        if family == "mlp":
            torch.testing.assert_close(out, eager)
        else:
            torch.testing.assert_close(out.logits, eager.logits)
            torch.testing.assert_close(out.loss, eager.loss)


def test_forward_only_returns_the_models_output_type() -> None:
    case = build_case("gpt2")
    batch = case.batches[0]
    program = autoshard.compile(case.model, 1, batch.inputs, batch.kwargs)
    out = program(batch.inputs[0], labels=batch.kwargs["labels"])
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    torch.testing.assert_close(out.loss, case.model(*batch.inputs, **batch.kwargs).loss)


def test_batch_of_one_still_captures_a_dynamic_batch() -> None:
    case = build_case("mlp")
    x, y = case.batches[0].inputs[0][:1], case.batches[0].target[:1]
    program = autoshard.compile(case.model, 1, (x,), loss_fn=case.loss_fn, example_target=y)
    assert program.cost.symbols == ("B",)
    torch.testing.assert_close(program(case.batches[0].inputs[0]), case.model(case.batches[0].inputs[0]))


def test_meta_llama_7b_plans_without_weights() -> None:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32000, (64, 2048))
    start = time.perf_counter()
    program = autoshard.compile(model, 64, (ids,), {"labels": ids, "use_cache": False})
    assert time.perf_counter() - start > 0  # no timing assertion: see bench/ for the number
    assert 6.7e9 < program.cost.param_bytes / 4 < 6.8e9
    # 16 bytes a parameter do not fit 80 GiB unsharded: the planner shards the model states (ZeRO, pp or tp).
    plan = program.plan
    assert program.plan_report.chosen.fits and plan.mesh.size == 64 and (plan.zero > 0 or plan.pp > 1 or plan.tp > 1)
    with pytest.raises(autoshard.DistributedError, match="the model is on the meta device"):
        program.step(ids[:1], labels=ids[:1])


def test_a_dropped_program_is_freed() -> None:
    import gc
    import weakref

    case = build_case("gpt2")
    batch = case.batches[0]
    program = autoshard.compile(case.model, 1, batch.inputs, batch.kwargs, optimizer=torch.optim.SGD)
    program.step(*batch.inputs, labels=batch.kwargs["labels"])
    trainer = weakref.ref(program.runtime.holder)
    del program
    gc.collect()
    assert trainer() is None  # gradient hooks on the model's parameters do not keep it alive
