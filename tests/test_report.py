"""program.report: the HTML page loads in headless Chromium with no console error, its screenshot is not
blank, and its key numbers are explain()'s; for a dp, a tp, a pp and a 3D program and a 1024-rank plan.

AUTOSHARD_SCREENSHOTS=docs python -m pytest tests/test_report.py saves the screenshots README.md links."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.demo import TinyGPT, next_token_loss, successor_batch

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (.ci/run installs it)")


def _compile_and_run(rank: int, world: int, mesh: autoshard.Mesh, plan: dict, path: str) -> dict:
    torch.manual_seed(0)
    ids, target = successor_batch(0, 8, 16)
    program = autoshard.compile(TinyGPT(), mesh, (ids,), loss_fn=next_token_loss, example_target=target,
                                optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), plan=plan)  # fmt: skip
    for step in range(2):
        ids, target = successor_batch(step, 8, 16)
        program.step(program.local_batch(ids), target=program.local_batch(target))
    written = program.report(path)
    return {"path": str(written) if written else None, "explain": program.explain() if rank == 0 else ""}


def _chromium(page: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *flags]
    return subprocess.run([*cmd, page.as_uri()], capture_output=True, text=True, timeout=120)


def _png_colours(data: bytes) -> int:
    """Distinct colours of an 8-bit RGB(A) PNG, decoded with zlib (no imaging library needed)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line[:stride:1]))
        prev = line
    return len({row[i : i + 3] for row in rows[::4] for i in range(0, len(row), channels * 4)})


def _check_page(page: Path, explain: str, name: str) -> None:
    dom = _chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    errors = re.search(r'<pre id="errors" hidden="">(.*?)</pre>', dom.stdout, re.S)
    assert errors is not None and errors.group(1).strip() == "", errors
    assert "Uncaught" not in dom.stderr and "CONSOLE" not in dom.stderr, dom.stderr[-2000:]
    # The key numbers are explain()'s: the plan, the predicted memory and step time.
    plan = re.search(r"^plan: (.*)$", explain, re.M).group(1)
    gib, ms = re.search(r"on [^:]*: ([\d.]+) GiB, ([\d.e+-]+) ms per step", explain).groups()
    cell = dict(re.findall(r'<td id="plan-(\w+)">([^<]*)</td>', dom.stdout))
    assert cell["plan"] == plan.replace("&", "&amp;") and cell["rank"] == f"{gib} GiB" and cell["time"] == f"{ms} ms"
    shot = page.with_suffix(".png")
    taken = _chromium(page, f"--screenshot={shot}", "--window-size=1280,1600", "--hide-scrollbars")
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    assert _png_colours(shot.read_bytes()) > 8  # not blank: text, bars and the timeline have colours
    if os.environ.get("AUTOSHARD_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["AUTOSHARD_SCREENSHOTS"]) / f"report-{name}.png")


@needs_chromium
@pytest.mark.parametrize(
    "name, mesh, plan",
    [("dp", autoshard.Mesh(dp=4), {}), ("tp", autoshard.Mesh(dp=2, tp=2), {"zero": 3}),
     ("pp", autoshard.Mesh(pp=2, dp=2), {"schedule": "1f1b", "microbatches": 4})],
)  # fmt: skip
def test_report_of_a_trained_program_opens_cleanly(ranks, tmp_path: Path, name: str, mesh, plan) -> None:
    results = ranks(4).run(_compile_and_run, mesh, plan, str(tmp_path / f"{name}.html"))
    assert [r["path"] is not None for r in results] == [True, False, False, False]  # rank 0 writes it
    page = Path(results[0]["path"])
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text  # nothing fetched at view time
    assert "rank 3 measured" in text and "Throughput measured" in text
    if mesh.pp > 1:
        assert "measured, last step" in text and "predicted" in text and text.count("<rect") > 20
    _check_page(page, results[0]["explain"], name)


@needs_chromium
@pytest.mark.parametrize(
    "name, mesh", [("3d", autoshard.Mesh(dp=2, tp=2, pp=2)), pytest.param("1024", 1024, marks=pytest.mark.slow)]
)
def test_report_of_an_offline_plan_opens_cleanly(tmp_path: Path, name: str, mesh) -> None:
    with torch.device("meta"):
        model = TinyGPT(layers=4) if name == "3d" else TinyGPT(vocab=32000, dim=1024, heads=16, layers=8)
    ids, target = successor_batch(0, 8 if name == "3d" else 2048, 16)
    program = autoshard.compile(model, mesh, (ids,), loss_fn=next_token_loss, example_target=target)
    page = program.report(tmp_path / f"{name}.html")
    assert program.mesh.size == (8 if name == "3d" else 1024)
    _check_page(page, program.explain(), name)
