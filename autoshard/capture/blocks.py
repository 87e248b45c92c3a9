"""Capture of a deep model on the meta device by tracing two and three of its repeated blocks.

torch.export takes about half a second per block of a 70B-class model, so an 80-layer Llama spends most
of its planning time being traced. Planning needs no weights, and the blocks of a ``ModuleList`` are
usually the same program on different parameters. So the list is cut to its first two blocks and
traced, then to its first three, and the third block of the second trace is checked to be exactly what
copying the second block of the first trace onto the next block's parameters gives (every node's op,
arguments, shapes and module path, and everything after the blocks). Only then are the other blocks
stamped the same way. Before any of that, every block must be the same module tree with the same
attributes (an integer equal to the block's index, such as ``layer_idx``, aside) and parameters of the
same shapes, so blocks configured differently (sliding-window layers every few blocks, a dense MLP in
the first ones) are traced in full. The stamped graph is the one a full trace makes; only models
whose parameters are all on the meta device, which cannot run, are captured this way.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard.ir.meta import MODEL_PREFIX, USER_RECOMPUTE

__all__ = [
    "MIN_BLOCKS", "TRACED", "RepeatedBlocks", "first_difference", "find_repeated_blocks", "stamp", "trace_stamped",
]  # fmt: skip

log = logging.getLogger("autoshard")

MIN_BLOCKS = 8  # below this a full trace is cheap, and stamping would save little
TRACED = (2, 3)  # blocks traced: the copy of block 1 is checked against the traced block 2
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}


@dataclass(frozen=True)
class RepeatedBlocks:
    """A ModuleList of same-program blocks: its path in the user's model and its length."""

    path: str
    count: int

    @property
    def graph_prefix(self) -> str:
        """The prefix of a block's module paths and parameter names in the captured graph."""
        return f"{MODEL_PREFIX}{self.path}."


def _leaves(key: tuple[Any, ...], value: Any, out: list[tuple[tuple[Any, ...], Any]], within: tuple[int, ...]) -> bool:
    """``value`` as comparable leaves under ``key``; False when it cannot be compared (the blocks differ).
    ``within``: the ids of the modules whose signatures are being taken."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        out.append((key, (type(value).__name__, value)))
    elif isinstance(value, (tuple, list)):
        out.append((key, (type(value).__name__, len(value))))
        return all(_leaves((*key, i), v, out, within) for i, v in enumerate(value))
    elif isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):  # hooks, keyed by their handles: not known to be alike
            return False
        out.append((key, ("dict", tuple(sorted(value)))))
        return all(_leaves((*key, k), value[k], out, within) for k in sorted(value))
    elif isinstance(value, nn.Module):  # held outside _modules (transformers' table of kernel functions)
        if id(value) in within:  # a module reached again (a reference back to a parent): not known alike
            return False
        signature = _signature(value, within)
        if signature is None:
            return False
        out.extend(((*key, *k), v) for k, v in signature)
    else:
        out.append((key, ("id", id(value))))  # shared objects (the config, a function) must be the same object
    return True


def _signature(block: nn.Module, within: tuple[int, ...] = ()) -> list[tuple[tuple[Any, ...], Any]] | None:
    """Everything about a block's module tree that can make its program differ from another block's."""
    out: list[tuple[tuple[Any, ...], Any]] = []
    within = (*within, id(block))
    for name, module in block.named_modules():
        out.append(((name,), ("type", type(module))))
        for attr, value in sorted(vars(module).items()):
            if attr not in _MODULE_STATE and not _leaves((name, attr), value, out, within):
                return None
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for key, t in table.items():
                if t is not None:
                    out.append(((name, kind, key), (tuple(t.shape), t.dtype, t.requires_grad)))
    return out


def _alike(signatures: list[list[tuple[tuple[Any, ...], Any]] | None]) -> bool:
    """Every block the same but for integers that equal each block's index (``layer_idx``)."""
    if any(s is None for s in signatures):
        return False
    first = signatures[0]
    if any(len(s) != len(first) for s in signatures):
        return False
    for position, (key, value) in enumerate(first):
        column = [s[position] for s in signatures]
        if any(k != key for k, _ in column):
            return False
        if all(v == value for _, v in column):
            continue
        if not all(v == ("int", i) for i, (_, v) in enumerate(column)):
            return False
    return True


def find_repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """The ModuleList with the most parameters whose (at least MIN_BLOCKS) blocks all share one signature."""
    best: tuple[int, RepeatedBlocks] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_BLOCKS:
            continue
        if not _alike([_signature(block) for block in module]):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, RepeatedBlocks(path, len(module)))
    return best[1] if best is not None else None


