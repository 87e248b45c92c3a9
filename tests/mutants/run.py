"""Mutation run: plant each bug of tests/mutants/ in a copy of the repository and check its tests catch it.

    python tests/mutants/run.py                   # every mutant in manifest.py
    python tests/mutants/run.py 01 zero3 holders  # those whose name or file contains any of these
    python tests/mutants/run.py --list            # the manifest, nothing run
    python tests/mutants/run.py --check           # only check that every patch applies
    python tests/mutants/run.py --baseline 05     # first run the selected mutants' tests unpatched

For each mutant: the tracked and untracked (not ignored) files are copied to a temporary directory,
the patch is applied with ``git apply``, ``autoshard/passes`` is linked to ``passes/`` (the package
maps it so), and the mutant's tests run there with ``PYTHONPATH`` pointing at the copy (the spawned
ranks inherit it). A mutant is caught when pytest fails (a test failed, or collection broke), and
survives when every selected test passes. Prints a table and the score; exits 1 unless every
mutant was caught. Not part of the default test run: pytest collects only tests/test_*.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@dataclass
class Mutant:
    """One planted bug: ``NN_name.patch`` here, changing ``file``; ``tests`` (and ``-k k``) must catch it."""

    name: str
    file: str
    why: str
    tests: list[str]
    k: str | None = None

    @property
    def patch(self) -> Path:
        return HERE / f"{self.name}.patch"


@dataclass
class Outcome:
    mutant: Mutant
    result: str  # caught, survived, did-not-apply, timeout, error
    seconds: float = 0.0
    caught_by: str = ""
    log: list[str] = field(default_factory=list)


def load_manifest() -> list[Mutant]:
    sys.path.insert(0, str(HERE))
    from manifest import MUTANTS

    mutants = [Mutant(**entry) for entry in MUTANTS]
    names = [m.name for m in mutants]
    if len(set(names)) != len(names):
        raise SystemExit("manifest.py names a mutant twice")
    return mutants


def repo_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, relative to the repository root."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout  # fmt: skip
    return sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})


def make_copy(files: list[str]) -> Path:
    copy = Path(tempfile.mkdtemp(prefix="autoshard-mutant-"))
    for rel in files:
        target = copy / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    # The installed package maps autoshard.passes to the top-level passes/ directory; a link does the same here.
    link = copy / "autoshard" / "passes"
    if not link.exists():
        link.symlink_to(Path("..") / "passes")
    return copy


def patched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def apply(mutant: Mutant, copy: Path) -> str | None:
    """Apply the patch in the copy; the reason it does not apply, or None."""
    if not mutant.patch.is_file():
        return f"no patch file {mutant.patch.name}"
    files = patched_files(mutant.patch)
    if files != [mutant.file]:
        return f"the patch changes {files}, the manifest says {mutant.file}"
    # Outside a repository git apply works as patch(1); GIT_DIR unset keeps it away from this repo.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    done = subprocess.run(["git", "apply", str(mutant.patch)], cwd=copy, env=env, capture_output=True, text=True)
    if done.returncode:
        return done.stderr.strip() or "git apply failed"
    return None


def pytest_command(tests: list[str], k: str | None) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    return command + (["-k", k] if k else [])


def run_tests(copy: Path, tests: list[str], k: str | None, timeout: float) -> tuple[int | None, str]:
    """Exit status of pytest in the copy (None on timeout) and its output."""
    env = {**os.environ, "PYTHONPATH": str(copy), "COLUMNS": "250"}  # wide: pytest's summary keeps the reason
    env.pop("PYTEST_ADDOPTS", None)
    # A session of its own, so a timeout ends pytest and the ranks it spawned together.
    proc = subprocess.Popen(
        pytest_command(tests, k), cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def first_failure(output: str) -> tuple[str, str]:
    """The first failed test's id and pytest's one-line reason, from the short summary."""
    for kind in ("FAILED", "ERROR"):
        found = re.search(rf"^{kind} (.+?)(?: - (.*))?$", output, flags=re.M)
        if found:
            return found[1], found[2] or ""
    return "", ""


def run_mutant(mutant: Mutant, files: list[str], timeout: float, keep: bool, check_only: bool) -> Outcome:
    start = time.perf_counter()
    copy = make_copy(files)
    try:
        problem = apply(mutant, copy)
        if problem:
            return Outcome(mutant, "did-not-apply", time.perf_counter() - start, log=[problem])
        if check_only:
            return Outcome(mutant, "applies", time.perf_counter() - start)
        rc, output = run_tests(copy, mutant.tests, mutant.k, timeout)
        seconds = time.perf_counter() - start
        tail = output.strip().splitlines()[-15:]
        if rc is None:
            return Outcome(mutant, "timeout", seconds, "(timed out)", tail)
        if rc == 0:
            return Outcome(mutant, "survived", seconds, log=tail)
        if rc in (1, 2):  # tests failed, or the mutant broke collection (an import error, say)
            test, reason = first_failure(output)
            return Outcome(mutant, "caught", seconds, test or f"pytest exit {rc}", [reason] if reason else [])
        return Outcome(mutant, "error", seconds, f"pytest exit {rc}", tail)  # 5: no tests ran; 3, 4: pytest broke
    finally:
        if keep:
            print(f"  kept {copy}", flush=True)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def baseline(mutants: list[Mutant], files: list[str], timeout: float) -> bool:
    """The selected mutants' tests on the unpatched code: each must pass, or a catch means nothing."""
    copy = make_copy(files)
    ok = True
    selections = list(dict.fromkeys((tuple(m.tests), m.k) for m in mutants))  # each selection once
    try:
        for tests, k in selections:
            rc, output = run_tests(copy, list(tests), k, timeout)
            status = "passes" if rc == 0 else "TIMEOUT" if rc is None else f"FAILS (pytest exit {rc})"
            print(f"baseline {' '.join(tests)}{f' -k {k!r}' if k else ''}: {status}", flush=True)
            if rc != 0:
                ok = False
                print("\n".join(output.strip().splitlines()[-15:]))
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return ok


