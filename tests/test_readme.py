"""README's test command is the one CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if "pytest" in line and line.startswith("(")]
    assert len(commands) == 1
    assert commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_saved_for_backward_excerpt_is_what_explain_prints() -> None:
    from cases import build_case

    import autoshard

    readme = (ROOT / "README.md").read_text()
    start = readme.index("saved for backward (passes.saved_tensors; recompute full)")
    excerpt = readme[start : readme.index("```", start)].strip().splitlines()
    case = build_case("gpt2")
    batch = case.batches[0]
    program = autoshard.compile(
        case.model, autoshard.Mesh(dp=2), example_inputs=batch.inputs, example_kwargs=batch.kwargs,
        plan={"recompute": "full"},
    )  # fmt: skip
    printed = program.explain().splitlines()
    first = printed.index(excerpt[0])
    assert printed[first : first + len(excerpt)] == excerpt
