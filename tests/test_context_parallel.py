"""Context parallelism: each cp rank computes on its share of every sequence; training equals one device's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from cases import build_case, compile_case, train_plan, train_single_device
from checkpoint_cases import load_and_train, train_and_save
from compiled_cases import train_compiled
from context_cases import kept_against_accounting, pooled_gpt_cp, ring_against_sdpa, tiny_gpt_cp
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tp import assert_state_close

import autoshard
from autoshard.errors import InputError, PlanError
from autoshard.graph_ops import context

SEQ = {"gpt2": 256, "llama": 256, "bert": 256}


@functools.cache
def reference(family: str, **shape) -> tuple[list[float], dict]:
    return train_single_device(family, **shape)


def shape_of(family: str, seq: int | None = None) -> dict:
    seq = seq or SEQ[family]
    return {"seq": seq, "positions": seq}


def run_cp(ranks, family: str, mesh: dict, plan: dict, seq: int | None = None, **extra) -> list[dict]:
    shape = {**shape_of(family, seq), **extra}
    world = mesh.get("dp", 1) * mesh.get("cp", 1) * mesh.get("pp", 1) * mesh.get("tp", 1)
    results = ranks(world).run(train_plan, family, mesh, plan, **shape)
    ref_losses, ref_state = reference(family, max_grad_norm=plan.get("max_grad_norm"), **shape)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(results[0]["state"], ref_state)  # consolidated on rank 0
    return results


def test_chunk_positions_balance_causal_work() -> None:
    """Rank i holds chunks i and 2N-1-i of 2N: every rank the same number of (query, earlier key) pairs."""
    seq, degree = 32, 4
    held = [context.chunk_positions(seq, r, degree) for r in range(degree)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq))
    assert torch.equal(held[1], torch.tensor([4, 5, 6, 7, 24, 25, 26, 27]))
    work = [int((pos + 1).sum()) for pos in held]
    assert len(set(work)) == 1
    with pytest.raises(InputError, match="multiple of 8"):
        context.chunk_positions(36, 0, degree)


@pytest.mark.parametrize(("world", "fused"), [(2, True), (4, True), (2, False)], ids=["cp2", "cp4", "cp2-formulas"])
def test_ring_attention_equals_sdpa(ranks, world, fused) -> None:
    """Ring attention of each rank's tokens, forward and backward, against SDPA over the whole sequence in
    float64: causal, grouped-query (1 and 2 K/V heads for 4), padding, random, additive and causal masks; with
    the CPU's fused kernel a block and with the formulas other devices run."""
    cases = [
        {"heads": 4, "kv_heads": 4, "seq": 32, "mask": "causal", "causal": False},
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": None, "causal": True},
        {"heads": 4, "kv_heads": 2, "seq": 16, "mask": None, "causal": True},
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": "padding", "causal": False},
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": "random", "causal": False},
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": "additive", "causal": True},
        {"heads": 4, "kv_heads": 1, "seq": 32, "mask": "padding", "causal": True},
    ]
    for rank_result in ranks(world).run(ring_against_sdpa, cases, fused):
        for case, diffs in zip(cases, rank_result):
            for name in ("out", "dq", "dk", "dv"):
                assert diffs[name] < 1e-12, (case, name, diffs)
            # K and V go round once forward (cp - 1 hops), backward starts on the last block forward brought
            # and ends on its own (cp - 2), and their gradients follow them home (cp - 1; only K/V heads)
            block = 2 * case["kv_heads"] * (case["seq"] // world) * 8 * 8
            assert diffs["ring_bytes"] == 2 * block * (3 * world - 4), case


@pytest.mark.parametrize("attention", ["ring", "all_to_all"])
def test_what_a_cp_rank_keeps_is_what_its_accounting_says(ranks, attention) -> None:
    """The bytes a rank's forward saves for backward (autograd's saved tensors) against passes.saved_tensors'
    accounting of its graph: ring attention keeps, besides SDPA's saves, the K/V block its forward ended on,
    where its backward starts; its output is token-major, as the fused kernels', so the projection after it keeps
    a view of it; this rank's ids and targets are 1/cp of the sequence (the loss's saves are probed on them)."""
    for result in ranks(2).run(kept_against_accounting, attention, 64):
        assert result["accounted"] == pytest.approx(result["saved"], rel=1e-3), result
        assert not result["unaccounted"], result


@pytest.mark.parametrize(
    ("family", "mesh", "plan", "seq"),
    [
        ("gpt2", {"cp": 2}, {}, 256),
        ("llama", {"cp": 4}, {"zero": 3}, 64),
        ("bert", {"dp": 2, "cp": 2}, {"zero": 1, "recompute": "full"}, 64),
        ("gpt2", {"dp": 2, "cp": 2}, {"zero": 2, "microbatches": 2, "max_grad_norm": 0.5}, 64),
        ("llama", {"cp": 2, "pp": 2}, {"microbatches": 4, "zero": 1, "schedule": "zb_h1"}, 64),
        ("llama", {"dp": 2, "cp": 2}, {"cp_attention": "all_to_all", "zero": 3}, 64),
        ("gpt2", {"cp": 2, "tp": 2}, {"cp_attention": "ring", "sequence_parallel": True}, 64),
    ],
    ids=[
        "gpt2-cp2",
        "llama-cp4-zero3",
        "bert-dp2-cp2-zero1-full",
        "gpt2-dp2-cp2-zero2-accumulate-clip",
        "llama-cp2-pp2-zb_h1-zero1",
        "llama-dp2-cp2-all_to_all-zero3",
        "gpt2-cp2-tp2-sequence_parallel",
    ],
)
def test_cp_trains_as_one_device(ranks, family, mesh, plan, seq) -> None:
    """GPT-2 (learned positions), Llama (rotary, GQA) and BERT (bidirectional) at sequences of 64-256: losses and
    consolidated parameters equal single-device training, over cp alone and with dp, ZeRO, recomputation,
    accumulation, clipping, a zero-bubble pipeline and tp with sequence parallelism (the grid below runs each
    family at 256 tokens, and 1024, under -m slow)."""
    run_cp(ranks, family, mesh, plan, seq)


def test_a_causal_sdpa_model_with_targets_apart(ranks) -> None:
    """TinyGPT: attention by is_causal (the ring's head-tail halves), targets a separate input cut where the loss
    reads them, logits flattened over batch and tokens."""
    for result in ranks(2).run(tiny_gpt_cp, 64):
        assert result["losses"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["worst"] < 3e-6


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_attention_equals_sdpa(ranks, world) -> None:
    """The sequence traded for heads (DeepSpeed Ulysses), forward and backward, against SDPA over the whole
    sequence in float64: causal, grouped-query, padding, random and additive masks; four all-to-alls of q, k, v
    and the output's size each way."""
    cases = [
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": None, "causal": True},
        {"heads": 8, "kv_heads": 4, "seq": 16, "mask": None, "causal": True},
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": "padding", "causal": False},
        {"heads": 4, "kv_heads": 4, "seq": 32, "mask": "random", "causal": False},
        {"heads": 4, "kv_heads": 4, "seq": 16, "mask": "additive", "causal": False},
    ]
    for rank_result in ranks(world).run(ring_against_sdpa, cases, True, "all_to_all"):
        for case, diffs in zip(cases, rank_result):
            for name in ("out", "dq", "dk", "dv"):
                assert diffs[name] < 1e-12, (case, name, diffs)
            q = 2 * case["heads"] * (case["seq"] // world) * 8 * 8
            kv = 2 * case["kv_heads"] * (case["seq"] // world) * 8 * 8
            assert diffs["all_to_all_bytes"] == 2 * (2 * q + 2 * kv) and diffs["ring_bytes"] == 0, case


def test_a_mean_over_tokens_read_nonlinearly_is_all_reduced(ranks) -> None:
    """A loss that squares the mean hidden state over every token: each rank's mean is a partial value, all-reduced
    over cp before the square (its backward in the runtime's units), the loss the global one."""
    for result in ranks(4).run(pooled_gpt_cp, 32, {"dp": 2, "cp": 2}):
        assert result["losses"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["worst"] < 3e-6
        # the mean, and the cross-entropy added to the whole penalty
        assert "2 sum(s) over tokens all-reduced" in result["report"]


CP_GRID = [
    (family, mesh, plan)
    for family in ("gpt2", "llama", "bert")
    for mesh in ({"cp": 2}, {"cp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "pp": 2}, {"cp": 2, "tp": 2})
    for plan in (
        {},
        {"zero": 3},
        {"recompute": "full"},
        {"zero": 1, "recompute": "selective"},
        {"cp_attention": "all_to_all"},
    )
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mesh", "plan"), CP_GRID)
def test_cp_grid(ranks, family, mesh, plan) -> None:
    run_cp(ranks, family, mesh, plan)


@settings(max_examples=2)
@given(st.sampled_from(CP_GRID))
def test_cp_grid_sample(ranks, case) -> None:
    """A drawn sample of the grid above (all of it under -m slow)."""
    run_cp(ranks, *case)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cp_at_a_sequence_of_1024(ranks, family) -> None:
    run_cp(ranks, family, {"cp": 4}, {}, seq=1024)


@pytest.mark.slow  # long (15-35 s): under -m slow
def test_cp_under_torch_compile(ranks) -> None:
    """torch_compile=True (aot_eager): the compiled parts run each rank's tokens, the ring stays eager."""
    shape = shape_of("llama", 64)
    ref_losses, ref_state = reference("llama", **shape)
    results = ranks(2).run(train_compiled, "llama", {"cp": 2}, {}, "aot_eager", **shape)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(results[0]["state"], ref_state)


def test_the_cp_graph_shows_rings_and_local_sizes() -> None:
    """Offline (no process group): every attention is ring attention, the token inputs are cut where they enter,
    the positions' embedding where it meets the tokens, and sharded values carry their local sizes."""
    case = build_case("gpt2", steps=1, **shape_of("gpt2", 32))
    program = compile_case(case, autoshard.Mesh(cp=2), plan={"cp_attention": "ring"})
    gm = program.compiled.captured.gm
    rings = [n for n in gm.graph.nodes if n.target is context.ring_attention]
    assert len(rings) == 2
    report = program.compiled.cp_report
    # the token ids and the positions, where the two embeddings read them
    assert report.inputs == ["view", "unsqueeze"] and len(report.attention) == 2
    assert report.sliced == ["expand_2", "to_4"]  # the mask's rows, the shifted labels
    assert report.loss.startswith("partial over cp")
    layer_norm = next(n for n in gm.graph.nodes if n.name == "layer_norm")
    assert str(layer_norm.meta["autoshard.shape"].tensor.sizes[1]) == "S/2"
    assert "S(1)" in str(layer_norm.meta["autoshard.cp"].out) or layer_norm.meta["autoshard.cp"].out.dim == 1
    assert "cp=2" in str(program.plan)


class RunningMean(torch.nn.Module):
    """Each token's embedding averaged with every token before it: a cumsum over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).cumsum(dim=1)
        return x / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)


@pytest.mark.parametrize(("family", "attention"), [("gpt2", "ring"), ("llama", "all_to_all")])
def test_attention_written_out_is_folded_and_split(ranks, family, attention) -> None:
    """Hugging Face's eager attention (q @ k^T, scale, + mask, softmax, dropout, @ v) folds into one SDPA node,
    which cp splits as it splits the model's own: equal to the eager model on one device."""
    run_cp(ranks, family, {"dp": 2, "cp": 2}, {"cp_attention": attention}, 32, attention="eager")


def test_cp_refuses_what_it_cannot_split() -> None:
    """One clear error before any rank works: a sequence that does not split into 2 x cp chunks, an op that mixes
    tokens (a cumsum over the sequence, named), a mixture of experts' router (no per-token rules for it yet),
    attention dropout under the ring, heads all-to-all cannot split, and cp with ep."""
    with pytest.raises(InputError, match="multiple of 8"):
        compile_case(build_case("gpt2", steps=1, seq=12), autoshard.Mesh(cp=4), plan={})
    with pytest.raises(PlanError, match=r"cumsum \(aten.cumsum.default\) in \(top\) needs .* mixes tokens"):
        ids = torch.randint(0, 64, (2, 16))
        autoshard.compile(RunningMean(), autoshard.Mesh(cp=2), (ids,), loss_fn=lambda out, t: out.mean(),
                          example_target=ids, plan={})  # fmt: skip
    with pytest.raises(PlanError, match="attention with dropout"):
        compile_case(build_case("llama", steps=1, seq=16, dropout=0.1), autoshard.Mesh(cp=2), {"cp_attention": "ring"})
    dropout = compile_case(build_case("llama", steps=1, seq=16, dropout=0.1), autoshard.Mesh(cp=2), plan={})
    assert dropout.plan.cp_attention == "all_to_all"  # the planner's choice where the ring cannot draw dropout
    with pytest.raises(PlanError, match="4 heads and 4 K/V heads; use cp_attention='ring'"):
        compile_case(build_case("gpt2", steps=1, seq=16), autoshard.Mesh(cp=8), plan={"cp_attention": "all_to_all"})
    with pytest.raises(PlanError, match=r"topk \(aten.topk.default\) in model.layers.0 .* experts' router"):
        compile_case(build_case("mixtral_aux", steps=1, seq=16), autoshard.Mesh(dp=2, cp=2), plan={})
    with pytest.raises(PlanError, match="not yet with ep=2"):
        compile_case(build_case("moe_loop", steps=1, seq=16), autoshard.Mesh(dp=2, cp=2), plan={"ep": 2})


def test_the_mesh_puts_cp_between_dp_and_tp() -> None:
    mesh = autoshard.Mesh(dp=2, cp=2, tp=2)
    assert mesh.size == 8 and mesh.coords(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert mesh.group("cp", 5) == [5, 7] and mesh.group(("dp", "cp"), 5) == [1, 3, 5, 7]
    assert mesh.replica_index(7) == 3 and "cp=2" in str(mesh)


@pytest.mark.parametrize("attention", ["ring", "all_to_all"])
def test_verify_compares_each_ranks_tokens(ranks, attention) -> None:
    """verify under cp: every value a rank holds its tokens of is compared with the same tokens of one device's
    (the attentions, the logits flattened over batch and tokens included); the loss and every parameter after
    the step are the device's."""
    case = build_case("llama", steps=1, seq=32)
    batch = case.batches[0]
    report = autoshard.verify(
        copy.deepcopy(case.model), autoshard.Mesh(dp=2, cp=2), batch.inputs, batch.kwargs,
        plan={"cp_attention": attention}, ranks=ranks(4),
    )  # fmt: skip
    assert report.ok, str(report)
    compared = {c.node for c in report.checks}
    assert {"scaled_dot_product_attention", "scaled_dot_product_attention_1"} <= compared
    assert {(0,), (1,), (2,), (3,)} <= {c.ranks for c in report.checks}  # every dp x cp rank's tokens
    assert abs(report.loss - report.reference_loss) < 1e-5


def test_a_checkpoint_saved_under_cp_resumes_at_another_cp(ranks, tmp_path) -> None:
    """Parameters are whole on every cp rank: saved at dp2 x cp2 with ZeRO-1 after one step, the run goes on at
    cp4 and at dp4 with ZeRO-3 as one device goes on."""
    shape = shape_of("llama", 64)
    path = str(tmp_path / "ck")
    ranks(4).run(train_and_save, "llama", {"dp": 2, "cp": 2}, {"zero": 1}, 3, 1, path, **shape)
    ref_losses, ref_state = reference("llama", **shape)
    for mesh, plan in (({"cp": 4}, {}), ({"dp": 4}, {"zero": 3})):
        resumed = ranks(4).run(load_and_train, "llama", mesh, plan, 3, path, **shape)
        assert resumed[0]["losses"] == pytest.approx(ref_losses[1:], rel=1e-5), mesh
        assert_state_close(resumed[0]["state"], ref_state)