def select(mutants: list[Mutant], patterns: list[str]) -> list[Mutant]:
    if not patterns:
        return mutants
    return [m for m in mutants if any(p in m.name or p in m.file for p in patterns)]


def describe_tests(mutant: Mutant) -> str:
    tests = " ".join(t.removeprefix("tests/") for t in mutant.tests)
    return f"{tests} -k '{mutant.k}'" if mutant.k else tests


def table(outcomes: list[Outcome]) -> str:
    rows = [("mutant", "file", "tests", "result", "caught by", "seconds")]
    for o in outcomes:
        rows.append((o.mutant.name, o.mutant.file, describe_tests(o.mutant), o.result, o.caught_by,
                     f"{o.seconds:.0f}"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    widths[2] = min(widths[2], 60)
    lines = []
    for r in rows:
        lines.append("  ".join(cell[: widths[i]].ljust(widths[i]) for i, cell in enumerate(r)).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", nargs="*", help="run the mutants whose name or file contains any of these")
    parser.add_argument("--list", action="store_true", help="print the selected mutants and their tests")
    parser.add_argument("--check", action="store_true", help="only check that each patch applies")
    parser.add_argument("--baseline", action="store_true", help="first run the selected tests on unpatched code")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant's tests (default 900)")
    parser.add_argument("--keep", action="store_true", help="keep each mutant's copy (printed)")
    parser.add_argument("-k", dest="k", help="run this -k expression instead of each mutant's own (other tests)")
    args = parser.parse_args(argv)

    manifest = load_manifest()
    strays = sorted({p.stem for p in HERE.glob("*.patch")} - {m.name for m in manifest})
    if strays:
        print(f"patches without a manifest entry (add them to manifest.py or delete them): {strays}")
    mutants = select(manifest, args.patterns)
    if args.k:
        mutants = [Mutant(m.name, m.file, m.why, m.tests, args.k) for m in mutants]
    if not mutants:
        print("no mutant matches", args.patterns)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.name}  {m.file}\n    {m.why}\n    tests: {describe_tests(m)}")
        return 0
    files = repo_files()
    if args.baseline and not baseline(mutants, files, args.timeout):
        print("the unpatched code fails some of these tests: fix that first")
        return 2
    outcomes = []
    for mutant in mutants:
        outcome = run_mutant(mutant, files, args.timeout, args.keep, args.check)
        outcomes.append(outcome)
        print(f"{mutant.name}: {outcome.result} {outcome.caught_by} ({outcome.seconds:.0f}s)", flush=True)
        if outcome.result != "applies":
            print("\n".join(f"    {line[:300]}" for line in outcome.log))
    print()
    print(table(outcomes))
    if strays:
        print(f"\npatches without a manifest entry: {strays}")
    if args.check:
        bad = [o for o in outcomes if o.result != "applies"]
        print(f"\n{len(outcomes) - len(bad)} of {len(outcomes)} patches apply")
        return 1 if bad else 0
    caught = [o for o in outcomes if o.result in ("caught", "timeout")]
    timeouts = sum(o.result == "timeout" for o in outcomes)
    note = f" ({timeouts} by timeout)" if timeouts else ""
    print(f"\nmutation score: {len(caught)} of {len(outcomes)} caught{note} ({100 * len(caught) / len(outcomes):.0f}%)")
    return 0 if len(caught) == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
