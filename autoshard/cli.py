"""The `autoshard` command line: plan, explain, report, verify and demo.

    autoshard plan    MODULE:FACTORY --world 64 --hardware h100-80gb [--json]
    autoshard explain MODULE:FACTORY --mesh dp=2,tp=2 --plan zero=3
    autoshard report  --model gpt2 --mesh dp=2,pp=2 --out report.html
    autoshard verify  --model llama --mesh tp=2,pp=2 --plan microbatches=2
    autoshard demo

``MODULE:FACTORY`` names a function returning ``(model, example_inputs)`` or a dict with ``model``,
``inputs`` and optionally ``kwargs``, ``loss_fn``, ``target``; it is called with ``batch=`` and
``seq=`` when it takes them. ``--model gpt2|llama|bert`` builds a small Hugging Face model instead.
Bad input (an import path, a factory, a mesh) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["CliError", "main", "parse_mesh"]


class CliError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def parse_mesh(text: str) -> Any:
    from autoshard.spec.mesh import Mesh

    degrees: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in ("dp", "cp", "tp", "pp") or not value.isdigit() or int(value) < 1 or name in degrees:
            raise CliError(
                f"--mesh {text!r} does not parse: write degrees as dp=2,tp=2,pp=2 (or cp=2; each once, positive)"
            )
        degrees[name] = int(value)
    return Mesh(**degrees)


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _parse_plan(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` words as plan fields: Python literals, bare words (schedule=1f1b, recompute=full), and the
    switches written as a shell user writes them (offload=true, sequence_parallel=yes)."""
    import dataclasses

    from autoshard.spec.plan import Plan

    switches = {f.name for f in dataclasses.fields(Plan) if f.type in (bool, "bool")}
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise CliError(f"--plan {pair!r} is not key=value (e.g. --plan zero=3 schedule=1f1b)")
        if key in switches and value.lower() in _TRUE + _FALSE:
            out[key] = value.lower() in _TRUE
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value.lower() if key == "schedule" else value  # a bare word: schedule=1F1B, recompute=full
    return out


def _load(spec: str | None, model_name: str | None, batch: int, seq: int) -> dict[str, Any]:
    if model_name is not None:
        from autoshard.models import build

        return build(model_name, batch, seq)
    if spec is None:
        raise CliError("name the model: MODULE:FACTORY (a function returning (model, inputs)) or --model gpt2")
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise CliError(f"{spec!r} is not MODULE:FACTORY (e.g. mymodels:build_gpt, a function in mymodels.py)")
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        why = f"cannot import {module_name!r} ({error}); check the module path and run from its directory"
        raise CliError(why) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CliError(f"{module_name} has no function {attr!r}; name a function that returns (model, inputs)")
    params = inspect.signature(factory).parameters
    wanted = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    try:
        made = factory(**wanted)
    except Exception as error:  # noqa: BLE001 - the user's factory: say what it raised, in one line
        first = str(error).splitlines()[0] if str(error) else ""
        raise CliError(f"{spec} raised {type(error).__name__}: {first}") from None
    return _normalize(spec, made)


def _normalize(spec: str, made: Any) -> dict[str, Any]:
    import torch

    if isinstance(made, tuple) and len(made) == 2:
        made = {"model": made[0], "inputs": made[1]}
    if not isinstance(made, dict) or not {"model", "inputs"} <= set(made):
        raise CliError(
            f"{spec} returned {type(made).__name__}; return (model, example_inputs) or a dict with "
            f"'model' and 'inputs' (and optionally 'kwargs', 'loss_fn', 'target')"
        )
    unknown = set(made) - {"model", "inputs", "kwargs", "loss_fn", "target"}
    if unknown:
        raise CliError(f"{spec} returned unknown keys {sorted(unknown)}; use model, inputs, kwargs, loss_fn, target")
    if not isinstance(made["model"], torch.nn.Module):
        raise CliError(f"{spec} returned a {type(made['model']).__name__} as the model; return a torch.nn.Module")
    inputs = made["inputs"]
    made["inputs"] = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return {"kwargs": None, "loss_fn": None, "target": None, **made}


