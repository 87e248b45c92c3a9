"""What real ranks run in the torch.compile tests (importable by the spawned workers)."""

from __future__ import annotations

from typing import Any

import torch
from cases import adamw, build_case, train_local_batches
from torch import fx

import autoshard
from autoshard.graph_ops.weight_grad import WEIGHT_GRADS

_ops = torch.ops._c10d_functional
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def compile_with(case: Any, mesh: dict[str, int], plan: dict[str, Any], **options: Any) -> autoshard.Program:
    first = case.batches[0]
    return autoshard.compile(
        case.model,
        autoshard.Mesh(**mesh),
        example_inputs=first.inputs,
        example_kwargs=first.kwargs,
        loss_fn=case.loss_fn,
        optimizer=adamw,
        plan=plan,
        example_target=first.target,
        **options,
    )


def train_compiled(
    rank: int,
    world_size: int,
    family: str,
    mesh: dict[str, int],
    plan: dict[str, Any],
    backend: str | None,
    **shape: Any,
) -> dict[str, Any]:
    """One rank: compile (torch_compile with ``backend``, or eagerly when None), train, report."""
    case = build_case(family, **shape)
    options = {"torch_compile": True, "backend": backend} if backend is not None else {}
    program = compile_with(case, mesh, plan, **options)
    deferred_before = WEIGHT_GRADS.deferred_total
    losses, volumes = train_local_batches(program, case)
    return {
        "losses": losses,
        "weight_grads_deferred": WEIGHT_GRADS.deferred_total - deferred_before,  # held back by B for W
        "state": program.full_state_dict(),
        "volumes": volumes,
        "calls": [dict(program.comm.calls)],
        "compile_seconds": program.compile_seconds,
        "graphs": [str(g) for g in program.compiled_graphs],
        "explain": program.explain() if rank == 0 else "",
        "fused": [group["fused"] for group in program.optimizer.param_groups],
    }


def _first_user(node: fx.Node, position: dict[fx.Node, int]) -> fx.Node:
    return min(node.users, key=position.__getitem__)


def graph_facts(rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> dict[str, Any]:
    """Compile with aot_eager, take one step, and read the graphs the backend got: collectives by group,
    where each wait sits, and the matmuls between each data-parallel bucket's reduction and its wait."""
    case = build_case(family)
    program = compile_with(case, mesh, plan, torch_compile=True, backend="aot_eager")
    eager = compile_with(build_case(family), mesh, plan)
    compiled_losses, compiled_volumes = train_local_batches(program, case)
    eager_losses, eager_volumes = train_local_batches(eager, build_case(family))
    rt = program.runtime
    dp_name, tp_name = rt.dp_group.group_name, rt.tp.group_name if rt.tp is not None else None
    facts: dict[str, Any] = {"waits_late": True, "matmuls_in_flight": [], "collectives": []}
    for record in program.compiled_graphs:
        nodes = list(record.gm.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        for node in nodes:
            if node.target is _ops.wait_tensor.default and node.users:
                facts["waits_late"] &= node.next is _first_user(node, position)
            if node.op != "call_function" or getattr(node.target, "namespace", "") != "_c10d_functional":
                continue
            if node.target is _ops.wait_tensor.default:
                continue
            group = {dp_name: "dp", tp_name: "tp"}.get(node.args[-1], node.args[-1])
            facts["collectives"].append((record.kind, node.target._overloadpacket.__name__, group))
            (wait,) = node.users
            assert wait.target is _ops.wait_tensor.default
            if record.kind == "backward" and group == "dp":
                between = nodes[position[node] + 1 : position[wait]]
                facts["matmuls_in_flight"].append(sum(n.target in MATMULS for n in between))
    facts["losses"] = (compiled_losses, eager_losses)
    facts["volumes"] = (compiled_volumes, eager_volumes)
    facts["state"] = program.full_state_dict()
    recorded: dict[str, int] = {}
    for record in program.compiled_graphs:
        for name, nbytes in record.collectives:
            recorded[name] = recorded.get(name, 0) + nbytes
    facts["recorded"] = recorded
    return facts


def in_graph_bucket_facts(rank: int, world_size: int, family: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Plain dp compiled with aot_eager: what the backward graphs take and return, and where the gradients live."""
    import warnings

    case = build_case(family)
    program = compile_with(case, {"dp": world_size}, plan, torch_compile=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = train_local_batches(program, case)
    holder = program.runtime.holder
    storages = {
        g: {p.grad.untyped_storage().data_ptr() for p in holder.layouts[g].params if p.grad is not None}
        for g in holder.order
    }
    backward = [r.gm for r in program.compiled_graphs if r.kind == "backward"]
    tangents = [sum(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes) for gm in backward]
    return {
        "losses": losses,
        "state": program.full_state_dict(),
        "in_graph": sorted(holder.in_graph),
        "groups": list(holder.order),
        "storages": {g: len(s) for g, s in storages.items()},
        "distinct": len(set().union(*storages.values())),
        "released": all(holder.buffers[g].numel() == 0 for g in holder.in_graph),
        "gradient_bytes": program.runtime.last_step_memory["gradients"],
        "bucket_bytes": sum(holder.layouts[g].numel * 4 for g in holder.order),
        "tangents": tangents,
        "warnings": [str(w.message)[:80] for w in caught if "boxed" in str(w.message)],
    }


def train_plans(rank: int, world_size: int, family: str, plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One rank, eager graphs: train under each plan in turn (dp over every rank)."""
    out = []
    for plan in plans:
        case = build_case(family)
        program = compile_with(case, {"dp": world_size}, plan)
        losses, volumes = train_local_batches(program, case)
        out.append({"losses": losses, "state": program.full_state_dict(), "volumes": volumes})
    return out


def train_single_device_autocast(family: str, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The autocast reference: fp32 parameters and optimizer, the model run under torch.autocast."""
    case = build_case(family)
    model = case.model.train()
    opt = adamw(model.parameters())
    losses = []
    for batch in case.batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype):
            out = model(*batch.inputs, **batch.kwargs)
            loss = case.loss_fn(out, batch.target) if case.loss_fn is not None else out.loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
