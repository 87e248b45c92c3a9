"""Checkpoints with torch.distributed.checkpoint: each rank writes only what it holds.

Keys are the original model's names, so a checkpoint saved under one plan loads under another (DCP
reshards the chunks):

    model.<key>              the tensor as the program computes with it (bf16 parameters in bf16)
    master.<key>             the fp32 master of a parameter, where it differs from the above
    optim.<key>.<name>       optimizer state (``exp_avg``, ``step``, ...), per element or scalar
    rng.<rank>.<generator>   each rank's random generators (restored on the same mesh only)

and ``autoshard.json`` beside them holds the step count, the optimizer's hyperparameters, the mesh
and the user's ``extra``. A save writes to a hidden directory and renames it when every rank has
finished, so a crash mid-save leaves the previous checkpoint whole. Loading reads everything into
new buffers first and changes the program's state only when every read succeeded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autoshard.checkpoint import regions as held  # what this rank holds, as regions of the stored tensors
from autoshard.checkpoint.chunks import PiecesLoadPlanner, PiecesSavePlanner, SafeReader
from autoshard.errors import InputError
from autoshard.runtime.optim import IMPLEMENTATION_FLAGS

if TYPE_CHECKING:
    from autoshard.runtime.rank import RankRuntime

__all__ = ["latest_checkpoint", "load", "resume", "save", "save_full"]

INFO = "autoshard.json"
FORMAT = 1


def _rng_state(rt: RankRuntime) -> dict[str, torch.Tensor]:
    out = {f"rng.{rt.rank}.cpu": torch.get_rng_state()}
    if rt.device.type == "cuda":
        out[f"rng.{rt.rank}.cuda"] = torch.cuda.get_rng_state(rt.device)
    for device, state in rt.tp._streams.items() if rt.tp is not None else ():
        out[f"rng.{rt.rank}.tp.{device}"] = state
    if rt.masks is not None:  # the single-device sequence dropout masks are drawn from
        out[f"rng.{rt.rank}.masks"] = rt.masks.state
    return out


def _mesh_of(rt: RankRuntime) -> dict[str, int]:
    return {"dp": rt.mesh.dp, "cp": rt.mesh.cp, "tp": rt.mesh.tp, "pp": rt.mesh.pp}


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _agree(rt: RankRuntime, message: str | None) -> None:
    """Raise the first rank's complaint on every rank (so that no rank starts a collective alone)."""
    box = [message]
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message, group=rt.world_group)
        box = [next((m for m in messages if m), None)]
    if box[0]:
        raise InputError(box[0])


def save(rt: RankRuntime, path: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write this rank's shards, its random state and (rank 0) the info file; atomic. A collective."""
    path = Path(path)
    try:
        info_extra = json.loads(json.dumps(extra))
        problem = None
    except (TypeError, ValueError) as error:
        problem = f"save(extra=...) must be JSON data (numbers, strings, lists, dicts): {error}"
    partial = path.parent / f".{path.name}.partial"
    if problem is None and rt.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and not (path / INFO).is_file():
                problem = f"{path} exists and is not an autoshard checkpoint; choose another path"
            elif not os.access(path.parent, os.W_OK):
                problem = f"cannot write a checkpoint in {path.parent}: no write permission"
            else:
                shutil.rmtree(partial, ignore_errors=True)  # what a crashed save left
        except OSError as error:
            problem = f"cannot write a checkpoint at {path}: {error}"
    _agree(rt, problem)
    regions = held.model_regions(rt) + held.master_regions(rt)
    if rt.optimizer is not None:
        regions += held.optimizer_regions(rt, {id(p): s for p, s in rt.optimizer.state.items()})
    state: dict[str, Any] = {**held.as_pieces(regions), **_rng_state(rt)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), planner=PiecesSavePlanner(),
             process_group=rt.world_group, no_dist=not dist.is_initialized())  # fmt: skip
    if rt.rank == 0:
        groups = [
            {k: _jsonable(v) for k, v in group.items() if k != "params"}
            for group in (rt.optimizer.param_groups if rt.optimizer is not None else [])
        ]
        info = {"format": FORMAT, "step": rt.steps, "world_size": rt.mesh.size, "mesh": _mesh_of(rt),
                "plan": str(rt.plan), "param_groups": groups, "extra": info_extra, "saved_at": time.time()}  # fmt: skip
        (partial / INFO).write_text(json.dumps(info, indent=1))
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)  # a crash between the two renames left it
        if path.exists():
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=rt.world_group)
    return path


