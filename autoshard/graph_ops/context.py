"""Context parallelism as graph ops: each cp rank computes on its share of every sequence.

The context_parallel pass (passes/context_parallel.py) inserts calls to the functions below; each takes
the rank's context-parallel module (a get_attr node named ``cp``: an ``UnboundContextParallel`` in a graph
built for inspection, ``ContextParallel`` on a rank) first, so the graph is the same on every rank.

A rank holds two chunks of every sequence, chunk i and chunk 2N-1-i of 2N (N = cp): under a causal mask
the early chunk attends to little and the late one to much, so every rank does the same attention work
(the head-tail balancing of torch's context_parallel and Megatron-core).

    local_tokens    a value every rank holds whole -> this rank's tokens of it (backward: scatter back)
    all_reduce      a sum of the ranks' partial values (a sum over the sequence); backward x cp (below)
    replica_mean    the loss a rank reports: its partial times cp, so the mean over dp x cp ranks that
                    the runtime takes of losses and gradients is the global value
    ring_attention  (graph_ops/ring_attention.py) attention over the whole sequence: K/V blocks passed round
                    the ring while the block in hand is computed, merged by log-sum-exp; backward passes dK/dV round
                    the ring back to their owner (eagerly under torch.compile, as local_tokens)
    cross_entropy   a token mean over the global batch: the rank's sum over the global count of tokens
    all_to_all_attention  the sequence traded for heads (DeepSpeed Ulysses): each rank attends with heads / cp
                    of the heads over every token; two all-to-alls forward and two backward

Gradients flow in the units of ``replica_mean``: a rank's gradient of its own tokens is cp times its share
of the global gradient, which the runtime's mean over dp x cp turns back into the global gradient. So
``all_reduce``'s backward multiplies by cp: every rank's copy of the sum then carries the whole gradient,
as a value every rank computes alike does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.distributed import funcol
from autoshard.errors import InputError
from autoshard.graph_ops.graph_break import stays_eager
from autoshard.graph_ops.ring_attention import ring_attention
from autoshard.graph_ops.unbound import UnboundGroup

__all__ = [
    "ContextParallel",
    "UnboundContextParallel",
    "all_reduce",
    "chunk_positions",
    "cross_entropy",
    "local_tokens",
    "replica_mean",
    "ring_attention",
    "all_to_all_attention",
]


def chunk_positions(seq_len: int, rank: int, degree: int, device: Any = None) -> torch.Tensor:
    """The positions rank ``rank`` of ``degree`` holds of a sequence of ``seq_len``: chunks rank and
    2*degree-1-rank of 2*degree equal chunks, in that order."""
    if seq_len % (2 * degree):
        raise InputError(
            f"context parallelism splits each sequence into 2 x cp = {2 * degree} equal chunks (two a rank, for "
            f"balanced causal attention), but the sequence has {seq_len} tokens; pad or cut sequences to a "
            f"multiple of {2 * degree}"
        )
    chunk = seq_len // (2 * degree)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * degree - 1 - rank) * chunk, (2 * degree - rank) * chunk, device=device)
    return torch.cat([first, last])


class UnboundContextParallel(UnboundGroup):
    """The ``cp`` of a graph built for inspection: its degree; running it needs a Program under a process group."""

    kind = "context-parallel"
    positions = exchange = UnboundGroup._unbound


_ops = torch.ops._c10d_functional


@dataclass(frozen=True)
class Pending:
    """An exchange in flight: the received buffer (not yet waited) and the shapes it holds."""

    flat: torch.Tensor
    like: tuple[tuple[torch.Size, torch.dtype], ...]


class ContextParallel(UnboundContextParallel):
    """A rank's place in its cp group: its index in the group, the group (and its name)."""

    def __init__(self, degree: int, rank: int, group: dist.ProcessGroup, comm: Any) -> None:
        super().__init__(degree)
        self.rank = rank
        self.group = group
        self.comm = comm
        self._positions: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        funcol.register_counter(group.group_name, comm)

    @property
    def group_name(self) -> str:
        return self.group.group_name

    def positions(self, seq_len: int, device: torch.device, rank: int | None = None) -> torch.Tensor:
        rank = self.rank if rank is None else rank
        key = (seq_len, rank, device)
        if key not in self._positions:
            self._positions[key] = chunk_positions(seq_len, rank, self.degree, device)
        return self._positions[key]

    def exchange(self, tensors: list[torch.Tensor], hop: int = 1) -> Pending:
        """Send ``tensors`` to the next rank of the ring (``hop=-1``: the previous) and receive from the rank on the
        other side, started and not waited (``wait``): one message of them all (each collective has its own
        cost), an all-to-all in which each rank sends only to that neighbour (a functional collective, so it runs
        while this rank computes)."""
        flat = torch.cat([t.reshape(-1).to(tensors[0].dtype) for t in tensors])
        sends = [0] * self.degree
        receives = [0] * self.degree
        sends[(self.rank + hop) % self.degree] = receives[(self.rank - hop) % self.degree] = flat.numel()
        self.comm.count("cp_ring", flat.numel() * flat.element_size())
        started = _ops.all_to_all_single(flat, receives, sends, self.group_name)
        return Pending(started, tuple((t.shape, t.dtype) for t in tensors))

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        """The tensors an exchange received, once they are here."""
        with self.comm.timing("cp_ring"):
            flat = _ops.wait_tensor(pending.flat)
        out, at = [], 0
        for shape, dtype in pending.like:
            n = math.prod(shape)
            out.append(flat[at : at + n].view(shape).to(dtype))
            at += n
        return out