@contextlib.contextmanager
def _truncated(model: nn.Module, blocks: RepeatedBlocks, keep: int) -> Iterator[None]:
    module_list = model.get_submodule(blocks.path)
    whole = module_list._modules
    module_list._modules = OrderedDict(itertools.islice(whole.items(), keep))
    try:
        yield
    finally:
        module_list._modules = whole


def _within(path: str, head: str) -> bool:
    """``path`` is the module ``head`` or lies inside it (``layers.1.mlp`` in ``layers.1``, not ``layers.10``)."""
    return path == head or path.startswith(head + ".")


def _reindex(path: str, prefix: str, old: int, new: int) -> str:
    """``path`` moved from block ``old`` to block ``new`` when it lies in block ``old``."""
    head = f"{prefix}{old}"
    return f"{prefix}{new}{path[len(head) :]}" if _within(path, head) else path


def _in_block(node: fx.Node, prefix: str, index: int) -> bool:
    head = f"{prefix}{index}"
    if node.op == "get_attr":
        return isinstance(node.target, str) and _within(node.target, head)
    stack = node.meta.get("nn_module_stack") or {}
    return any(_within(path, head) for path, _ in stack.values())


def _segment(gm: fx.GraphModule, prefix: str, index: int) -> list[fx.Node] | None:
    """Block ``index``'s computing nodes when they run back to back (else None: not stampable)."""
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    inside = [i for i, n in enumerate(calls) if _in_block(n, prefix, index)]
    if not inside or inside != list(range(inside[0], inside[-1] + 1)):
        return None
    return calls[inside[0] : inside[-1] + 1]


def _reindexed_stack(stack: dict[str, tuple[str, Any]], prefix: str, old: int, new: int) -> dict[str, Any]:
    pattern = re.compile(re.escape(f"{prefix}{old}") + r"(?=\.|$)")
    return {pattern.sub(f"{prefix}{new}", key): (pattern.sub(f"{prefix}{new}", path), kind)
            for key, (path, kind) in stack.items()}  # fmt: skip


def stamp(
    gm: fx.GraphModule, model: nn.Module, blocks: RepeatedBlocks, traced: int, count: int
) -> fx.GraphModule | None:
    """``gm``, traced with ``traced`` blocks, with its last block copied onto blocks ``traced .. count-1``
    (in place, the new blocks' parameters taken from ``model``). Each copy reads the copy before it where
    the last block read the block before it, and what came after the blocks reads the last copy. None
    (``gm`` untouched) where the last two blocks do not run back to back, node for node alike."""
    prefix = blocks.graph_prefix
    graph = gm.graph
    last, before = _segment(gm, prefix, traced - 1), _segment(gm, prefix, traced - 2)
    if last is None or before is None or len(last) != len(before):
        return None
    if any(a.op != b.op or a.target != b.target for a, b in zip(last, before)):
        return None
    inside = set(last)
    readers_after = {user for node in last for user in node.users if user not in inside}
    last_attrs = [n for n in graph.nodes if n.op == "get_attr" and _in_block(n, prefix, traced - 1)]
    if not last_attrs:
        return None
    regions = itertools.count(1 + max((n.meta.get(USER_RECOMPUTE, -1) for n in graph.nodes), default=-1))
    after_blocks = last[-1].next
    attr_anchor = last_attrs[-1]
    from_block_before = dict(zip(before, last))  # what block ``index - 1`` holds where ``last`` read ``before``
    copies: dict[fx.Node, fx.Node] = {}
    for index in range(traced, count):
        attrs: dict[fx.Node, fx.Node] = {}
        for attr in last_attrs:  # the parameters in module order, as a trace lists them
            target = _reindex(attr.target, prefix, traced - 1, index)
            _attach(gm, model, target)
            with graph.inserting_before(attr_anchor.next):
                attrs[attr] = attr_anchor = graph.get_attr(target)
            attrs[attr].meta = dict(attr.meta)
        copies = {}
        region_of: dict[Any, int] = {}

        def lookup(arg: fx.Node, attrs: dict[fx.Node, fx.Node] = attrs, copies: dict[fx.Node, fx.Node] = copies,
                   from_block_before: dict[fx.Node, fx.Node] = from_block_before) -> fx.Node:  # fmt: skip
            for table in (copies, from_block_before, attrs):
                if arg in table:
                    return table[arg]
            return arg  # computed before the blocks (positions, masks): shared by every block

        with graph.inserting_before(after_blocks):
            for node in last:
                made = copies[node] = graph.node_copy(node, lookup)
                made.meta = dict(node.meta)
                if node.meta.get("nn_module_stack"):
                    made.meta["nn_module_stack"] = _reindexed_stack(
                        node.meta["nn_module_stack"], prefix, traced - 1, index
                    )
                if USER_RECOMPUTE in node.meta:
                    made.meta[USER_RECOMPUTE] = region_of.setdefault(node.meta[USER_RECOMPUTE], next(regions))
        from_block_before = {b: copies[a] for b, a in zip(before, last)}
    if copies:  # what came after the blocks reads the last copy
        for node in last:
            for user in list(node.users):
                if user in readers_after:
                    user.replace_input_with(node, copies[node])
    graph.lint()
    gm.recompile()
    return gm