def read_info(path: str | os.PathLike) -> tuple[dict, Any]:
    """The info file and DCP's metadata of a checkpoint directory; InputError naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"no checkpoint at {path}: not a directory")
    try:
        info = json.loads((path / INFO).read_text())
    except FileNotFoundError:
        raise InputError(f"{path} is not an autoshard checkpoint (no {INFO}); pass a directory save() wrote") from None
    except (OSError, ValueError) as error:
        raise InputError(f"{path / INFO} is unreadable or corrupted: {error}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise InputError(f"{path / INFO}: not a checkpoint of format {FORMAT}")
    try:
        metadata = SafeReader(path).read_metadata()
    except Exception as error:  # missing, truncated or tampered: DCP's metadata file
        raise InputError(f"{path}: the checkpoint's metadata is missing or corrupted ({error})") from None
    return info, metadata


def _check_model_keys(rt: RankRuntime, stored: dict[str, Any]) -> None:
    placements = rt.compiled.placements
    model_keys = {fqn.removeprefix("model.") for fqn in stored if fqn.startswith("model.")}
    missing, unexpected = sorted(set(placements) - model_keys), sorted(model_keys - set(placements))
    if missing or unexpected:
        raise InputError(
            f"the checkpoint is of another model: {len(missing)} of the model's keys missing from it "
            f"{missing[:5]}, {len(unexpected)} keys the model lacks {unexpected[:5]}"
        )
    for key, placement in placements.items():
        for fqn in (f"model.{key}", f"master.{key}"):
            if fqn in stored and tuple(stored[fqn].size) != tuple(placement.shape):
                got, want = tuple(stored[fqn].size), tuple(placement.shape)
                raise InputError(f"{key}: shape {got} in the checkpoint, {want} in the model")


def _load_into_new_buffers(
    rt: RankRuntime, path: Path, regions: list[held.Region], plain: dict[str, torch.Tensor]
) -> list[tuple]:
    """Read ``regions`` and ``plain`` tensors from the checkpoint into new buffers; (live, new) pairs."""
    pairs, shadow = [], []
    for region in regions:
        new = torch.empty_like(region.storage)
        pairs.append((region.storage, new))
        shadow.append(dataclasses.replace(region, storage=new))
    state: dict[str, Any] = {**held.as_pieces(shadow), **plain}
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=PiecesLoadPlanner(),
                 process_group=rt.world_group, no_dist=not dist.is_initialized())  # fmt: skip
    except (Exception, CheckpointException) as error:  # a truncated or corrupted data file: every rank raises
        raise InputError(f"could not read the checkpoint at {path}: {str(error).strip()[:2000]}") from None
    return pairs


def load(rt: RankRuntime, path: str | os.PathLike) -> dict | None:
    """Restore what ``save`` wrote, resharded to this program's plan; returns the saved ``extra``."""
    path = Path(path)
    info, metadata = read_info(path)
    stored = metadata.state_dict_metadata
    _check_model_keys(rt, stored)
    # Parameters take the most precise stored value: the fp32 master where one was saved. A tied weight's
    # master is stored under one of its keys: every key of the tensor reads it (else the last key's
    # rounded value would win).
    master_of: dict[int, str] = {}
    for key, tensor in rt.tensors.items():
        if f"master.{key}" in stored:
            master_of.setdefault(id(tensor), f"master.{key}")
    source = {k: master_of[id(t)] for k, t in rt.tensors.items() if id(t) in master_of}
    regions = held.model_regions(rt, source)
    states: dict[int, dict[str, torch.Tensor]] = {}
    if rt.optimizer is not None:
        groups = info["param_groups"]
        if groups and len(groups) != len(rt.optimizer.param_groups):
            raise InputError(
                f"the checkpoint's optimizer has {len(groups)} parameter groups, this program's "
                f"{len(rt.optimizer.param_groups)}"
            )
        # torch's rule for scalar state (the step count): on the host, except for fused or capturable kernels
        kernels_on_device = [g for g in rt.optimizer.param_groups if g.get("fused") or g.get("capturable")]
        on_device = {id(p) for g in kernels_on_device for p in g["params"]}
        for opt_param, covered in held.optimizer_params(rt):
            prefix = f"optim.{covered[0][0]}."
            names = [f.removeprefix(prefix) for f in stored if f.startswith(prefix) and "." not in f[len(prefix) :]]
            scalar_device = opt_param.device if id(opt_param) in on_device else torch.device("cpu")
            states[id(opt_param)] = {
                name: torch.zeros(
                    () if not stored[prefix + name].size else opt_param.shape,
                    dtype=stored[prefix + name].properties.dtype,
                    device=scalar_device if not stored[prefix + name].size else opt_param.device,
                )
                for name in names
            }
        regions += held.optimizer_regions(rt, states)
    same_mesh = info["world_size"] == rt.mesh.size and {"cp": 1, **info["mesh"]} == _mesh_of(rt)
    mine = f"rng.{rt.rank}."
    rng = {  # every generator this rank saved, including streams this program has not drawn from yet
        fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for fqn, md in stored.items()
        if fqn.startswith(mine)
    }
    rng = rng if same_mesh else {}
    pairs = _load_into_new_buffers(rt, path, regions, rng)
    master_pairs = []
    if rt.holder.masters is not None and rt.holder.masters.separate:
        master_pairs = _load_into_new_buffers(rt, path, held.master_regions(rt, source), {})
    # Everything read: now change the program's state.
    with torch.no_grad():
        for live, new in pairs + master_pairs:
            if live.data_ptr() != new.data_ptr():
                live.copy_(new)
    if rt.optimizer is not None:
        by_id = {id(p): p for p, _ in held.optimizer_params(rt)}
        for pid, state in states.items():
            if state:
                rt.optimizer.state[by_id[pid]] = state
        for group, saved in zip(rt.optimizer.param_groups, info["param_groups"]):
            for name, value in saved.items():
                if name in IMPLEMENTATION_FLAGS:  # this program's kernel choice, not training state
                    continue
                current = group.get(name)
                group[name] = tuple(value) if isinstance(current, tuple) else value
    _restore_rng(rt, rng, same_mesh, info)
    rt.steps = info["step"]
    return info["extra"]


