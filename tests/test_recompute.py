"""Activation recomputation and gradient accumulation on real gloo ranks.

Recomputation changes what autograd keeps, never what it computes: with dropout off every plan equals
single-device training, and with dropout on every recompute choice equals the same plan without it,
bit for bit (each replayed mask is the first forward's, on every tp rank's own stream too).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cases import GLOBAL_BATCH, build_case, dp_reductions_per_step, train_plan, train_single_device
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_dp_equivalence import assert_state_close
from test_tp import assert_state_close as assert_tp_state_close

import autoshard
from autoshard import passes
from autoshard.ir.meta import RECOMPUTE, evaluate_expr

MESHES: tuple[tuple[dict[str, int], dict[str, Any]], ...] = (
    ({"dp": 4}, {}),
    ({"dp": 2, "tp": 2}, {"sequence_parallel": True}),
    ({"dp": 2, "pp": 2}, {}),
    ({"dp": 4}, {"zero": 3}),
    ({"dp": 2, "pp": 2}, {"zero": 3}),
)
GRID = [
    (family, mesh, {**extra, "recompute": choice})
    for family in ("gpt2", "llama", "bert")
    for choice in ("full", "selective", 0.25, 0.5, 0.75)
    for mesh, extra in MESHES
]


def _world(mesh: dict[str, int]) -> int:
    world = 1
    for degree in mesh.values():
        world *= degree
    return world


def check_matches_single_device(ranks, family: str, mesh: dict[str, int], plan: dict[str, Any], **shape) -> None:
    ref_losses, ref_state = train_single_device(family, **shape)
    results = ranks(_world(mesh)).run(train_plan, family, mesh, plan, **shape)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
    # Under tp, row-parallel sums run in another order (split-K): test_tp's floor.
    (assert_tp_state_close if mesh.get("tp", 1) > 1 else assert_state_close)(results[0]["state"], ref_state)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mesh", "plan"), GRID, ids=[f"{f}-{m}-{p}" for f, m, p in GRID])
def test_recompute_matches_single_device_grid(ranks, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> None:
    check_matches_single_device(ranks, family, mesh, plan)


@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(GRID))
def test_recompute_matches_single_device_sample(ranks, case: tuple[str, dict[str, int], dict[str, Any]]) -> None:
    check_matches_single_device(ranks, *case)


@pytest.mark.parametrize(
    ("family", "mesh", "extra"),
    [
        pytest.param("gpt2", {"dp": 2, "tp": 2}, {"sequence_parallel": True}, marks=pytest.mark.slow),
        ("gpt2", {"dp": 2, "pp": 2}, {"zero": 3}),
        pytest.param("bert", {"dp": 4}, {"zero": 3}, marks=pytest.mark.slow),
    ],
)
def test_dropout_masks_replay_exactly(ranks, family: str, mesh: dict[str, int], extra: dict[str, Any]) -> None:
    pool = ranks(_world(mesh))
    kept = pool.run(train_plan, family, mesh, extra, dropout=0.1)[0]
    for choice in ("full", "selective", 0.25, 0.5, 0.75):
        recomputed = pool.run(train_plan, family, mesh, {**extra, "recompute": choice}, dropout=0.1)[0]
        assert recomputed["losses"] == kept["losses"], choice
        for key, value in kept["state"].items():
            assert torch.equal(recomputed["state"][key], value), f"{choice}: {key}"


@pytest.mark.parametrize(
    ("mesh", "plan"), [({"dp": 4}, {}), ({"dp": 2, "tp": 2}, {"zero": 1})], ids=["dp4", "dp2xtp2-zero1"]
)
def test_gradient_accumulation_syncs_once_per_step(ranks, mesh: dict[str, int], plan: dict[str, Any]) -> None:
    batch = 2 * GLOBAL_BATCH  # 4 rows per dp rank at dp 4: 4 microbatches of one row
    ref_losses, ref_state = train_single_device("gpt2", batch=batch)
    results = ranks(_world(mesh)).run(
        dp_reductions_per_step, "gpt2", mesh, {**plan, "microbatches": 4, "recompute": "full"}, batch=batch
    )
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        # Each gradient group reduced over dp once per step, after the last microbatch's backward.
        assert result["launches"] == [dict.fromkeys(range(result["groups"]), 1)] * 3, f"rank {rank}"
    assert_state_close(results[0]["state"], ref_state)


class CheckpointedBlocks(torch.nn.Module):
    """A model that checkpoints its own blocks with torch.utils.checkpoint."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                torch.nn.Linear(2 * width, width))
            for _ in range(depth)
        )  # fmt: skip
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _checkpointed_case(seed: int = 0) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = CheckpointedBlocks()
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(3)]
    return model, batches


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, target)


