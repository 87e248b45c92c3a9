"""Pipeline stage cuts on captured graphs: balance, fixed cuts, and split numerics (tier 1)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from cases import Stack, build_case
from hypothesis import given, settings
from hypothesis import strategies as st

import autoshard
from autoshard import passes
from autoshard.capture import capture
from autoshard.ir.meta import evaluate_expr, get_cost, get_layer, get_stage

pipeline_split = passes.pipeline_split


def captured_stack(blocks: int):
    model = Stack(blocks)
    x = torch.randn(4, 16)
    captured = capture(model, (x,), None, lambda out, t: F.mse_loss(out, t), torch.randn(4, 16))
    passes.analyze(captured.gm, captured.rename)
    return captured


def blocks_per_stage(gm) -> list[int]:
    counts: dict[int, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and get_layer(node).startswith("blocks."):
            counts.setdefault(get_stage(node), set()).add(get_layer(node))
    return [len(counts[s]) for s in sorted(counts)]


@pytest.mark.parametrize(("blocks", "pp"), [(4, 2), (8, 4), (8, 2), (12, 3), (6, 6)])
def test_identical_blocks_split_evenly(blocks: int, pp: int) -> None:
    captured = captured_stack(blocks)
    pipeline_split.run(captured.gm, pp, captured.example_sizes)
    assert blocks_per_stage(captured.gm) == [blocks // pp] * pp


def stage_loads(gm, sizes) -> list[int]:
    loads: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op != "output":
            c = get_cost(node)
            loads[get_stage(node)] = loads.get(get_stage(node), 0) + evaluate_expr(c.flops_fwd + c.flops_bwd, sizes)
    return [loads[s] for s in sorted(loads)]


@settings(max_examples=15)
@given(blocks=st.integers(2, 7), pp=st.integers(2, 4), data=st.data())
def test_costliest_stage_is_optimal_among_block_cuts(blocks: int, pp: int, data) -> None:
    """Uneven blocks: the split's costliest stage equals the best over every possible set of cuts."""
    pp = min(pp, blocks)
    widths = data.draw(st.lists(st.integers(4, 40), min_size=blocks, max_size=blocks))

    model = Stack(blocks)
    for block, width in zip(model.blocks, widths):  # blocks of different cost
        block[0] = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 16))
    captured = capture(model, (torch.randn(4, 16),), None, lambda o, t: F.mse_loss(o, t), torch.randn(4, 16))
    passes.analyze(captured.gm, captured.rename)
    pipeline_split.run(captured.gm, pp, captured.example_sizes)
    assert max(stage_loads(captured.gm, captured.example_sizes)) == best_max_load(captured, pp)


def best_max_load(captured, pp: int) -> int:
    """Brute force: the smallest costliest stage over every choice of cuts at block starts."""
    sizes = captured.example_sizes
    starts = [pos for _, pos in pipeline_split.block_starts(captured.gm)][1:]
    nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
    node_cost = [evaluate_expr(get_cost(n).flops_fwd + get_cost(n).flops_bwd, sizes) for n in nodes]
    return min(
        max(sum(node_cost[a:b]) for a, b in zip((0, *cuts), (*cuts, len(nodes))))
        for cuts in itertools.combinations(starts, pp - 1)
    )


def test_gpt2_small_stages_are_balanced() -> None:
    import transformers

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=1024))
    ids = torch.randint(0, 50257, (8, 1024))
    captured = capture(model, (ids,), {"labels": ids, "use_cache": False})
    passes.analyze(captured.gm, captured.rename)
    block = evaluate_expr(
        sum(
            (get_cost(n).flops_fwd + get_cost(n).flops_bwd for n in captured.gm.graph.nodes
             if n.op == "call_function" and get_layer(n) == "transformer.h.0"),
            start=0,
        ),
        captured.example_sizes,
    )  # fmt: skip
    for pp in (2, 4):
        pipeline_split.run(captured.gm, pp, captured.example_sizes)
        loads = stage_loads(captured.gm, captured.example_sizes)
        # The LM head (2*B*S*h*V) weighs on the last stage, so the mean is not always reachable.
        assert max(loads) <= 1.10 * sum(loads) / pp or max(loads) <= best_max_load(captured, pp) + block


def test_fixed_cuts_by_layer_name() -> None:
    captured = captured_stack(6)
    pipeline_split.run(captured.gm, 3, captured.example_sizes, cuts=["blocks.1", "blocks.5"])
    assert blocks_per_stage(captured.gm) == [1, 4, 1]
    msg = "pp_cuts must name 1 block(s) or node(s) that start stages 1..1, in order; ['blocks.9'] not usable"
    with pytest.raises(autoshard.PlanError, match=re.escape(msg)):
        pipeline_split.run(captured.gm, 2, captured.example_sizes, cuts=["blocks.9"])
    msg = (
        "4 pipeline stages (pp x virtual_stages) need at least 4 repeated blocks to cut between, "
        "but the graph has 3; use at most 3 stages"
    )
    with pytest.raises(autoshard.PlanError, match=re.escape(msg)):
        pipeline_split.run(captured_stack(3).gm, 4, {"B": 4})


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_stage_submodules_compute_the_same_loss(family: str) -> None:
    case = build_case(family)
    batch = case.batches[0]
    captured = capture(case.model, batch.inputs, batch.kwargs)
    passes.analyze(captured.gm, captured.rename)
    pipeline_split.run(captured.gm, 2, captured.example_sizes)
    split = pipeline_split.split_stages(captured.gm)
    assert hasattr(split, "submod_0") and hasattr(split, "submod_1")
    flat = [*batch.inputs, batch.kwargs["labels"]]
    torch.testing.assert_close(split(*flat)[0], captured.gm(*flat)[0], rtol=0, atol=0)
    # Between two blocks only the hidden state and a few masks or sizes cross the cut.
    nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
    cut = next(i for i, n in enumerate(nodes) if n.op != "output" and get_stage(n) == 1)
    assert pipeline_split.crossing_values(nodes, cut) <= 6
