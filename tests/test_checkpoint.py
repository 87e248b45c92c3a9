"""Checkpoints on real gloo ranks: exact resume in new processes, resharding across plans, atomic
saves, export to a Hugging Face model, and bad checkpoints refused before anything changes."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_cases import (
    export_and_forward,
    killed_inside_save,
    load_and_train,
    load_errors,
    save_errors,
    train_and_save,
    train_straight,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dp_equivalence import assert_state_close

import autoshard
from autoshard.checkpoint.chunks import SafeReader
from autoshard.launch import LocalRanks, RankFailure

STEPS, FIRST = 6, 3


def _world(mesh: dict[str, int]) -> int:
    return mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)


RESUME = {
    "dp4-zero0": ("gpt2", {"dp": 4}, {"zero": 0}, {}),
    "dp2xtp2-zero1-dropout": ("gpt2", {"dp": 2, "tp": 2}, {"zero": 1}, {"dropout": 0.1}),
    "dp2xpp2-1f1b": ("llama", {"dp": 2, "pp": 2}, {"schedule": "1f1b", "microbatches": 2}, {}),
    "dp4-zero3-offload-bf16": ("gpt2", {"dp": 4}, {"zero": 3, "offload": True, "param_dtype": torch.bfloat16}, {}),
    "dp2xpp2-single-device-dropout": (
        "gpt2", {"dp": 2, "pp": 2}, {"dropout_masks": "single_device", "microbatches": 2},
        {"dropout": 0.1, "attention": "eager"},
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUME)
def test_resume_in_new_processes_is_bitwise_exact(ranks, tmp_path: Path, case: str) -> None:
    check_resume(ranks, tmp_path, case)


# All five with -m slow (40 s each here); every run draws one.
@settings(max_examples=1, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(list(RESUME)))
def test_resume_in_new_processes_is_bitwise_exact_sample(ranks, tmp_path: Path, case: str) -> None:
    check_resume(ranks, tmp_path / case, case)


def check_resume(ranks, tmp_path: Path, case: str) -> None:
    """6 steps straight vs 3, save, new processes, load, 3: the same losses and parameters, bit for bit."""
    family, mesh, plan, shape = RESUME[case]
    pool = ranks(_world(mesh))
    straight = pool.run(train_straight, family, mesh, plan, STEPS, **shape)[0]
    first = pool.run(train_and_save, family, mesh, plan, STEPS, FIRST, str(tmp_path / "step-3"), **shape)
    assert first[0]["steps"] == FIRST
    with LocalRanks(_world(mesh)) as fresh:  # new processes: only the checkpoint carries over
        resumed = fresh.run(load_and_train, family, mesh, plan, STEPS, str(tmp_path / "step-3"), **shape)
    assert resumed[0]["extra"] == {"next_batch": FIRST, "note": "resume"}
    assert resumed[0]["steps"] == FIRST
    for result in resumed:
        assert first[0]["losses"] + result["losses"] == straight["losses"]
    for key, value in straight["state"].items():
        assert torch.equal(resumed[0]["state"][key], value), key


@pytest.mark.slow
def test_each_rank_writes_only_its_shard(ranks, tmp_path: Path) -> None:
    """ZeRO-3 over 4 ranks: four data files of about a quarter of the state each, and the metadata."""
    mesh, plan = {"dp": 4}, {"zero": 3}
    ranks(4).run(train_and_save, "gpt2", mesh, plan, 2, 1, str(tmp_path / "ck"))
    files = {p.name: p.stat().st_size for p in (tmp_path / "ck").iterdir()}
    data = [size for name, size in files.items() if name.endswith(".distcp")]
    assert len(data) == 4 and {".metadata", "autoshard.json"} <= set(files)
    assert max(data) < 0.35 * sum(data)  # a shard each, plus the small replicated buffers
    # The embedding's chunks (its exp_avg's too) lie in all four files: every rank wrote its part.
    storage = SafeReader(tmp_path / "ck").read_metadata().storage_data
    for fqn in ("model.transformer.wte.weight", "optim.transformer.wte.weight.exp_avg"):
        assert len({info.relative_path for index, info in storage.items() if index.fqn == fqn}) == 4, fqn


RESHARD = [
    pytest.param({"dp": 2, "tp": 2}, {"zero": 3}, {"pp": 2, "dp": 2}, {"zero": 1}, marks=pytest.mark.slow),
    ({"dp": 2, "tp": 2}, {"zero": 3}, {"dp": 2}, {"zero": 0}),
]


@pytest.mark.parametrize(("mesh_a", "plan_a", "mesh_b", "plan_b"), RESHARD, ids=["to-pp2xdp2-zero1", "to-dp2"])
def test_a_checkpoint_loads_under_another_plan(ranks, tmp_path, mesh_a, plan_a, mesh_b, plan_b) -> None:
    """Saved under dp2 x tp2 ZeRO-3, loaded under another plan and world size, trains on like that plan
    would from the same state (its own straight run from the saved state)."""
    path = str(tmp_path / "ck")
    ranks(_world(mesh_a)).run(train_and_save, "llama", mesh_a, plan_a, STEPS, FIRST, path)
    resumed = ranks(_world(mesh_b)).run(load_and_train, "llama", mesh_b, plan_b, STEPS, path)[0]
    # Every plan trains like one device (the equivalence tests), so the first plan's straight run is
    # what the second plan, trained straight through from the saved state, gives.
    straight_a = ranks(_world(mesh_a)).run(train_straight, "llama", mesh_a, plan_a, STEPS)[0]
    assert resumed["losses"] == pytest.approx(straight_a["losses"][FIRST:], rel=1e-5)
    assert_state_close(resumed["state"], straight_a["state"])


def test_bad_checkpoints_are_refused_before_anything_changes(ranks, tmp_path: Path) -> None:
    pool, mesh = ranks(2), {"dp": 2}
    good = tmp_path / "good"
    pool.run(train_and_save, "gpt2", mesh, {}, 2, 1, str(good))
    pool.run(train_and_save, "llama", mesh, {}, 2, 1, str(tmp_path / "llama"))
    pool.run(train_and_save, "gpt2", mesh, {}, 2, 1, str(tmp_path / "vocab"), vocab=96)

    def broken(name: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        return copy

    truncated = broken("truncated")
    data = next(truncated.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    garbled = broken("garbled")
    (garbled / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    hostile = broken("hostile")  # a metadata file that would run a command if unpickled
    (hostile / ".metadata").write_bytes(pickle.dumps(os.system))
    bad_info = broken("bad-info")
    (bad_info / "autoshard.json").write_text("{ step: 3")
    no_meta = broken("no-metadata")
    (no_meta / ".metadata").unlink()
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "absent"): "no checkpoint at .*absent: not a directory",
        str(tmp_path / "empty"): "is not an autoshard checkpoint \\(no autoshard.json\\)",
        str(tmp_path / "llama"): "another model: \\d+ of the model's keys missing from it \\['transformer.h.0",
        str(
            tmp_path / "vocab"
        ): "transformer.wte.weight: shape \\(96, 32\\) in the checkpoint, \\(64, 32\\) in the model",
        str(truncated): "could not read the checkpoint at .*truncated",
        str(garbled): "metadata is missing or corrupted",
        str(hostile): "metadata is missing or corrupted .*names (posix|nt).system",
        str(bad_info): "autoshard.json is unreadable or corrupted",
        str(no_meta): "metadata is missing or corrupted",
    }
    for result in pool.run(load_errors, "gpt2", mesh, {}, list(cases)):
        for (path, pattern), outcome in zip(cases.items(), result):
            assert re.search(pattern, outcome["message"]), (path, outcome["message"])
            assert outcome["unchanged"], path


def test_bad_saves_are_refused_on_every_rank(ranks, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "not-a-checkpoint" / "notes.txt").write_text("keep me")
    attempts = [
        (str(tmp_path / "a-file" / "ck"), None),
        (str(tmp_path / "not-a-checkpoint"), None),
        (str(tmp_path / "ck"), {"scheduler": object()}),
    ]
    patterns = [
        "cannot write a checkpoint at .*a-file/ck",
        "not-a-checkpoint exists and is not an autoshard",
        "must be JSON data",
    ]
    for messages in ranks(2).run(save_errors, "gpt2", {"dp": 2}, attempts):
        for message, pattern in zip(messages, patterns):
            assert re.search(pattern, message), message
    assert (tmp_path / "not-a-checkpoint" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "ck").exists()


def test_a_rank_killed_inside_save_leaves_the_previous_checkpoint_whole(ranks, tmp_path: Path) -> None:
    family, mesh, plan = "gpt2", {"dp": 2}, {"zero": 2}
    straight = ranks(2).run(train_straight, family, mesh, plan, STEPS)[0]
    with LocalRanks(2, timeout=60) as doomed, pytest.raises(RankFailure, match="rank 1 died"):
        doomed.run(killed_inside_save, family, mesh, plan, STEPS, str(tmp_path))
    assert (tmp_path / ".step-4.partial").is_dir() and not (tmp_path / "step-4").exists()
    latest = autoshard.latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step-3"
    resumed = ranks(2).run(load_and_train, family, mesh, plan, STEPS, str(latest))[0]
    assert resumed["losses"] == straight["losses"][FIRST:]
    assert all(torch.equal(resumed["state"][k], v) for k, v in straight["state"].items())


def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path: Path) -> None:
    for name, step in [("a", 3), ("b", 10), ("c", 7)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
        (tmp_path / name / "autoshard.json").write_text(json.dumps({"step": step, "saved_at": 0.0}))
    (tmp_path / ".d.partial").mkdir()  # an interrupted save
    (tmp_path / "e").mkdir()  # no metadata: not complete
    (tmp_path / "e" / "autoshard.json").write_text(json.dumps({"step": 99, "saved_at": 0.0}))
    assert autoshard.latest_checkpoint(tmp_path) == tmp_path / "b"
    assert autoshard.latest_checkpoint(tmp_path / "nowhere") is None


@pytest.mark.parametrize(
    ("family", "mesh", "plan"),
    [
        pytest.param("gpt2", {"dp": 2, "tp": 2}, {"zero": 3}, marks=pytest.mark.slow),
        ("llama", {"pp": 2}, {"microbatches": 2}),
    ],
    ids=["gpt2-dp2xtp2-zero3", "llama-pp2"],
)
def test_save_full_loads_into_the_hugging_face_model(ranks, tmp_path: Path, family: str, mesh: dict, plan: dict):
    import transformers

    results = ranks(_world(mesh)).run(export_and_forward, family, mesh, plan, str(tmp_path))
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[family]
    model = cls.from_pretrained(tmp_path).eval()  # safetensors, read without unpickling
    with torch.no_grad():
        for result in results:
            expected = model(result["ids"], use_cache=False).logits
            torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)


def test_two_runs_of_the_same_program_are_bitwise_equal(ranks) -> None:
    mesh, plan = {"dp": 2, "tp": 2}, {"zero": 1}
    first, second = (ranks(4).run(train_straight, "gpt2", mesh, plan, 2, dropout=0.1)[0] for _ in range(2))
    assert first["losses"] == second["losses"]
    assert all(torch.equal(second["state"][k], v) for k, v in first["state"].items())