def train_checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    model, batches = _checkpointed_case()
    x, y = batches[0]
    program = autoshard.compile(
        model, autoshard.Mesh(dp=world_size), example_inputs=(x,), loss_fn=_cross_entropy, example_target=y,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )  # fmt: skip
    losses = [program.step(program.local_batch(x), target=program.local_batch(y)) for x, y in batches]
    regions = [n for n in program.for_rank(rank).graph_modules[0].graph.nodes if RECOMPUTE in n.meta]
    return {"losses": losses, "state": program.full_state_dict(), "regions": len(regions), "explain": program.explain()}


def test_model_checkpoints_are_kept_as_recompute_regions(ranks) -> None:
    model, batches = _checkpointed_case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = _cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    result = ranks(2).run(train_checkpointed)[0]
    assert result["regions"] == 3  # one per torch.utils.checkpoint call, not inlined away
    assert "recompute: 3 recompute regions" in result["explain"]
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(result["state"], {k: v.detach() for k, v in model.state_dict().items()})


def _compile_gpt2(**plan: Any) -> autoshard.Program:
    case = build_case("gpt2")
    batch = case.batches[0]
    return autoshard.compile(
        case.model, autoshard.Mesh(dp=2), example_inputs=batch.inputs, example_kwargs=batch.kwargs, plan=plan
    )


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"recompute": "some"}, "must be one of ('none', 'full', 'selective')"),
        ({"recompute": 1.5}, "as a budget is the share of activation bytes to keep"),
        ({"recompute": ("transformer.h.7",)}, "the blocks are ['transformer.h.0', 'transformer.h.1']"),
        ({"microbatches": 3}, "does not divide the 4 rows"),
    ],
)
def test_bad_recompute_and_accumulation_plans_are_refused(plan: dict[str, Any], message: str) -> None:
    with pytest.raises(autoshard.PlanError) as refused:
        _compile_gpt2(**plan)
    assert message in str(refused.value)


def test_explain_shows_the_regions() -> None:
    text = _compile_gpt2(recompute="full").explain()
    assert "recompute=full" in text
    assert "recompute: 2 recompute regions in 2 layers (full)" in text


@pytest.mark.parametrize(
    ("attention", "dropout", "regions"),
    [("sdpa", 0.0, 0), ("eager", 0.1, 2), ("sdpa", 0.1, 2)],
    ids=["fused", "eager", "fused-dropout"],
)
def test_selective_recomputes_what_the_kernels_keep(attention: str, dropout: float, regions: int) -> None:
    """Selective recomputation weighs each attention by what its kernel keeps for backward against the FLOPs it
    would repeat, beside what recomputing the whole block trades: the fused kernel (no dropout) keeps its
    inputs and a log-sum-exp, so recomputing it frees almost nothing and it is kept, which explain() says;
    eager attention under dropout, and the CPU's math path, keep the score matrices thrice (softmax output, mask,
    dropout output) and are recomputed. (Without dropout eager attention keeps the softmax output alone, a byte
    per head-dimension FLOP repeated: no better a trade than the whole block's, so it is kept.)"""
    import transformers

    from autoshard.planner.hardware import Hardware

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    programs = {
        choice: autoshard.compile(
            transformers.GPT2LMHeadModel(config),
            1,
            example_inputs=(ids,),
            example_kwargs={"labels": ids, "use_cache": False},
            plan={"recompute": choice},
            hardware=Hardware.preset("cpu"),
        )  # fmt: skip
        for choice in ("none", "selective")
    }
    gm = programs["selective"].for_rank(0).graph_modules[0]
    assert sum(RECOMPUTE in n.meta for n in gm.graph.nodes) == regions
    kept = {c: p.cost.saved_for_backward[0][1].evaluate(B=4, S=128)["kept"] for c, p in programs.items()}
    explained = programs["selective"].explain()
    if regions:
        assert kept["selective"] < 0.8 * kept["none"]
        assert "recompute selective: 2 regions free" in explained
    else:
        assert kept["selective"] == kept["none"]
        assert "recompute selective frees nothing here" in explained
        # The kernel keeps q, k, v, its output and a log-sum-exp; recomputed, it would keep its inputs instead.
        graph = programs["none"].for_rank(0).graph_modules[0]
        deals = passes.recompute.Deals(graph, "cpu")
        attention = next(n for n in graph.graph.nodes if "scaled_dot_product" in str(n.target))
        keeps = sum(evaluate_expr(size, {"B": 4, "S": 128}) for _, size in deals.saves[attention])
        assert 0 < evaluate_expr(deals.freed([attention]), {"B": 4, "S": 128}) < keeps / 2