def _value_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype,
                value.requires_grad)  # fmt: skip
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value))
    if isinstance(value, (tuple, list)):
        return tuple(_value_key(v) for v in value)
    return ("other", type(value).__name__)


def first_difference(traced: fx.GraphModule, stamped: fx.GraphModule) -> str | None:
    """The first node where two graphs differ (op, target, arguments, value shapes, module path,
    recompute region), or None where they are the same program."""
    mine, theirs = list(traced.graph.nodes), list(stamped.graph.nodes)
    if len(mine) != len(theirs):
        return f"{len(mine)} nodes traced, {len(theirs)} stamped"
    same: dict[fx.Node, fx.Node] = {}
    regions: tuple[dict[Any, int], dict[Any, int]] = ({}, {})

    def region(table: dict[Any, int], node: fx.Node) -> int | None:
        key = node.meta.get(USER_RECOMPUTE)
        return None if key is None else table.setdefault(key, len(table))

    for a, b in zip(mine, theirs):
        args = pytree.tree_map(lambda v: same.get(v, v) if isinstance(v, fx.Node) else v, (a.args, a.kwargs))
        if a.op != b.op or a.target != b.target or args != (b.args, b.kwargs):
            return f"{a.format_node()} traced, {b.format_node()} stamped"
        if _value_key(a.meta.get("val")) != _value_key(b.meta.get("val")):
            return f"{a.name}: value {a.meta.get('val')} traced, {b.meta.get('val')} stamped"
        stacks = [list((n.meta.get("nn_module_stack") or {}).values()) for n in (a, b)]
        if stacks[0] != stacks[1]:
            return f"{a.name}: module path {stacks[0][-1:]} traced, {stacks[1][-1:]} stamped"
        if region(regions[0], a) != region(regions[1], b):
            return f"{a.name}: recompute region differs"
        same[a] = b
    return None


def _attach(gm: fx.GraphModule, model: nn.Module, target: str) -> None:
    """The model's parameter or buffer ``target`` (a graph name, ``model.``-prefixed) held by ``gm`` too."""
    *path, name = target.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    value = getattr(model.get_submodule(".".join(path[1:])), name)
    if isinstance(value, nn.Parameter):
        owner.register_parameter(name, value)
    else:
        owner.register_buffer(name, value)


def trace_stamped(model: nn.Module, blocks: RepeatedBlocks, trace: Callable[[], tuple[fx.GraphModule, Any]]
                  ) -> tuple[fx.GraphModule, Any] | None:  # fmt: skip
    """``trace()`` (a GraphModule and what else it returns) with ``blocks`` cut to two and to three
    blocks; the three-block trace checked against the two-block one stamped, then stamped to every
    block. None when a trace fails or the check finds a difference: the caller traces in full."""
    try:
        with _truncated(model, blocks, TRACED[0]):
            small, small_rest = trace()
        with _truncated(model, blocks, TRACED[1]):
            larger, larger_rest = trace()
    except Exception as err:  # noqa: BLE001 - the full trace reports what is wrong with the model
        log.info("capture: %s cut to %s blocks did not trace (%s); tracing all %d", blocks.path, TRACED,
                 type(err).__name__, blocks.count)  # fmt: skip
        return None
    difference = "the outputs differ" if small_rest != larger_rest else None
    if difference is None:
        difference = (
            first_difference(larger, small)
            if stamp(small, model, blocks, *TRACED) is not None
            else "blocks laid out apart"
        )
    if difference is not None:
        log.info("capture: blocks of %s are not copies (%s); tracing all %d", blocks.path, difference, blocks.count)
        return None
    if stamp(larger, model, blocks, TRACED[1], blocks.count) is None:
        return None
    return larger, larger_rest
