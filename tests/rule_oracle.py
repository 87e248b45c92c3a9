"""An oracle for the sharding rules, as DTensor's op tests do with OpInfo samples.

``check(op, sample, placements, degree)`` builds a graph of one op (a few for ``getitem``) whose tensor
inputs are module attributes, gives them ``placements`` along tp, and lets the compiler do what it does
to a model: the rules propagate (``autoshard.sharding.propagate``), passes.tp_rewrite makes the local
program (local view sizes, vocab-parallel ops, the redistributions a rule wants). Each of ``degree``
ranks runs that program on its own piece of every input (its slice of a shard; a random share of a
partial value), in a thread, with the tp collectives computed among the threads. Joining the ranks'
outputs as the rule's output placement says must give the op on the full tensors: a replicated output
is the same on every rank, a shard joins back, a partial value sums. A rule that claims a placement it
cannot honour (a wrong dimension, a shard of a size that does not divide, a sum that is not linear)
fails here whatever models the other tests use.

``SAMPLES`` draws inputs for every op that has a rule; ``tests/test_rule_oracles.py`` walks them all.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from autoshard.passes import shape_prop, tp_rewrite
from hypothesis import strategies as st
from torch import fx

from autoshard.distributed import funcol
from autoshard.graph_ops.tp import UnboundTensorParallel
from autoshard.ir.meta import TP, TpPlacement
from autoshard.ir.placements import Partial, Placement, Replicate, Shard
from autoshard.sharding import propagate as propagation

aten = torch.ops.aten
R, P = Replicate(), Partial()
SIZES = (1, 2, 3, 4, 6, 12)  # divide by 2, 3 and their blocks, and not
DEGREES = (2, 3)


@dataclass
class Sample:
    """One call: ``args`` and ``kwargs`` with tensors in place; ``build`` makes the node under test."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    build: Callable[[fx.Graph, tuple, dict], fx.Node] | None = None
    same_values: bool = True  # False for ops whose values are undefined (empty): shapes and dtypes only

    def tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for a in (*self.args, *self.kwargs.values()):
            found.extend(t for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor))
        return found


# ---- the ranks ------------------------------------------------------------------------------------------