def test_a_recompute_budget_keeps_at_most_its_share() -> None:
    """recompute=b keeps at most b of the bytes autograd would keep (the accounting), within 5% of b (0.85-0.95
    at 0.5 and 0.25 before the knapsack was solved again for what neighbouring blocks free together), and a
    smaller budget repeats more forward FLOPs: cheap trades first."""
    import transformers

    from autoshard.planner.hardware import Hardware

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=256, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, attn_implementation="eager",
    )  # fmt: skip
    ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(1))
    kept, repeated = {}, {}
    for choice in ("none", 0.75, 0.5, 0.25, "full"):
        torch.manual_seed(0)
        program = autoshard.compile(
            transformers.GPT2LMHeadModel(config), 1, example_inputs=(ids,),
            example_kwargs={"labels": ids, "use_cache": False}, plan={"recompute": choice},
            hardware=Hardware.preset("cpu"),
        )  # fmt: skip
        kept[choice] = program.cost.saved_for_backward[0][1].evaluate(B=4, S=256)["kept"]
        gm = program.for_rank(0).graph_modules[0]
        regions = [n.meta[RECOMPUTE] for n in gm.graph.nodes if RECOMPUTE in n.meta]
        repeated[choice] = sum(evaluate_expr(r.flops, {"B": 4, "S": 256}) for r in regions)
    for budget in (0.75, 0.5, 0.25):
        assert kept[budget] <= budget * kept["none"], budget
    for budget in (0.75, 0.5, 0.25):
        assert kept[budget] >= 0.95 * budget * kept["none"], budget
    assert 0 < repeated[0.75] < repeated[0.5] < repeated[0.25] < repeated["full"]


@st.composite
def _fronts(draw: Any) -> list[list[tuple]]:
    """Blocks' Pareto fronts of (bytes freed, cost): most bytes first, down to (0, 0) (recompute nothing)."""
    fronts = []
    for _ in range(draw(st.integers(1, 5))):
        points = draw(st.lists(st.tuples(st.integers(1, 1000), st.integers(1, 1000)), min_size=1, max_size=6))
        front = passes.recompute_budget._pareto([(float(g), float(c), ()) for g, c in points] + [(0.0, 0.0, ())])
        fronts.append(front)
    return fronts


@settings(max_examples=200, deadline=None)
@given(fronts=_fronts(), share=st.floats(0.0, 1.2))
@example(  # two blocks that each free just under half: rounded up, they would seem to meet it together
    fronts=[[(499.9, 1.0, ()), (0.0, 0.0, ())]] * 2 + [[(1000.0, 100.0, ()), (0.0, 0.0, ())]], share=1000.0 / 1999.8
)
def test_the_budget_knapsack_finds_the_least_cost(fronts: list[list[tuple]], share: float) -> None:
    """Against every combination of the blocks' points: what the knapsack picks frees at least the need, and
    costs no more than the cheapest combination that frees a grid cell a block more (its rounding down)."""
    import itertools

    most = sum(front[0][0] for front in fronts)
    need = share * most
    picks = passes.recompute_budget._knapsack(fronts, need)
    freed = sum(front[p][0] for front, p in zip(fronts, picks))
    cost = sum(front[p][1] for front, p in zip(fronts, picks))
    combos = [(sum(p[0] for p in c), sum(p[1] for p in c)) for c in itertools.product(*fronts)]
    if need <= 0 or need > most:  # nothing to free; or more than everything: free the most there is
        assert picks == [len(front) - 1 if need <= 0 else 0 for front in fronts]
        return
    assert freed >= need
    cells = max(2000, 100 * len(fronts))
    surely = [c for f, c in combos if f >= need * (1 + len(fronts) / cells)]
    assert cost <= min(surely, default=cost)
    assert cost >= min(c for f, c in combos if f >= need)  # it cannot beat the exact optimum


@pytest.mark.parametrize("choice", ["selective", 0.5, "full"])
def test_every_choice_keeps_the_models_own_checkpoints(choice: Any) -> None:
    """A model's torch.utils.checkpoint regions stay regions under every choice: selective recomputation and a
    budget, which weigh runs between matmuls, do not take them apart or drop them."""
    model, batches = _checkpointed_case()
    x, y = batches[0]
    program = autoshard.compile(model, 1, example_inputs=(x,), loss_fn=_cross_entropy, example_target=y,
                                plan={"recompute": choice})  # fmt: skip
    gm = program.for_rank(0).graph_modules[0]
    assert sum(RECOMPUTE in n.meta for n in gm.graph.nodes) == 3


