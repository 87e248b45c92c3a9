"""passes.saved_tensors against what autograd really keeps: the captured graph runs forward under
saved_tensors_hooks and the distinct storages it saves (not parameters or inputs) are summed."""

from __future__ import annotations

from typing import Any

import pytest
import sympy
import torch
from cases import build_case
from hypothesis import given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.planner.hardware import Hardware

B, S = sympy.Symbol("B", integer=True, positive=True), sympy.Symbol("S", integer=True, positive=True)


def _compile(family: str, mesh: dict[str, int] | None = None, **plan: Any) -> tuple[autoshard.Program, Any]:
    case = build_case(family, dropout=0.1) if family in ("gpt2", "bert") else build_case(family)
    batch = case.batches[0]
    program = autoshard.compile(
        case.model, autoshard.Mesh(**(mesh or {"dp": 1})), example_inputs=batch.inputs,
        example_kwargs=batch.kwargs, plan=plan, hardware=Hardware.preset("cpu"),
    )  # fmt: skip
    return program, batch


def _measured(program: autoshard.Program, batch: Any, autocast: torch.dtype | None = None) -> int:
    gm = program.compiled.captured.gm
    inputs = [batch.inputs[0], *(v for v in batch.kwargs.values() if isinstance(v, torch.Tensor))]
    held = {t.untyped_storage()._cdata for t in [*gm.parameters(), *gm.buffers(), *inputs]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in held:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None):
            gm(*inputs)
    return sum(saved.values())