def _restore_rng(rt: RankRuntime, rng: dict[str, torch.Tensor], same_mesh: bool, info: dict) -> None:
    if not same_mesh:
        warnings.warn(
            f"random state not restored: saved on mesh {info['mesh']}, loading on {_mesh_of(rt)}; dropout "
            "and other random streams continue from this program's seed",
            stacklevel=3,
        )
        return
    for key, state in rng.items():
        kind = key.split(".", 2)[2]
        if kind == "cpu":
            torch.set_rng_state(state)
        elif kind == "cuda":
            torch.cuda.set_rng_state(state, rt.device)
        elif kind == "masks":
            if rt.masks is not None:
                rt.masks.state = state
        else:
            rt.tp._streams[kind.removeprefix("tp.")] = state


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory`` (by saved step, then time), or None."""
    found = []
    for child in Path(directory).iterdir() if Path(directory).is_dir() else ():
        if child.name.startswith(".") or not (child / ".metadata").is_file():
            continue
        try:
            info = json.loads((child / INFO).read_text())
            found.append((info["step"], info["saved_at"], child))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(found)[2] if found else None


def resume(rt: RankRuntime, directory: str | os.PathLike) -> Path | None:
    """Load the newest complete checkpoint under ``directory`` if there is one (rank 0 looks, so every
    rank loads the same one even while another job writes there); the path loaded, or None."""
    found = [str(latest_checkpoint(directory) or "")] if rt.rank == 0 else [None]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0, group=rt.world_group)
    if not found[0]:
        return None
    load(rt, found[0])
    return Path(found[0])


def save_full(rt: RankRuntime, path: str | os.PathLike, *, masters: bool = True) -> Path | None:
    """One safetensors file of the consolidated model (rank 0 writes it; a collective). With fp32
    masters (bf16 parameters), the masters unless ``masters=False``. ``path``: the file, or a folder that
    gets ``model.safetensors``; a Hugging Face model's ``config.json`` is written beside it, so
    ``from_pretrained(folder)`` loads it."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = path.parent / f".{path.name}.parts"
    save(rt, parts)
    if rt.rank == 0:
        _, metadata = read_info(parts)
        stored = metadata.state_dict_metadata
        full = {}
        for key in rt.compiled.placements:
            fqn = f"master.{key}" if masters and f"master.{key}" in stored else f"model.{key}"
            full[key] = torch.empty(tuple(stored[fqn].size), dtype=stored[fqn].properties.dtype)
        reading = {(f"master.{k}" if masters and f"master.{k}" in stored else f"model.{k}"): v for k, v in full.items()}
        dcp.load(reading, storage_reader=SafeReader(parts), no_dist=True)
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
        shutil.rmtree(parts, ignore_errors=True)
        config = getattr(rt.compiled.model, "config", None)
        if hasattr(config, "to_json_file"):  # a Hugging Face PretrainedConfig
            config.to_json_file(str(path.parent / "config.json"))
    if dist.is_initialized():
        dist.barrier(group=rt.world_group)
    return path if rt.rank == 0 else None