@stays_eager  # reads the rank's positions, kept outside the graph
def local_tokens(cp: UnboundContextParallel, x: torch.Tensor, dim: int, seq_len: int) -> torch.Tensor:
    """This rank's tokens of ``x``, which holds every token along ``dim`` (``seq_len`` of them, or rows of
    several sequences laid end to end, the sequence innermost: a flattened [batch, sequence])."""
    index = cp.positions(int(seq_len), x.device)
    if x.shape[dim] == seq_len:
        return x.index_select(dim, index)
    rows = x.unflatten(dim, (-1, int(seq_len)))
    return rows.index_select(dim + 1, index).flatten(dim, dim + 1)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, degree: int) -> torch.Tensor:
        ctx.degree = degree
        return funcol.all_reduce(x, name, name="cp_all_reduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.degree, None, None


def all_reduce(cp: UnboundContextParallel, x: torch.Tensor) -> torch.Tensor:
    """Partial -> whole: the sum of the cp ranks' partial values (a sum over the sequence)."""
    return _AllReduce.apply(x, cp.group_name, cp.degree)


def replica_mean(cp: UnboundContextParallel, loss: torch.Tensor) -> torch.Tensor:
    """A partial loss in the runtime's units: the mean over the cp ranks of this is their sum."""
    return loss * cp.degree


def cross_entropy(
    cp: UnboundContextParallel,
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    reduction: int = 1,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """cross_entropy_loss over this rank's tokens; ``reduction`` mean: the rank's sum over the global count
    of counted tokens (the ranks' counts differ: the last token of a sequence has no label), a partial value."""
    if reduction != 1:
        names = {0: "none", 2: "sum"}
        return F.cross_entropy(
            logits, target, weight, ignore_index=ignore_index, reduction=names[reduction],
            label_smoothing=label_smoothing,
        )  # fmt: skip
    total = F.cross_entropy(
        logits, target, weight, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
    )
    with torch.no_grad():
        counted = target != ignore_index
        count = (weight[target.clamp(min=0)] * counted).sum() if weight is not None else counted.sum()
        count = funcol.all_reduce(count.to(total.dtype), cp.group_name, name="cp_all_reduce")
    return total / count


# ---- all-to-all attention (sequence <-> heads, as DeepSpeed Ulysses) -----------------------------------------


def _all_to_all(cp: UnboundContextParallel, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Piece i to cp rank i; what each rank sent this one, in rank order (pieces of one shape)."""
    flat = torch.cat([p.reshape(-1) for p in pieces])
    splits = [pieces[0].numel()] * cp.degree
    cp.comm.count("cp_all_to_all", flat.numel() * flat.element_size())
    with cp.comm.timing("cp_all_to_all"):
        got = _ops.wait_tensor(_ops.all_to_all_single(flat, splits, splits, cp.group_name))
    return list(got.view(cp.degree, *pieces[0].shape).unbind(0))


def _tokens_to_heads(cp: UnboundContextParallel, x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[.., heads, this rank's tokens, dim] -> [.., this rank's heads, every token in order, dim]."""
    heads = x.shape[-3] // cp.degree
    got = _all_to_all(cp, list(x.split(heads, dim=-3)))  # from each rank: my heads of its tokens
    out = x.new_empty(*x.shape[:-3], heads, seq_len, x.shape[-1])
    for rank, part in enumerate(got):
        out.index_copy_(-2, cp.positions(seq_len, x.device, rank), part)
    return out


def _heads_to_tokens(cp: UnboundContextParallel, x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The inverse: [.., this rank's heads, every token, dim] -> [.., heads, this rank's tokens, dim]."""
    pieces = [x.index_select(-2, cp.positions(seq_len, x.device, rank)) for rank in range(cp.degree)]
    return torch.cat(_all_to_all(cp, pieces), dim=-3)


_TRADES = {True: _tokens_to_heads, False: _heads_to_tokens}


class _Trade(torch.autograd.Function):
    """Tokens for heads (``to_heads``) or back; the backward is the other trade."""

    @staticmethod
    def forward(ctx, cp, x, seq_len, to_heads):  # noqa: ANN001, ANN205 - autograd signature
        ctx.cp, ctx.seq_len, ctx.to_heads = cp, seq_len, to_heads
        return _TRADES[to_heads](cp, x, seq_len)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205 - autograd signature
        return None, _TRADES[not ctx.to_heads](ctx.cp, grad.contiguous(), ctx.seq_len), None, None


@stays_eager  # all-to-alls around the attention, between the compiled parts
def all_to_all_attention(
    cp: UnboundContextParallel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    seq_len: int,
) -> torch.Tensor:
    """scaled_dot_product_attention with the sequence traded for heads: an all-to-all gives each cp rank
    heads / cp of the heads over every token, the attention runs as on one device (its own kernel, the model's
    mask whole), and a second all-to-all gives the tokens back. Heads (and K/V heads) divide by cp."""
    seq_len = int(seq_len)
    qh, kh, vh = (_Trade.apply(cp, t, seq_len, True) for t in (q, k, v))
    mask = attn_mask
    if mask is not None and mask.dim() >= 3 and mask.shape[-3] == q.shape[-3]:  # a mask per head: mine
        heads = q.shape[-3] // cp.degree
        mask = mask.narrow(-3, cp.rank * heads, heads)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa or kh.shape[-3] != qh.shape[-3],
    )  # fmt: skip
    return _Trade.apply(cp, out, seq_len, False)