class _Collectives:
    """The tp collectives among ``degree`` threads: each puts its value, all read every rank's."""

    def __init__(self, degree: int) -> None:
        self.degree = degree
        self.barrier = threading.Barrier(degree, timeout=30)
        self.slots: list[Any] = [None] * degree
        self.local = threading.local()

    def exchange(self, value: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = value.detach().clone()
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody puts the next value before every rank has read this one
        return values

    def all_reduce(self, x: torch.Tensor, group_name: str, op: str = "sum", name: str = "") -> torch.Tensor:
        values = self.exchange(x)
        if op == "max":
            return torch.stack(values).amax(dim=0)
        assert op == "sum", op
        return sum(values[1:], values[0])

    def all_gather(self, x: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
        return torch.cat(self.exchange(x))

    def scatter_along(self, x: torch.Tensor, placement: Shard, size: int, group_name: str, rank: int) -> torch.Tensor:
        values = self.exchange(x)
        return placement.local(sum(values[1:], values[0]), rank, size).contiguous()


class _RankTp(UnboundTensorParallel):
    """A rank's ``tp`` module under the oracle: its rank; the collectives go to ``_Collectives``."""

    def __init__(self, degree: int, rank: int) -> None:
        super().__init__(degree)
        self.rank = rank

    @property
    def group_name(self) -> str:
        return "oracle"

    @contextlib.contextmanager
    def rank_stream(self, device: torch.device) -> Iterator[None]:
        yield


@contextlib.contextmanager
def _collectives(degree: int) -> Iterator[_Collectives]:
    collectives = _Collectives(degree)
    saved = {name: getattr(funcol, name) for name in ("all_reduce", "all_gather", "scatter_along")}
    for name in saved:
        setattr(funcol, name, getattr(collectives, name))
    try:
        yield collectives
    finally:
        for name, fn in saved.items():
            setattr(funcol, name, fn)


def _run_ranks(programs: list[fx.GraphModule], collectives: _Collectives) -> list[Any]:
    results: list[Any] = [None] * len(programs)
    errors: list[BaseException | None] = [None] * len(programs)

    def run(rank: int) -> None:
        collectives.local.rank = rank
        try:
            with torch.no_grad():
                results[rank] = programs[rank]()
        except BaseException as error:  # noqa: BLE001 - every rank's failure is reported
            errors[rank] = error
            collectives.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None:
        raise first
    return results


# ---- the check -------------------------------------------------------------------------------------------


class Oracle(AssertionError):
    """The rule's claim does not hold for this sample."""


def _pieces(full: torch.Tensor, placement: Placement, degree: int, generator: torch.Generator) -> list[torch.Tensor]:
    if isinstance(placement, Shard):
        return [placement.local(full, r, degree).clone() for r in range(degree)]
    if isinstance(placement, Partial):  # eighths, as the samples: the shares sum back exactly
        shares = [torch.randint(-16, 17, full.shape, generator=generator).to(full.dtype) / 8 for _ in range(degree - 1)]
        return [*shares, full - sum(shares, torch.zeros_like(full))]
    return [full.clone() for _ in range(degree)]


def _graph(op: Any, sample: Sample) -> tuple[fx.GraphModule, list[str], fx.Node]:
    root = torch.nn.Module()
    graph = fx.Graph()
    names: list[str] = []

    def attr(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        name = f"input{len(names)}"
        root.register_buffer(name, t)
        names.append(name)
        return graph.get_attr(name)

    args = tuple([attr(t) for t in a] if isinstance(a, list) else attr(a) for a in sample.args)
    kwargs = {k: attr(v) for k, v in sample.kwargs.items()}
    node = sample.build(graph, args, kwargs) if sample.build else graph.call_function(op, args, kwargs)
    graph.output(node)
    gm = fx.GraphModule(root, graph)
    for n, value in _values(gm).items():
        n.meta["val"] = value
    shape_prop.run(gm)
    return gm, names, node


def _values(gm: fx.GraphModule) -> dict[fx.Node, Any]:
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n] = result = super().run_node(n)
            return result

    Recorder(gm).run()
    return {n: v for n, v in values.items() if n.op != "output"}


def _same(expected: Any, got: Any, what: str, values: bool = True) -> None:
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            raise Oracle(f"{what}: {len(expected)} outputs expected, got {got!r}")
        for i, (e, g) in enumerate(zip(expected, got)):
            _same(e, g, f"{what}[{i}]", values)
        return
    if not isinstance(expected, torch.Tensor):
        if expected != got:
            raise Oracle(f"{what}: {got!r} instead of {expected!r}")
        return
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        shape = (tuple(got.shape), got.dtype) if isinstance(got, torch.Tensor) else got
        raise Oracle(f"{what}: {shape} instead of {(tuple(expected.shape), expected.dtype)}")
    if values:
        try:
            torch.testing.assert_close(got, expected, equal_nan=True)  # tolerances of the dtype
        except AssertionError as error:
            raise Oracle(f"{what}: values differ\n{error}") from None


def _joined(placement: Any, outs: list[Any], expected: Any, what: str, values: bool) -> None:
    """The ranks' outputs joined as ``placement`` says, compared with ``expected``."""
    if isinstance(placement, tuple):
        if not isinstance(expected, (list, tuple)) or len(placement) != len(expected):
            raise Oracle(f"{what}: {len(placement)} output placements for {type(expected).__name__} {expected!r}")
        for i, p in enumerate(placement):
            _joined(p, [o[i] for o in outs], expected[i], f"{what}[{i}]", values)
        return
    if isinstance(placement, Shard):
        try:
            joined = placement.join(list(outs))
        except RuntimeError as error:
            raise Oracle(f"{what} claimed {placement}, but the pieces do not join: {error}") from None
        _same(expected, joined, f"{what} joined as {placement}", values)
    elif isinstance(placement, Partial):
        _same(expected, sum(outs[1:], outs[0]), f"{what} summed as {placement}", values)
    else:
        for rank, out in enumerate(outs):
            _same(expected, out, f"{what} on rank {rank} ({placement})", values)


def check(op: Any, sample: Sample, placements: list[Placement], degree: int) -> Any:
    """Run ``op`` on ``degree`` ranks with its tensor inputs in ``placements``; raise ``Oracle`` where the
    joined outputs differ from the op on the full tensors. Returns the rule's output placement."""
    gm, names, node = _graph(op, sample)
    expected = _values(gm)[node]
    weights = dict(zip(names, placements))
    prop = propagation.propagate(gm, weights, degree)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            reads = prop.reads[n]
            n.meta[TP] = TpPlacement(
                prop.out[n], tuple(reads.get(a, R) for a in n.all_input_nodes), bias=prop.decisions[n].bias
            )
        elif n.op == "get_attr":
            n.meta[TP] = TpPlacement(prop.out[n], ())
    claim = prop.out[node]
    context = (
        f"{op} {_describe(sample)} in {[str(p) for p in placements]} over tp={degree}: the rule says {_str(claim)}"
    )
    tp_rewrite.run(gm, degree)
    generator = torch.Generator().manual_seed(2**20 + 1)  # not a seed the samples draw from: shares unlike the values
    pieces = {name: _pieces(getattr(gm, name), weights[name], degree, generator) for name in names}
    programs = []
    for rank in range(degree):
        program = copy.deepcopy(gm)
        program.tp = _RankTp(degree, rank)
        for name in names:
            setattr(program, name, pieces[name][rank])
        programs.append(program)
    with _collectives(degree) as collectives:
        try:
            outs = _run_ranks(programs, collectives)
        except Oracle:
            raise
        except Exception as error:
            raise Oracle(f"{context}; the ranks' program fails: {type(error).__name__}: {error}") from error
    try:
        _joined(claim, outs, expected, "output", sample.same_values)
    except Oracle as error:
        raise Oracle(f"{context}; {error}") from None
    return claim


def _str(placement: Any) -> str:
    return f"({', '.join(map(str, placement))})" if isinstance(placement, tuple) else str(placement)


def _describe(sample: Sample) -> str:
    def one(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(x) for x in a) + "]"
        return repr(a)

    parts = [one(a) for a in sample.args] + [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


# ---- placements ------------------------------------------------------------------------------------------


@st.composite
def placements_for(draw: st.DrawFn, tensors: list[torch.Tensor], degree: int) -> list[Placement]:
    """A placement each tensor can be in over ``degree`` ranks: replicated, partial (floating point), or
    sharded along a dimension that splits into ``blocks`` x ``degree`` parts."""
    chosen = []
    for t in tensors:
        options: list[Placement] = [R]
        if t.dtype.is_floating_point:
            options.append(P)
        for dim, size in enumerate(t.shape):
            options.extend(Shard(dim, blocks) for blocks in (1, 2, 3) if size % (blocks * degree) == 0)
        chosen.append(draw(st.sampled_from(options)))
    return chosen


# ---- samples ---------------------------------------------------------------------------------------------

_floats = torch.float64


def _tensor(
    shape: tuple[int, ...], dtype: torch.dtype = _floats, positive: bool = False, seed: int = 0
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=generator, dtype=dtype)
    # Eighths: sums of partial shares are exact, so comparisons (eq, lt) mean the same on every path.
    t = torch.randint(-16, 17, shape, generator=generator).to(dtype) / 8
    return t.abs() + 0.5 if positive else t


shapes = st.lists(st.sampled_from(SIZES), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**16)


@st.composite
def broadcast_to(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: leading dimensions dropped, some others 1."""
    keep = draw(st.integers(1, len(shape)))
    tail = shape[len(shape) - keep :]
    return tuple(1 if draw(st.booleans()) and draw(st.booleans()) else s for s in tail)


def _unary(dtype: torch.dtype = _floats, positive: bool = False, **kwargs: Any) -> Callable:
    @st.composite
    def sample(draw: st.DrawFn) -> Sample:
        return Sample((_tensor(draw(shapes), dtype, positive, draw(seeds)),), kwargs)

    return sample


@st.composite
def _gelu(draw: st.DrawFn) -> Sample:
    approximate = draw(st.sampled_from(["none", "tanh"]))
    return Sample((_tensor(draw(shapes), seed=draw(seeds)),), {"approximate": approximate})


def _binary(dtype: torch.dtype = _floats, positive: bool = False, scalar: bool = True, alpha: bool = False) -> Callable:
    """Two tensors broadcasting (either side the smaller), or a tensor and a Python number."""

    @st.composite
    def sample(draw: st.DrawFn) -> Sample:
        shape = draw(shapes)
        a = _tensor(shape, dtype, positive, draw(seeds))
        if scalar and draw(st.integers(0, 3)) == 0:
            other: Any = draw(st.sampled_from([2, 0.5, -1.5])) if dtype.is_floating_point else 3
        else:
            other = _tensor(draw(broadcast_to(shape)), dtype, positive, draw(seeds))
        args = (other, a) if isinstance(other, torch.Tensor) and draw(st.booleans()) else (a, other)
        kwargs = {"alpha": draw(st.sampled_from([1, 2]))} if alpha and draw(st.booleans()) else {}
        return Sample(args, kwargs)

    return sample


@st.composite
def _compare_scalar(draw: st.DrawFn) -> Sample:
    return Sample((_tensor(draw(shapes), seed=draw(seeds)), draw(st.sampled_from([0.0, 0.5, -1.0]))))


@st.composite
def _where(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    parts = [draw(broadcast_to(shape)) for _ in range(2)]
    cond = _tensor(parts[0], torch.bool, seed=draw(seeds))
    x = _tensor(shape, seed=draw(seeds))
    y = _tensor(parts[1], seed=draw(seeds))
    return Sample((cond, x, y) if draw(st.booleans()) else (cond, y, x))


@st.composite
def _masked_fill(draw: st.DrawFn, tensor_value: bool) -> Sample:
    shape = draw(shapes)
    mask = _tensor(draw(broadcast_to(shape)), torch.bool, seed=draw(seeds))
    value: Any = torch.tensor(-2.5, dtype=_floats) if tensor_value else draw(st.sampled_from([0.0, -1e9]))
    return Sample((_tensor(shape, seed=draw(seeds)), mask, value))


@st.composite
def _clamp(draw: st.DrawFn) -> Sample:
    low = draw(st.sampled_from([None, -0.5]))
    high = draw(st.sampled_from([None, 0.7])) if low is not None else 0.7
    return Sample((_tensor(draw(shapes), seed=draw(seeds)), low, high))


@st.composite
def _pow_scalar(draw: st.DrawFn) -> Sample:
    return Sample((_tensor(draw(shapes), seed=draw(seeds)), draw(st.sampled_from([2, 3, 0.5]))))


def _fix_pow(sample: Sample) -> Sample:
    (x, e) = sample.args
    return Sample((x.abs() + 0.5 if e == 0.5 else x, e))


@st.composite
def _dropout(draw: st.DrawFn) -> Sample:
    # Only the draws that do not depend on the random stream: the random ones are tests/test_dropout_masks.py's.
    p, train = draw(st.sampled_from([(0.0, True), (0.5, False), (0.1, False)]))
    return Sample((_tensor(draw(shapes), seed=draw(seeds)), p, train))


@st.composite
def _to_dtype(draw: st.DrawFn) -> Sample:
    return Sample((_tensor(draw(shapes), seed=draw(seeds)), draw(st.sampled_from([torch.float32, torch.float64]))))


@st.composite
def _to_dtype_layout(draw: st.DrawFn) -> Sample:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return Sample((_tensor(draw(shapes), seed=draw(seeds)),), {"dtype": dtype, "layout": torch.strided})


@st.composite
def _to_device(draw: st.DrawFn) -> Sample:
    return Sample((_tensor(draw(shapes), seed=draw(seeds)), torch.device("cpu"), torch.float32))


@st.composite
def _to_copy(draw: st.DrawFn) -> Sample:
    return Sample((_tensor(draw(shapes), seed=draw(seeds)),), {"dtype": draw(st.sampled_from([torch.float32, None]))})


@st.composite
def _type_as(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    other = _tensor(draw(shapes), draw(st.sampled_from([torch.float32, _floats])), seed=draw(seeds))
    return Sample((_tensor(shape, seed=draw(seeds)), other))


@st.composite
def _bool_binary(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    return Sample((_tensor(shape, torch.bool, seed=draw(seeds)), _tensor(draw(broadcast_to(shape)), torch.bool)))


# views ---------------------------------------------------------------------------------------------------


@st.composite
def _view_sizes(draw: st.DrawFn, shape: tuple[int, ...]) -> list[int]:
    """Sizes ``shape`` views as: dimensions split into factors, runs merged, ones added or dropped, one -1."""
    out: list[int] = []
    i = 0
    while i < len(shape):
        move = draw(st.sampled_from(["keep", "merge", "split", "one"]))
        if move == "merge" and i + 1 < len(shape):
            out.append(shape[i] * shape[i + 1])
            i += 2
            continue
        if move == "split":
            factors = [f for f in (2, 3) if shape[i] % f == 0 and shape[i] > f]
            if factors:
                f = draw(st.sampled_from(factors))
                out.extend([f, shape[i] // f] if draw(st.booleans()) else [shape[i] // f, f])
                i += 1
                continue
        if move == "one":
            out.append(1)
        if shape[i] != 1 or draw(st.booleans()):
            out.append(shape[i])
        i += 1
    out = out or [1]
    if draw(st.booleans()):
        out[draw(st.integers(0, len(out) - 1))] = -1
    return out


def _view_like(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    return Sample((_tensor(shape, seed=draw(seeds)), draw(_view_sizes(shape))))


@st.composite
def _view(draw: st.DrawFn) -> Sample:
    return _view_like(draw)


@st.composite
def _flatten(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    start = draw(st.integers(0, len(shape) - 1))
    end = draw(st.integers(start, len(shape) - 1))
    if draw(st.booleans()):
        end -= len(shape)
    return Sample((_tensor(shape, seed=draw(seeds)), start, end))


@st.composite
def _dims2(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    nd = len(shape)
    d0, d1 = draw(st.integers(-nd, nd - 1)), draw(st.integers(-nd, nd - 1))
    return Sample((_tensor(shape, seed=draw(seeds)), d0, d1))


@st.composite
def _t(draw: st.DrawFn) -> Sample:
    shape = draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=2).map(tuple))
    return Sample((_tensor(shape, seed=draw(seeds)),))


@st.composite
def _permute(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    order = draw(st.permutations(range(len(shape))))
    order = [d - len(shape) if draw(st.booleans()) else d for d in order]
    return Sample((_tensor(shape, seed=draw(seeds)), order))


@st.composite
def _unsqueeze(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    return Sample((_tensor(shape, seed=draw(seeds)), draw(st.integers(-len(shape) - 1, len(shape)))))


@st.composite
def _dim_of(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    return Sample((_tensor(shape, seed=draw(seeds)), draw(st.integers(-len(shape), len(shape) - 1))))


@st.composite
def _expand(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    small = draw(broadcast_to(shape))
    lead = len(shape) - len(small)
    sizes = [s if i < lead or small[i - lead] == 1 else draw(st.sampled_from([s, -1])) for i, s in enumerate(shape)]
    return Sample((_tensor(small, seed=draw(seeds)), sizes))


@st.composite
def _slice(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[dim]
    start = draw(st.sampled_from([None, 0, 1, -1]))
    end = draw(st.sampled_from([None, sys.maxsize, size, size - 1, 2**62]))
    step = draw(st.sampled_from([1, 1, 2]))
    return Sample((_tensor(shape, seed=draw(seeds)), dim, start, end, step))


@st.composite
def _select(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    index = draw(st.integers(-shape[dim], shape[dim] - 1))
    return Sample((_tensor(shape, seed=draw(seeds)), dim, index))


@st.composite
def _split(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    size = draw(st.sampled_from([s for s in SIZES if s <= shape[dim]]))
    return Sample((_tensor(shape, seed=draw(seeds)), size, dim))


@st.composite
def _split_with_sizes(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    n = draw(st.sampled_from([d for d in (1, 2, 3, 4) if shape[dim] % d == 0]))
    sizes = [shape[dim] // n] * n
    if n > 1 and draw(st.booleans()) and sizes[0] > 1:
        sizes[0], sizes[1] = sizes[0] - 1, sizes[1] + 1  # unequal parts
    return Sample((_tensor(shape, seed=draw(seeds)), sizes, dim))


@st.composite
def _chunk(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return Sample((_tensor(shape, seed=draw(seeds)), draw(st.sampled_from([1, 2, 3])), dim))


@st.composite
def _getitem(draw: st.DrawFn) -> Sample:
    """An item of a split (a fused projection's q, k or v)."""
    sample = draw(_split_with_sizes())
    parts = len(sample.args[1])
    index = draw(st.integers(0, parts - 1))

    def build(graph: fx.Graph, args: tuple, kwargs: dict) -> fx.Node:
        return graph.call_function(operator.getitem, (graph.call_function(aten.split_with_sizes.default, args), index))

    return Sample(sample.args, build=build)


@st.composite
def _cat(draw: st.DrawFn) -> Sample:
    shape = list(draw(shapes))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        shape[dim] = draw(st.sampled_from(SIZES))
        parts.append(_tensor(tuple(shape), seed=draw(seeds)))
    if draw(st.integers(0, 4)) == 0:
        parts.insert(draw(st.integers(0, len(parts))), torch.zeros(0, dtype=_floats))  # a legacy empty cache
    return Sample((parts, dim))


@st.composite
def _pad(draw: st.DrawFn, constant_pad_nd: bool) -> Sample:
    shape = draw(shapes)
    n = draw(st.integers(1, len(shape)))
    pads = [draw(st.integers(0, 2)) for _ in range(2 * n)]
    x = _tensor(shape, seed=draw(seeds))
    value = draw(st.sampled_from([0.0, -1.0]))
    if constant_pad_nd:
        return Sample((x, pads, value))
    return Sample((x, pads, "constant", value))


_sym_size = _dim_of


# creation and checks -------------------------------------------------------------------------------------


@st.composite
def _assert_metadata(draw: st.DrawFn) -> Sample:
    x = _tensor(draw(shapes), seed=draw(seeds))
    return Sample((x,), {"dtype": x.dtype, "device": x.device, "layout": torch.strided})


def _created(*args: Any, same_values: bool = True) -> Callable:
    """A creation op: no tensor inputs, so nothing to shard; every rank makes the whole tensor."""
    return lambda: st.just(Sample(args, {"dtype": _floats}, same_values=same_values))


# matrix multiplies ---------------------------------------------------------------------------------------


@st.composite
def _linear(draw: st.DrawFn) -> Sample:
    lead = draw(st.lists(st.sampled_from(SIZES), min_size=0, max_size=2))
    k, n = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    x = _tensor((*lead, k), seed=draw(seeds))
    w = _tensor((n, k), seed=draw(seeds))
    if draw(st.booleans()):
        return Sample((x, w, _tensor((n,), seed=draw(seeds))))
    return Sample((x, w))


@st.composite
def _addmm(draw: st.DrawFn) -> Sample:
    m, k, n = (draw(st.sampled_from(SIZES)) for _ in range(3))
    bias = _tensor(draw(st.sampled_from([(n,), (1, n), (m, n)])), seed=draw(seeds))
    return Sample((bias, _tensor((m, k), seed=draw(seeds)), _tensor((k, n), seed=draw(seeds))))


@st.composite
def _mm(draw: st.DrawFn) -> Sample:
    m, k, n = (draw(st.sampled_from(SIZES)) for _ in range(3))
    return Sample((_tensor((m, k), seed=draw(seeds)), _tensor((k, n), seed=draw(seeds))))


@st.composite
def _bmm(draw: st.DrawFn) -> Sample:
    b, m, k, n = (draw(st.sampled_from(SIZES)) for _ in range(4))
    return Sample((_tensor((b, m, k), seed=draw(seeds)), _tensor((b, k, n), seed=draw(seeds))))


@st.composite
def _matmul(draw: st.DrawFn) -> Sample:
    """Two activations with batch dimensions (heads), broadcasting where one side has 1."""
    batch = draw(st.lists(st.sampled_from(SIZES), min_size=0, max_size=2))
    m, k, n = (draw(st.sampled_from(SIZES)) for _ in range(3))
    a_batch = [1 if draw(st.integers(0, 3)) == 0 else s for s in batch]
    b_batch = [1 if draw(st.integers(0, 3)) == 0 else s for s in batch]
    return Sample((_tensor((*a_batch, m, k), seed=draw(seeds)), _tensor((*b_batch, k, n), seed=draw(seeds))))


@st.composite
def _grouped_mm(draw: st.DrawFn) -> Sample:
    """A mixture of experts' grouped matmul: rows sorted by expert, ``offs`` where each expert's rows end. The
    CPU kernel takes float32 with rows of whole 16-byte lines (so k and n are 24 or 48: their shards too)."""
    experts, rows = draw(st.sampled_from([2, 3])), draw(st.sampled_from([4, 6, 12]))
    k, n = draw(st.sampled_from([24, 48])), draw(st.sampled_from([24, 48]))
    ends = sorted(draw(st.lists(st.integers(0, rows), min_size=experts - 1, max_size=experts - 1))) + [rows]
    x = _tensor((rows, k), torch.float32, seed=draw(seeds))
    w = _tensor((experts, k, n), torch.float32, seed=draw(seeds))
    return Sample((x, w, torch.tensor(ends, dtype=torch.int32)))


# the vocabulary ------------------------------------------------------------------------------------------


@st.composite
def _embedding(draw: st.DrawFn) -> Sample:
    rows, width = draw(st.sampled_from([6, 12])), draw(st.sampled_from(SIZES))
    ids_shape = draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=2).map(tuple))
    generator = torch.Generator().manual_seed(draw(seeds))
    ids = torch.randint(0, rows, ids_shape, generator=generator)
    args: tuple = (_tensor((rows, width), seed=draw(seeds)), ids)
    padding = draw(st.sampled_from([None, 0, rows - 1, 1]))
    return Sample(args if padding is None else (*args, padding))


@st.composite
def _cross_entropy(draw: st.DrawFn) -> Sample:
    n, classes = draw(st.sampled_from(SIZES)), draw(st.sampled_from([6, 12]))
    generator = torch.Generator().manual_seed(draw(seeds))
    target = torch.randint(0, classes, (n,), generator=generator)
    ignore = draw(st.sampled_from([-100, 0]))
    if draw(st.booleans()):
        target[0] = ignore
    logits = _tensor((n, classes), seed=draw(seeds))
    weight = _tensor((classes,), positive=True) if draw(st.integers(0, 4)) == 0 else None
    smoothing = draw(st.sampled_from([0.0, 0.0, 0.1]))
    return Sample((logits, target, weight, draw(st.sampled_from([0, 1, 2])), ignore, smoothing))


# reductions and attention --------------------------------------------------------------------------------


@st.composite
def _sdpa(draw: st.DrawFn) -> Sample:
    b, h, s, d = (draw(st.sampled_from(SIZES)) for _ in range(4))
    q, k, v = (_tensor((b, h, s, d), seed=draw(seeds)) for _ in range(3))
    kind = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    if kind == "causal":
        return Sample((q, k, v), {"is_causal": True})
    if kind == "none":
        return Sample((q, k, v))
    mask_shape = (draw(st.sampled_from([1, b])), draw(st.sampled_from([1, h])), s, s)
    mask = _tensor(mask_shape, torch.bool, seed=draw(seeds))
    mask[..., 0] = True  # every query sees a key
    return Sample((q, k, v, mask if kind == "bool" else torch.where(mask, 0.0, -1e9).to(_floats)))


@st.composite
def _layer_norm(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    normalized = list(shape[len(shape) - draw(st.integers(1, len(shape))) :])
    x = _tensor(shape, seed=draw(seeds))
    if draw(st.booleans()):
        return Sample((x, normalized, _tensor(tuple(normalized), seed=1), _tensor(tuple(normalized), seed=2), 1e-5))
    return Sample((x, normalized))


@st.composite
def _reduce(draw: st.DrawFn) -> Sample:
    shape = draw(shapes)
    nd = len(shape)
    dims = draw(
        st.one_of(st.just([]), st.lists(st.integers(-nd, nd - 1), min_size=1, max_size=nd, unique_by=lambda d: d % nd))
    )
    return Sample((_tensor(shape, seed=draw(seeds)), dims, draw(st.booleans())))


@st.composite
def _softmax(draw: st.DrawFn) -> Sample:
    sample = draw(_dim_of())
    return Sample((*sample.args, False))


@st.composite
def _softmax_int(draw: st.DrawFn) -> Sample:
    return draw(_dim_of())


SAMPLES: dict[Any, Callable[[], st.SearchStrategy[Sample]]] = {
    # pointwise, linear in partial values
    aten.add.Tensor: _binary(alpha=True),
    aten.sub.Tensor: _binary(alpha=True),
    aten.mul.Tensor: _binary(),
    aten.div.Tensor: _binary(positive=True),
    aten.neg.default: _unary(),
    aten.to.dtype: _to_dtype,
    aten.to.dtype_layout: _to_dtype_layout,
    aten.to.device: _to_device,
    aten._to_copy.default: _to_copy,
    aten.contiguous.default: _unary(),
    aten.clone.default: _unary(),
    aten.alias.default: _unary(),
    aten.type_as.default: _type_as,
    # pointwise
    aten.gelu.default: _gelu,
    aten.silu.default: _unary(),
    aten.relu.default: _unary(),
    aten.tanh.default: _unary(),
    aten.sigmoid.default: _unary(),
    aten.exp.default: _unary(),
    aten.log.default: _unary(positive=True),
    aten.sqrt.default: _unary(positive=True),
    aten.rsqrt.default: _unary(positive=True),
    aten.pow.Tensor_Scalar: lambda: _pow_scalar().map(_fix_pow),
    aten.pow.Tensor_Tensor: _binary(positive=True, scalar=False),
    aten.erf.default: _unary(),
    aten.cos.default: _unary(),
    aten.sin.default: _unary(),
    aten.abs.default: _unary(),
    aten.dropout.default: _dropout,
    aten.where.self: _where,
    aten.masked_fill.Scalar: lambda: _masked_fill(False),
    aten.masked_fill.Tensor: lambda: _masked_fill(True),
    **{
        op: _binary(scalar=False)
        for op in (aten.eq.Tensor, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor)
    },
    **{
        op: _compare_scalar
        for op in (aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar)
    },
    aten.__and__.Tensor: _bool_binary,
    aten.__or__.Tensor: _bool_binary,
    aten.bitwise_not.default: _unary(torch.bool),
    aten.logical_not.default: _unary(torch.bool),
    aten.detach.default: _unary(),
    aten.maximum.default: _binary(scalar=False),
    aten.minimum.default: _binary(scalar=False),
    aten.clamp.default: _clamp,
    # views and other dimension moves
    aten.view.default: _view,
    aten.reshape.default: _view,
    aten._unsafe_view.default: _view,
    aten.flatten.using_ints: _flatten,
    aten.transpose.int: _dims2,
    aten.t.default: _t,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _dim_of,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.chunk.default: _chunk,
    operator.getitem: _getitem,
    aten.cat.default: _cat,
    aten.sym_size.int: _sym_size,
    aten.pad.default: lambda: _pad(False),
    aten.constant_pad_nd.default: lambda: _pad(True),
    aten._assert_tensor_metadata.default: _assert_metadata,
    aten.arange.default: _created(6),
    aten.arange.start: _created(2, 8),
    aten.full.default: _created([2, 3], 1.5),
    aten.zeros.default: _created([2, 3]),
    aten.ones.default: _created([3]),
    aten.empty.memory_format: _created([2, 2], same_values=False),
    aten.scalar_tensor.default: _created(2.0),
    # matrix multiplies
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.matmul.default: _matmul,
    aten._grouped_mm.default: _grouped_mm,
    # the vocabulary
    aten.embedding.default: _embedding,
    aten.cross_entropy_loss.default: _cross_entropy,
    # reductions and attention
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.layer_norm.default: _layer_norm,
    aten.mean.dim: _reduce,
    aten.sum.dim_IntList: _reduce,
    aten.amax.default: _reduce,
    aten.softmax.int: _softmax_int,
    aten._softmax.default: _softmax,
    aten.log_softmax.int: _softmax_int,
    aten._log_softmax.default: _softmax,
}
