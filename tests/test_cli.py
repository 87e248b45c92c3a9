"""The command line end to end: every subcommand, --json, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoshard.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_lists_candidates_best_first(capsys) -> None:
    code, out, _ = _run(capsys, "plan", "cli_factories:tiny_gpt", "--world", "8", "--hardware", "h100-80gb", "--json")
    assert code == 0
    candidates = json.loads(out)
    assert len(candidates) == 8 and candidates[0]["fits"]
    assert {"plan", "step_time_s", "memory_bytes", "mfu", "why"} <= set(candidates[0])
    code, out, _ = _run(capsys, "plan", "cli_factories:pair", "--world", "2")
    first, second = out.splitlines()[:2]  # what was planned for, on which hardware; then why the winner won
    assert code == 0 and first == "SquaredOutput: 0.00M parameters; assuming CPU core (preset)"
    assert second.startswith("why: Plan(") and "fits" in second


def test_explain_and_report_compile_offline(capsys, tmp_path: Path) -> None:
    args = ("--model", "llama", "--mesh", "tp=2,pp=2", "--plan", "microbatches=2", "schedule=gpipe")
    code, out, _ = _run(capsys, "explain", *args)
    assert code == 0 and "plan: Plan(dp=1, tp=2, pp=2, zero=0, schedule=gpipe, microbatches=2" in out
    code, out, _ = _run(capsys, "explain", *args, "--json")
    assert code == 0 and json.loads(out)["plan"].startswith("Plan(dp=1, tp=2, pp=2")
    code, out, _ = _run(capsys, "report", *args, "--out", str(tmp_path / "r.html"), "--json")
    assert code == 0 and json.loads(out)["report"] == str(tmp_path / "r.html")
    assert "Pipeline timeline" in (tmp_path / "r.html").read_text()


def test_verify_runs_local_ranks(capsys) -> None:
    code, out, _ = _run(capsys, "verify", "--model", "gpt2", "--mesh", "tp=2", "--batch", "4", "--seq", "8", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["first_divergence"] is None and report["checked"] > 100


@pytest.mark.slow  # the demo itself runs in tests/test_examples.py
def test_demo_subcommand(capsys) -> None:
    code, out, _ = _run(capsys, "demo", "--ranks", "2", "--steps", "2")
    assert code == 0 and "OK: distributed training matches single-device training" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "no_such_module:f"], "cannot import 'no_such_module'"),
        (["explain", "cli_factories:absent"], "cli_factories has no function 'absent'"),
        (["explain", "cli_factories"], "is not MODULE:FACTORY"),
        (["explain", "cli_factories:raises"], "cli_factories:raises raised RuntimeError: no weights here"),
        (["explain", "cli_factories:wrong_shape"], "cli_factories:wrong_shape returned list"),
        (["plan", "--model", "gpt2", "--mesh", "dp=two"], "--mesh 'dp=two' does not parse"),
        (["plan", "--model", "gpt2", "--mesh", "dp=2,tp=2", "--world", "8"], "has 4 ranks but --world is 8"),
        (["plan", "--model", "gpt2", "--world", "2", "--hardware", "tpu"], "no hardware preset 'tpu'"),
        (["plan", "--model", "gpt2", "--world", "2", "--plan", "zero"], "--plan 'zero' is not key=value"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


# What a user types after --plan, and what the chosen plan then shows (or the one-line error).
PLAN_WORDS = [
    (("--world", "2"), ("zero=3",), "zero=3"),
    (("--world", "2"), ("offload=true",), "offload"),
    (("--world", "2"), ("zero=2", "offload=yes"), "zero=2, offload"),
    (("--world", "2"), ("zero=1", "param_dtype=bf16"), "param_dtype=bfloat16"),
    (("--world", "2"), ("autocast=torch.bfloat16",), "autocast=bfloat16"),
    (("--world", "2"), ("recompute=full",), "recompute=full"),
    (("--world", "2"), ("bucket_mb=1",), "bucket=1MiB"),
    (("--world", "2"), ("dropout_masks=single_device",), "dropout_masks=single_device"),
    (("--mesh", "pp=2"), ("schedule=GPipe", "microbatches=2"), "schedule=gpipe, microbatches=2"),
    (("--mesh", "tp=2"), ("sequence_parallel=on",), "sequence_parallel"),
]


@pytest.mark.parametrize(("where", "words", "shown"), PLAN_WORDS, ids=[" ".join(w[1]) for w in PLAN_WORDS])
def test_plan_words_a_user_types(capsys, where: tuple, words: tuple, shown: str) -> None:
    code, out, err = _run(capsys, "plan", "--model", "gpt2", *where, "--plan", *words)
    assert code == 0, err
    why = out.splitlines()[1]
    assert why.startswith("why: Plan(") and shown in why.split(")")[0], why


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (("zero=three",), "plan field zero='three' must be one of 0, 1, 2, 3"),
        (("zeros=3",), "did you mean 'zero'"),
        (("offload=maybe",), "offload='maybe' must be True or False"),
        (("microbatches=0",), "microbatches=0 must be a positive integer"),
        (("zero=1", "param_dtype=int8"), "param_dtype='int8' is not a dtype"),
        (("schedule=zb",), "schedule='zb' must be one of"),
    ],
)
def test_plan_words_that_mean_nothing_are_one_line(capsys, words: tuple, message: str) -> None:
    code, out, err = _run(capsys, "plan", "--model", "gpt2", "--world", "2", "--plan", *words)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err
