"""Every code block of README.md and docs/ runs, the site builds strictly, and README stays short.

- A ``python`` block is a script. Its first line ``# torchrun --nproc-per-node N name.py`` runs it so, as
  ``name.py`` (N local gloo ranks); otherwise it runs with ``python``. Each runs in a fresh folder.
- A ``bash`` block runs line by line as a newcomer would type it, in the folder of its page's scripts (so
  ``torchrun ... train.py`` runs the script the page showed). Lines ending in ``&`` run in the background
  until ``wait``. ``examples/...`` resolves to the repository's. A line that installs (``pip install``) is
  the command CI itself runs (.ci/run) or the demo's, whose own command (``autoshard demo``) runs here.
- A ``text`` block preceded by ``<!-- the output of the block above -->`` must be what that block printed
  (its lines in order, ``...`` standing for any lines).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OUTPUT_MARK = "<!-- the output of the block above -->"


@dataclass
class Block:
    page: Path
    index: int
    language: str
    text: str
    checks_output: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}#{self.index}-{self.language}"


def blocks(page: Path) -> list[Block]:
    source = page.read_text()
    found = []
    for i, match in enumerate(re.finditer(r"(<!--[^\n]*-->\n)?```(\w*)\n(.*?)```", source, re.S)):
        found.append(Block(page, i, match.group(2), match.group(3), match.group(1) == OUTPUT_MARK + "\n"))
    return found


ALL = [b for page in PAGES for b in blocks(page)]
# The longest pages' blocks (15-30 s each) run under -m slow; the default run keeps the rest of every page.
SLOW_BLOCKS = {
    "docs/guides/inspection.md#0-python", "docs/guides/inspection.md#1-bash", "docs/guides/checkpoints.md#0-python",
    "docs/guides/planner.md#0-python", "docs/gpus-and-nodes.md#0-bash", "docs/guides/experts.md#0-python",
}  # fmt: skip


def _params(kept: list[Block]) -> list[Any]:
    return [pytest.param(b, id=b.id, marks=pytest.mark.slow if b.id in SLOW_BLOCKS else ()) for b in kept]


SCRIPTS = [b for b in ALL if b.language == "python"]
COMMANDS = [b for b in ALL if b.language == "bash"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str] | str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          shell=isinstance(cmd, str))  # fmt: skip
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def run_script(block: Block, folder: Path) -> str:
    first = block.text.splitlines()[0]
    launch = re.fullmatch(r"# torchrun --nproc-per-node (\d+) ([\w.]+\.py)", first.strip())
    name = launch.group(2) if launch else f"block{block.index}.py"
    (folder / name).write_text(block.text)
    if launch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", launch.group(1), name]
    else:
        cmd = [sys.executable, name]
    return _run(cmd, folder).stdout


def _matches(expected: str, printed: str) -> bool:
    """The expected lines appear in order in what was printed; ``...`` stands for any lines."""
    lines, at = printed.splitlines(), 0
    for want in expected.strip().splitlines():
        if want.strip() == "...":
            continue
        while at < len(lines) and lines[at].rstrip() != want.rstrip():
            at += 1
        if at == len(lines):
            return False
        at += 1
    return True


@pytest.mark.parametrize("block", _params(SCRIPTS))
def test_every_python_block_runs(block: Block, tmp_path: Path) -> None:
    printed = run_script(block, tmp_path)
    page = blocks(block.page)
    following = page[block.index + 1] if block.index + 1 < len(page) else None
    if following is not None and following.checks_output:
        assert _matches(following.text, printed), f"{block.id} printed:\n{printed[-3000:]}"


def _ci_commands() -> list[str]:
    return (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("block", _params(COMMANDS))
def test_every_command_block_runs(block: Block, tmp_path: Path) -> None:
    scripts = {re.fullmatch(r"# torchrun --nproc-per-node \d+ ([\w.]+\.py)", b.text.splitlines()[0].strip())
               for b in blocks(block.page) if b.language == "python"}  # fmt: skip
    shown = {m.group(1) for m in scripts if m}  # the page's scripts, which test_every_python_block_runs ran
    background: list[subprocess.Popen] = []
    for line in block.text.strip().splitlines():
        line = line.strip()
        if "pip install" in line:
            if "pytest" in line:  # the test command: CI's own
                assert line in _ci_commands()
            else:  # install, then the demo
                assert line.endswith("&& autoshard demo")
                _run([sys.executable, "-m", "autoshard.cli", "demo", "--ranks", "2", "--steps", "3"], tmp_path)
            continue
        if line == "wait":
            for proc in background:
                out, err = proc.communicate(timeout=600)
                assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
            background = []
            continue
        words = line.rstrip("&").split()
        if words[0] == "torchrun" and words[-1] in shown:
            continue  # the page's own script, run by its python block
        words = ["python", "-m", "torch.distributed.run", *words[1:]] if words[0] == "torchrun" else words
        words = [str(ROOT / w) if w.startswith("examples/") else w for w in words]
        words = [sys.executable if w == "python" else w for w in words]
        if words[0] == "autoshard":
            words = [sys.executable, "-m", "autoshard.cli", *words[1:]]
        if line.endswith("&"):
            background.append(subprocess.Popen(words, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True))  # fmt: skip
        else:
            _run(words, tmp_path)
    assert not background, "a block that starts commands in the background ends with wait"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    _run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], ROOT)
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_readme_is_short_and_every_page_is_in_the_site() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, page
