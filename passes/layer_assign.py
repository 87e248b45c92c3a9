"""Layer names: which layer of the model each node belongs to, for per-layer reports and stage cuts.

Reads:  node.meta["nn_module_stack"] (recorded by torch.export), get_attr targets
Writes: autoshard.layer (str) on every node but the output

A layer is the module path up to and including the first numeric component (``transformer.h.3``:
one block of a ModuleList), else the first two components of the deepest module path
(``transformer.wte``, ``lm_head``). Work done by the model's own forward outside any submodule is
``(top)``, the loss function's is ``(loss)``, and graph inputs are ``(inputs)``.
"""

from __future__ import annotations

from torch import fx

from autoshard.ir.meta import LAYER, MODEL_ATTR

from .infra import CALLS, Need, Pass, PassResult

__all__ = ["PASS", "layer_of_path", "run"]


def layer_of_path(path: str) -> str:
    parts = path.split(".") if path else []
    if not parts:
        return "(loss)"
    if parts[0] != MODEL_ATTR:
        return "(loss)"  # a submodule of the loss function
    parts = parts[1:]
    if not parts:
        return "(top)"
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def _deepest_module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _type = list(stack.values())[-1]
    return path


def run(gm: fx.GraphModule) -> PassResult:
    layers: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            layer = "(inputs)"
        elif node.op == "get_attr":
            module_path = node.target.rsplit(".", 1)[0] if "." in node.target else ""
            layer = layer_of_path(module_path)
        else:
            path = _deepest_module_path(node)
            layer = "(inputs)" if path is None else layer_of_path(path)
        node.meta[LAYER] = layer
        if layer not in layers:
            layers.append(layer)
    return PassResult("layer_assign", False, f"{len(layers)} layers")


PASS = Pass("layer_assign", reads=(Need("nn_module_stack", CALLS),), writes=(Need(LAYER),), run=run)