@pytest.mark.parametrize(("family", "tolerance"), [("gpt2", 0.001), ("bert", 0.001), ("llama", 0.05)])
def test_kept_bytes_match_what_autograd_saves(family: str, tolerance: float) -> None:
    # GPT-2 and BERT with dropout (math attention, float masks on CPU); Llama with fused attention,
    # rotary embeddings and repeated kv heads, whose reshapes copy (counted a little high where a
    # copy is shared).
    program, batch = _compile(family)
    ((name, memory),) = program.cost.saved_for_backward
    rows, seq = batch.inputs[0].shape
    assert memory.evaluate(B=rows, S=seq)["kept"] == pytest.approx(_measured(program, batch), rel=tolerance)
    assert name == "graph" and not memory.unaccounted


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt2_without_dropout_keeps_what_autograd_saves(attention: str) -> None:
    """GPT-2 on fused attention hands it a boolean causal mask: the kernel keeps its own additive copy in q's
    dtype, each call (not the one-byte mask once); its output is laid out token-major, so the transpose and
    reshape before the projection are a view of it, not a copy kept apart. On eager attention a dropout at
    p = 0 returns its input itself: the attention weights it passes on are the softmax's, kept once."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(1))
    batch = type("Batch", (), {"inputs": (ids,), "kwargs": {"labels": ids, "use_cache": False}})()
    program = autoshard.compile(
        transformers.GPT2LMHeadModel(config), 1, example_inputs=batch.inputs, example_kwargs=batch.kwargs,
        hardware=Hardware.preset("cpu"),
    )  # fmt: skip
    ((_, memory),) = program.cost.saved_for_backward
    assert memory.evaluate(B=2, S=128)["kept"] == pytest.approx(_measured(program, batch), rel=1e-4)


@pytest.mark.parametrize(("family", "tolerance"), [("gpt2", 0.01), ("llama", 0.05)])
def test_kept_bytes_under_autocast_match_what_autograd_saves(family: str, tolerance: float) -> None:
    """Under torch.autocast the matmuls keep bf16 copies of their inputs (a weight's once a forward) and
    their bf16 outputs flow on; the accounting follows the dtypes autocast gives each value."""
    program, batch = _compile(family, autocast=torch.bfloat16)
    plain, _ = _compile(family)
    ((_, memory),) = program.cost.saved_for_backward
    rows, seq = batch.inputs[0].shape
    kept = memory.evaluate(B=rows, S=seq)["kept"]
    assert kept == pytest.approx(_measured(program, batch, torch.bfloat16), rel=tolerance)
    assert kept < plain.cost.saved_for_backward[0][1].evaluate(B=rows, S=seq)["kept"]
    assert program.plan_report.chosen.memory.activations < plain.plan_report.chosen.memory.activations


def test_recompute_choices_and_tensor_parallelism_shrink_the_kept_bytes() -> None:
    b, s = sympy.symbols("B S", integer=True, positive=True)
    kept = {}
    for choice in ("none", "selective", "full"):
        program, _ = _compile("gpt2", recompute=choice)
        kept[choice] = program.cost.saved_for_backward[0][1]
    at = {"B": 4, "S": 512}
    none, selective, full = (kept[c].evaluate(**at)["kept"] for c in ("none", "selective", "full"))
    assert full < selective < none
    assert kept["none"].transient == 0 and kept["full"].transient != 0
    # Selective recomputation drops the attention matrices: no S**2 term beyond the (shared) mask.
    assert sympy.Poly(kept["none"].kept, b, s).coeff_monomial(b * s**2) > sympy.Poly(
        kept["selective"].kept, b, s
    ).coeff_monomial(b * s**2)
    sp, _ = _compile("gpt2", mesh={"tp": 2}, sequence_parallel=True)
    assert sp.cost.saved_for_backward[0][1].evaluate(**at)["kept"] < none
    assert "saved for backward (passes.saved_tensors; recompute none)" in sp.explain()


def _step_peak(program: autoshard.Program, *args: Any, **kwargs: Any) -> int:
    """The most bytes allocated during one step above what was allocated before it (the profiler's memory
    events: one process, every free on this thread)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        program.step(*args, **kwargs)
    current = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):  # fmt: skip
        current += nbytes
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("plan", [{}, {"recompute": "full"}, {"microbatches": 2}], ids=str)
def test_the_planners_memory_is_a_steps_peak(plan: dict[str, Any]) -> None:
    """The planner's memory for a plan is what a step holds at its peak: parameters, gradients and Adam's state
    held between steps, plus what the step allocates at most. A language model with a large vocabulary peaks
    in its loss's backward, where the gradients of the log-softmax and of the logits (twice the logits, half
    the activations here) sit beside everything kept (passes/gradients_in_flight)."""
    from autoshard.demo import TinyGPT, next_token_loss

    gen = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, 4096, (8, 64), generator=gen), torch.randint(0, 4096, (8, 64), generator=gen)
    torch.manual_seed(0)
    program = autoshard.compile(
        TinyGPT(4096, 64, 4, 2, 64), 1, (ids,), loss_fn=next_token_loss, example_target=target, plan=plan,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), hardware=Hardware.preset("cpu"),
    )  # fmt: skip
    for _ in range(2):  # the optimizer's state exists; what the first steps make once is not a step's
        program.step(ids, target=target)
    measured = _step_peak(program, ids, target=target) + sum(program.last_step_memory.values())
    predicted = program.plan_report.chosen.memory
    assert predicted.total == pytest.approx(measured, rel=0.01), (str(predicted), measured)


@settings(max_examples=100, deadline=None)
@given(
    terms=st.lists(
        st.dictionaries(st.sampled_from(["1", "B*S", "B*S**2", "S"]), st.integers(1, 9), min_size=1),
        min_size=1,
        max_size=8,
    ),  # fmt: skip
    b=st.integers(1, 64),
    s=st.integers(1, 4096),
)
def test_the_gradients_in_flight_keep_every_term_that_can_be_the_most(terms: list[dict], b: int, s: int) -> None:
    """Pruning the terms of the in-flight Max keeps its value at every size: a term dropped is covered,
    coefficient by coefficient, by one kept."""
    from autoshard.passes.gradients_in_flight import _undominated

    exprs = {sympy.expand(sum(c * sympy.sympify(m, locals={"B": B, "S": S}) for m, c in t.items())) for t in terms}
    kept = _undominated(exprs)
    at = {B: b, S: s}
    assert max(e.subs(at) for e in kept) == max(e.subs(at) for e in exprs)
    assert len(kept) <= len(exprs)