def _mesh(args: argparse.Namespace) -> Any:
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if mesh is not None and args.world is not None and mesh.size != args.world:
        raise CliError(f"--mesh {args.mesh} has {mesh.size} ranks but --world is {args.world}; make them agree")
    if mesh is None and args.world is not None and args.world < 1:
        raise CliError(f"--world {args.world} is not a positive number of ranks")
    return mesh if mesh is not None else (args.world or 1)


def _hardware(name: str | None) -> Any:
    from autoshard.planner.hardware import Hardware

    return Hardware.preset(name) if name else None


def _run(args: argparse.Namespace) -> int:
    import autoshard

    if args.command == "demo":
        from autoshard.demo import main as demo_main

        return demo_main(ranks=args.ranks, steps=args.steps)
    made = _load(args.target, args.model, args.batch, args.seq)
    mesh, plan, hardware = _mesh(args), _parse_plan(args.plan), _hardware(args.hardware)
    common = dict(example_kwargs=made["kwargs"], loss_fn=made["loss_fn"], example_target=made["target"])
    if args.command == "plan":
        report = autoshard.plan(made["model"], mesh, made["inputs"], hardware=hardware, plan=plan, **common)
        if args.json:
            print(json.dumps([_candidate(c) for c in report.candidates[: args.top]], indent=1))
        else:
            print(f"{report.assumed()}\nwhy: {report.reason}\n{report.table(top=args.top)}")
        return 0
    if args.command == "verify":
        verified = autoshard.verify(made["model"], mesh, made["inputs"], plan=plan, **common)
        print(json.dumps(verified.to_dict(), indent=1, default=str) if args.json else verified)
        return 0 if verified.ok else 1
    program = autoshard.compile(made["model"], mesh, made["inputs"], plan=plan, hardware=hardware, **common)
    if args.command == "report":
        path = program.report(args.out)
        print(json.dumps({"report": str(path), "plan": str(program.plan)}) if args.json else f"wrote {path}")
        return 0
    if args.json:
        chosen = program.plan_report.chosen
        print(json.dumps({"plan": str(program.plan), "why": program.plan_report.reason, **_candidate(chosen)}))
    else:
        print(program.explain())
    return 0


def _candidate(c: Any) -> dict[str, Any]:
    return {
        "plan": str(c.plan), "step_time_s": c.step_time, "memory_bytes": dict(c.memory.items()),
        "memory_total_bytes": c.memory.total, "tflops_per_device": c.tflops_per_device, "mfu": c.mfu,
        "fits": c.fits, "why": c.why,
    }  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description="Compile PyTorch models into distributed programs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on local gloo ranks next to single-device training")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks (default 4)")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    helps = {
        "plan": "rank every plan for the world size (nothing runs)",
        "explain": "compile offline and print the plan, costs, stages and placements",
        "report": "compile offline and write the HTML report",
        "verify": "run one step on local gloo ranks against one device, node by node",
    }
    for name, text in helps.items():
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("target", nargs="?", help="MODULE:FACTORY returning (model, inputs) or a dict")
        cmd.add_argument("--model", choices=("gpt2", "llama", "bert"), help="a small Hugging Face model instead")
        cmd.add_argument("--world", type=int, help="number of ranks (the planner picks the degrees)")
        cmd.add_argument("--mesh", help="fixed degrees, e.g. dp=2,tp=2")
        cmd.add_argument("--hardware", help="a hardware preset: a100-80gb, h100-80gb, h200, cpu")
        cmd.add_argument("--batch", type=int, default=8, help="global batch for --model (default 8)")
        cmd.add_argument("--seq", type=int, default=32, help="sequence length for --model (default 32)")
        cmd.add_argument("--plan", nargs="*", default=[], metavar="KEY=VALUE", help="fix plan fields: zero=3 ...")
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "plan":
            cmd.add_argument("--top", type=int, default=8, help="candidates to show (default 8)")
        if name == "report":
            cmd.add_argument("--out", default="autoshard-report.html", help="the HTML file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    from autoshard.errors import AutoshardError

    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (CliError, AutoshardError) as error:
        print(f"autoshard {args.command}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
