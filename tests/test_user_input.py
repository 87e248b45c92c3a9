"""What a new user types, taken as meant or refused with the fix: dtype names in plans (dicts and the CLI),
misspelled fields, bad values caught before the model is touched, the hardware a plan assumed said with
the model's size, compile-time constants passed to step() again, progress lines without logging set up,
and a collective called on one rank only."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from cases import build_case, compile_case

import autoshard
from autoshard.demo import TinyGPT, next_token_loss, successor_batch
from autoshard.launch import RankFailure


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_dtype_names_in_a_plan_mean_the_dtype(name: str) -> None:
    case = build_case("gpt2", layers=1)
    program = compile_case(case, 1, plan={"param_dtype": name, "zero": 1})
    assert program.plan.param_dtype is torch.bfloat16
    assert {p.dtype for p in program.compiled.model.parameters()} == {torch.bfloat16}
    assert autoshard.Plan.check_overrides({"autocast": "fp16", "reduce_dtype": "fp32"}) == {
        "autocast": torch.float16, "reduce_dtype": torch.float32}  # fmt: skip
    assert autoshard.Plan(zero=1, param_dtype=name).param_dtype is torch.bfloat16


def test_a_bad_plan_is_refused_before_the_model_is_touched() -> None:
    case = build_case("gpt2", layers=1)
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    for plan, message in [
        ({"param_dtype": "int8", "zero": 1}, "param_dtype='int8' is not a dtype: write torch.bfloat16, or a name"),
        ({"param_dtype": "bf16", "zero": 0}, "it needs zero=1, 2 or 3"),
        ({"zeros": 1}, "unknown plan field 'zeros'; did you mean 'zero'?"),
        ({"sequence_parallel": True, "tp": 1}, "sequence_parallel=True shards activations across the tp group"),
    ]:
        with pytest.raises(autoshard.PlanError, match=message):
            compile_case(case, 1, plan=plan)
        assert all(torch.equal(before[k], v) for k, v in case.model.state_dict().items())  # nor cast nor changed


def test_the_cli_takes_dtype_names() -> None:
    args = ["plan", "--model", "gpt2", "--world", "2", "--plan", "param_dtype=bf16", "zero=1"]
    done = subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "param_dtype=bfloat16" in done.stdout
    assert "GPT2LMHeadModel: 0.12M parameters; assuming CPU core (preset)" in done.stdout


def test_the_plan_says_which_hardware_it_assumed_and_the_models_size() -> None:
    ids, target = successor_batch(0, 4, 16)
    on_cpu = autoshard.plan(TinyGPT(), 2, (ids,), loss_fn=next_token_loss, example_target=target)
    assert on_cpu.hardware.name == autoshard.Hardware.preset("cpu").name  # a CPU model: the CPU preset
    assert on_cpu.assumed() == "TinyGPT: 0.12M parameters; assuming CPU core (preset)"
    with torch.device("meta"):
        big = TinyGPT(dim=1024, layers=4)
    at_scale = autoshard.plan(big, 8, (ids,), loss_fn=next_token_loss, example_target=target)
    assert at_scale.assumed() == "TinyGPT: 50.70M parameters; assuming A100 80GB SXM (preset)"
    h100 = autoshard.Hardware.preset("h100-80gb")
    told = autoshard.plan(TinyGPT(), 2, (ids,), loss_fn=next_token_loss, example_target=target, hardware=h100)
    assert told.hardware is h100
    program = autoshard.compile(TinyGPT(), 1, (ids,), loss_fn=next_token_loss, example_target=target)
    assert "TinyGPT: 0.12M parameters; assuming CPU core (preset)" in program.explain().splitlines()[1]


def test_a_compile_time_constant_given_again_is_the_same_call() -> None:
    case = build_case("gpt2", layers=1)
    program = compile_case(case, 1)  # compiled with use_cache=False (a constant of the graph)
    ids = case.batches[0].inputs[0]
    program.step(ids, labels=ids, use_cache=False)  # the same constant again: fine
    with pytest.raises(autoshard.InputError, match="use_cache=True: use_cache was fixed at compile time as False"):
        program.step(ids, labels=ids, use_cache=True)


def test_progress_lines_print_without_logging_set_up(capsys: pytest.CaptureFixture[str]) -> None:
    ids, target = successor_batch(0, 4, 16)
    program = autoshard.compile(TinyGPT(), 1, (ids,), loss_fn=next_token_loss, example_target=target,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), log_every=1)  # fmt: skip
    program.step(ids, target=target)
    program.step(ids, target=target)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and lines[0].startswith("step 1") and lines[1].startswith("step 2"), lines


def _full_state_on_rank_zero_only(rank: int, world: int) -> int:
    case = build_case("gpt2", layers=1)
    program = autoshard.compile(
        case.model, autoshard.Mesh(dp=world), case.batches[0].inputs, case.batches[0].kwargs,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), plan={"zero": 3}, timeout=5,
    )  # fmt: skip
    if rank == 0:
        program.full_state_dict()  # ZeRO-3 shards every parameter: rank 0 needs rank 1, which never calls it
    return rank


def test_a_collective_called_on_one_rank_says_every_rank_must_call_it(ranks) -> None:
    with pytest.raises(RankFailure, match=r"full_state_dict\(\) is a collective: every rank must call it"):
        ranks(2).run(_full_state_on_rank_zero_only)