def _allocated(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the bytes it left allocated (the profiler's memory events: what the CPU benchmarks count)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return result, sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def _forward_keeps(gm: torch.fx.GraphModule, *args: Any) -> int:
    """Bytes one forward of ``gm`` leaves allocated beyond its outputs; then its backward runs, freeing them."""
    outputs, net = _allocated(lambda: gm(*args))
    kept = net - sum(o.untyped_storage().nbytes() for o in outputs if isinstance(o, torch.Tensor))
    outputs[0].backward()
    return kept


def test_a_budget_has_matmuls_keep_a_recipe_for_their_input() -> None:
    """Under a budget a matmul whose input is a norm's or the GELU's output keeps, instead of that input, a
    recipe to make it again from what the norm or the GELU keeps anyway (torch's min-cut partitioner's trade):
    the cheapest bytes a block has, and a span of pointwise ops could not free them (the matmul after it keeps
    its input). What the allocator sees a forward keep is what the accounting says, and training is the same
    as without recomputation, bit for bit."""
    import transformers

    from autoshard.graph_ops import recompute
    from autoshard.planner.hardware import Hardware

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa", activation_function="gelu_pytorch_tanh",
    )  # fmt: skip
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids, "use_cache": False}
    losses = {}
    for choice in ("none", 0.75):
        torch.manual_seed(0)
        program = autoshard.compile(
            transformers.GPT2LMHeadModel(config), 1, example_inputs=(ids,), example_kwargs=kwargs,
            plan={"recompute": choice}, hardware=Hardware.preset("cpu"),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        )  # fmt: skip
        gm = program.for_rank(0).graph_modules[0]
        remade = [n for n in gm.graph.nodes if n.target is recompute.input_recomputed]
        if choice != "none":
            producers = {str(n.args[2]) for n in remade}
            assert {"aten.layer_norm.default", "aten.gelu.default"} <= producers, producers
            assert f"and {len(remade)} matmul inputs made again free" in program.explain()
            accounted = program.cost.saved_for_backward[0][1].evaluate(B=4, S=128)["kept"]
            assert _forward_keeps(gm, ids, ids) == pytest.approx(accounted, rel=0.005)
        losses[choice] = [program.step(ids, **kwargs) for _ in range(3)]
    assert losses[0.75] == losses["none"]


@pytest.mark.parametrize(
    ("family", "mesh", "plan"),
    [
        ("gpt2", {"dp": 2, "pp": 2}, {"recompute": 0.75}),  # the matmuls of a split backward (W deferred)
        ("gpt2", {"pp": 2}, {"recompute": 0.5, "schedule": "zb_h1", "microbatches": 4}),  # W scheduled apart
        ("llama", {"dp": 4}, {"recompute": 0.75}),  # RMSNorm's scale and SwiGLU's product made again
    ],
)
def test_matmul_input_recipes_match_single_device(ranks, family: str, mesh: dict[str, int], plan: dict) -> None:
    check_matches_single_device(ranks, family, mesh, plan)


def test_a_matmul_made_to_remake_its_input_keeps_less_and_computes_the_same() -> None:
    """recompute.input_recomputed on its own: the matmul's gradients are the plain matmul's bit for bit (the GELU
    made again with its own keyword, tanh), and a forward keeps exactly the GELU's output less."""
    from autoshard.graph_ops import recompute

    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(512, 256, generator=gen)).requires_grad_()
    w = torch.randn(128, 256, generator=gen).requires_grad_()

    def plain() -> torch.Tensor:
        return aten.linear.default(aten.gelu.default(x, approximate="tanh"), w)

    def remade() -> torch.Tensor:
        y = aten.gelu.default(x, approximate="tanh")
        return recompute.input_recomputed(
            aten.linear.default, y, aten.gelu.default, (x,), {"approximate": "tanh"}, y, w
        )

    grads, kept = {}, {}
    for name, forward in (("plain", plain), ("remade", remade)):
        x.grad = w.grad = None
        out, kept[name] = _allocated(forward)
        out.square().sum().backward()
        grads[name] = (x.grad.clone(), w.grad.clone())
        del out  # (freed inside the next profile, it would count against the next forward)
    assert torch.equal(grads["plain"][0], grads["remade"][0]) and torch.equal(grads["plain"][1], grads["remade"][1])
    assert kept["plain"] - kept["remade"] == 512 * 256 * 4  # the GELU's output, no longer kept
