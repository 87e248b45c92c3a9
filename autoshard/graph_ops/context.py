"""Context parallelism as graph ops: each cp rank computes on its share of every sequence.

The context_parallel pass (passes/context_parallel.py) inserts calls to the functions below; each takes
the rank's context-parallel module (a get_attr node named ``cp``: an ``UnboundContextParallel`` in a graph
built for inspection, ``ContextParallel`` on a rank) first, so the graph is the same on every rank.

A rank holds two chunks of every sequence, chunk i and chunk 2N-1-i of 2N (N = cp): under a causal mask
the early chunk attends to little and the late one to much, so every rank does the same attention work
(the head-tail balancing of torch's context_parallel and Megatron-core).

    positions       the global positions of this rank's tokens, in the order it holds them
    local_tokens    a value every rank holds whole -> this rank's tokens of it (backward: scatter back)
    all_reduce      a sum of the ranks' partial values (a sum over the sequence); backward x cp (below)
    replica_mean    the loss a rank reports: its partial times cp, so the mean over dp x cp ranks that
                    the runtime takes of losses and gradients is the global value
    ring_attention  attention over the whole sequence: K/V blocks passed round the ring while the block
                    in hand is computed, partial results merged by log-sum-exp; backward passes dK/dV round
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
from autoshard.graph_ops.unbound import UnboundGroup

__all__ = [
    "ContextParallel",
    "UnboundContextParallel",
    "all_reduce",
    "chunk_positions",
    "cross_entropy",
    "local_tokens",
    "positions",
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
    """A rank's place in its cp group: its index, the ring's neighbours, the group (and its name)."""

    def __init__(self, degree: int, rank: int, ranks: list[int], group: dist.ProcessGroup, comm: Any) -> None:
        super().__init__(degree)
        self.rank = rank
        self.next_rank = ranks[(rank + 1) % degree]  # global ranks of the ring's neighbours
        self.prev_rank = ranks[(rank - 1) % degree]
        self.group = group
        self.comm = comm
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}
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

    def exchange(self, tensors: list[torch.Tensor]) -> Pending:
        """Send ``tensors`` to the next rank of the ring and receive the previous rank's, started and not waited
        (``wait``): one message of them all (each collective has its own cost), an all-to-all in which each rank
        sends only to the next (a functional collective, so it runs while this rank computes)."""
        flat = torch.cat([t.reshape(-1).to(tensors[0].dtype) for t in tensors])
        sends = [0] * self.degree
        receives = [0] * self.degree
        sends[(self.rank + 1) % self.degree] = receives[(self.rank - 1) % self.degree] = flat.numel()
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


def positions(cp: UnboundContextParallel, seq_len: int, device: torch.device) -> torch.Tensor:
    """This rank's global positions of a sequence of ``seq_len`` tokens (the graph reads it once a size)."""
    return cp.positions(int(seq_len), device)


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


# ---- ring attention -------------------------------------------------------------------------------------
#
# One step of the ring attends this rank's queries to one rank's K/V block. A block is computed by the
# device's fused attention kernel where it returns its log-sum-exp (the CPU's flash kernel), else by the
# same formulas written out; its backward takes the merged output and log-sum-exp, so each block's
# gradients are exactly its part of the whole. Work the mask rules out is skipped: with is_causal, a block
# of an earlier rank's tokens is read by every query but only its first chunk of keys counts, one of a later
# rank's only by this rank's second chunk of queries (torch's and Megatron's head-tail split); with a mask
# (the form Hugging Face models pass), each quarter (a chunk of queries by a chunk of keys) that the mask
# hides entirely.


def _accumulate(x: torch.Tensor) -> torch.dtype:
    """What partial results accumulate in: fp32, or the inputs' dtype where wider."""
    return torch.promote_types(x.dtype, torch.float32)


def _as_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask as the additive bias the kernels take (-inf where a bool mask hides a key)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _block_forward(q, k, v, bias, causal, scale):  # noqa: ANN001, ANN202 - kernel
    """(output, log-sum-exp) of q over one block of keys; rows the bias hides wholly get -inf."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    else:
        scores = _scores(q, k, bias, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
        out = torch.matmul(probs, v.to(probs.dtype)).to(q.dtype)
    if bias is not None:  # a row with no visible key: nothing to merge (the kernel reports lse 0)
        lse = lse.masked_fill(~torch.isfinite(bias).any(-1).expand(lse.shape), float("-inf"))
    return out, lse


def _block_backward(grad_out, q, k, v, out, lse, bias, causal, scale):  # noqa: ANN001, ANN202 - kernel
    """Gradients of q, k, v from one block, given the merged output and log-sum-exp of every block."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    acc = _accumulate(q)
    scores = _scores(q, k, bias, causal, scale)
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    grad_out = grad_out.to(acc)
    delta = (grad_out * out.to(acc)).sum(-1, keepdim=True)
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, v.to(acc).transpose(-2, -1)) - delta)
    grad_q = torch.matmul(grad_scores, k.to(acc)) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q.to(acc)) * scale
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _scores(q, k, bias, causal, scale):  # noqa: ANN001, ANN202 - kernel
    acc = _accumulate(q)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.to(acc)
    if causal:  # top-left aligned, as SDPA's is_causal (used on a rank's own, square block)
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _calls(bias, causal, rank, src, rows):  # noqa: ANN001, ANN202 - planning of one step
    """The kernel calls of one step: (query rows, key columns, is_causal) each, rows and columns as slices."""
    everything, half = slice(None), rows // 2
    chunks = (slice(0, half), slice(half, rows))
    if bias is None:
        if not causal:
            return [(everything, everything, False)]
        if src == rank:  # the rank's own block: chunk order follows positions, so causal is local
            return [(everything, everything, True)]
        # an earlier rank's block: only its first chunk precedes both of ours; a later one: only our second
        # chunk follows both of its chunks
        return [(everything, chunks[0], False)] if src < rank else [(chunks[1], everything, False)]
    if bias.shape[-1] == 1:
        return [(everything, everything, False)]
    by_rows = chunks if bias.shape[-2] != 1 else (everything,)
    calls = []
    for r in by_rows:
        seen = [bool(torch.isfinite(bias[..., r, c]).any()) for c in chunks]
        if all(seen):
            calls.append((r, everything, False))
        elif any(seen):
            calls.append((r, chunks[seen.index(True)], False))
    return calls


def _rows(bias, r, c):  # noqa: ANN001, ANN202
    if bias is None:
        return None
    return bias[..., r if bias.shape[-2] != 1 else slice(None), c if bias.shape[-1] != 1 else slice(None)]


def _merge(out, lse, part_out, part_lse, rows, hidden_rows):  # noqa: ANN001, ANN202
    """Online softmax: the running (output, log-sum-exp) of ``rows`` merged with one block's. ``hidden_rows``:
    whether a row may have seen no key yet, or see none in this block (a mask), which -inf marks."""
    old_out, old_lse = out[..., rows, :], lse[..., rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    if not hidden_rows:
        out[..., rows, :] = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + part_out.to(out.dtype) * torch.exp(
            part_lse - new_lse
        ).unsqueeze(-1)
        lse[..., rows] = new_lse
        return
    base = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
    keep = torch.where(torch.isfinite(old_lse), torch.exp(old_lse - base), 0.0)
    take = torch.where(torch.isfinite(part_lse), torch.exp(part_lse - base), 0.0)
    out[..., rows, :] = old_out * keep.unsqueeze(-1) + part_out.to(out.dtype) * take.unsqueeze(-1)
    lse[..., rows] = new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, q, k, v, mask, causal, scale, seq_len):  # noqa: ANN001, ANN205 - autograd signature
        degree, heads = cp.degree, q.shape[-3]
        acc = _accumulate(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=acc)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device, dtype=acc)
        bias = _as_bias(mask, q.dtype)
        q_pos = cp.positions(seq_len, q.device)
        block = (k, v)
        for step in range(degree):
            if step + 1 < degree:  # the next block travels while this one is computed
                pending = cp.exchange(list(block))
            src = (cp.rank - step) % degree
            columns = _block_bias(bias, causal, q_pos, cp.positions(seq_len, q.device, src))
            kb, vb = _repeat_kv(block[0], heads), _repeat_kv(block[1], heads)
            for r, c, local_causal in _calls(columns, causal, cp.rank, src, q.shape[-2]):
                part_out, part_lse = _block_forward(
                    q[..., r, :], kb[..., c, :], vb[..., c, :], _rows(columns, r, c), local_causal, scale
                )
                if step == 0 and r == slice(None):  # the rank's own block comes first: nothing to merge yet
                    out, lse = part_out.to(acc), part_lse.to(acc)
                else:  # with is_causal alone every row saw its own key in the first block
                    _merge(out, lse, part_out, part_lse.to(acc), r, hidden_rows=bias is not None)
            if step + 1 < degree:
                block = tuple(cp.wait(pending))
        ctx.cp, ctx.causal, ctx.scale, ctx.seq_len = cp, causal, scale, seq_len
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205 - autograd signature
        cp, causal, scale, seq_len = ctx.cp, ctx.causal, ctx.scale, ctx.seq_len
        q, k, v, mask, out, lse = ctx.saved_tensors
        degree, heads, kv_heads = cp.degree, q.shape[-3], k.shape[-3]
        acc = _accumulate(q)
        grad_out = grad_out.contiguous()
        bias = _as_bias(mask, q.dtype)
        q_pos = cp.positions(seq_len, q.device)
        lse = torch.where(torch.isfinite(lse), lse, 0.0).to(acc)
        grad_q = torch.zeros(q.shape, device=q.device, dtype=acc)
        # K/V blocks travel ahead (overlapped with the block in hand); the gradients of a block follow it round
        # the ring, home after a lap, each lap's send overlapped with the next block's work.
        kv: tuple[torch.Tensor, ...] = (k, v)
        pending_grads: Pending | None = None
        for step in range(degree):
            if step + 1 < degree:
                pending_kv = cp.exchange(list(kv))
            src = (cp.rank - step) % degree
            columns = _block_bias(bias, causal, q_pos, cp.positions(seq_len, q.device, src))
            kb, vb = _repeat_kv(kv[0], heads), _repeat_kv(kv[1], heads)
            calls = _calls(columns, causal, cp.rank, src, q.shape[-2])
            grad_k = grad_v = None
            for r, c, local_causal in calls:
                dq, dk, dv = _block_backward(
                    grad_out[..., r, :], q[..., r, :], kb[..., c, :], vb[..., c, :], out[..., r, :],
                    lse[..., r], _rows(columns, r, c), local_causal, scale,
                )  # fmt: skip
                grad_q[..., r, :] += dq
                if grad_k is None and c == slice(None):
                    grad_k, grad_v = dk.to(acc), dv.to(acc)
                    continue
                if grad_k is None:
                    grad_k = torch.zeros(kb.shape, device=q.device, dtype=acc)
                    grad_v = torch.zeros(vb.shape, device=q.device, dtype=acc)
                grad_k[..., c, :] += dk
                grad_v[..., c, :] += dv
            if grad_k is None:  # the mask hides the whole block from this rank's queries
                grad_k = torch.zeros(kb.shape, device=q.device, dtype=acc)
                grad_v = torch.zeros(vb.shape, device=q.device, dtype=acc)
            if kv_heads != heads:  # grouped-query attention: a K/V head's gradient sums its query heads'
                grad_k = grad_k.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)
                grad_v = grad_v.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)
            if pending_grads is not None:  # what the ranks before added to this block's gradients
                arrived = cp.wait(pending_grads)
                grad_k, grad_v = arrived[0] + grad_k, arrived[1] + grad_v
            pending_grads = cp.exchange([grad_k, grad_v])
            if step + 1 < degree:
                kv = tuple(cp.wait(pending_kv))
        arrived = cp.wait(pending_grads)
        grad_k, grad_v = arrived[0].to(k.dtype), arrived[1].to(v.dtype)
        return None, grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None


def _block_bias(bias, causal, q_pos, k_pos):  # noqa: ANN001, ANN202
    """The bias of one block: the columns of its keys, and the causal rule on global positions where the
    model gives a mask too (else None, and the calls follow is_causal)."""
    if bias is None:
        return None
    if bias.shape[-1] != 1:
        bias = bias.index_select(bias.dim() - 1, k_pos)
    if causal:
        hidden = k_pos[None, :] > q_pos[:, None]
        bias = bias.expand(*bias.shape[:-2], len(q_pos), len(k_pos)).masked_fill(hidden, float("-inf"))
    return bias


@stays_eager  # point-to-point sends round the ring, between the compiled parts
def ring_attention(
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
    """scaled_dot_product_attention of this rank's queries over the whole sequence ([.., heads, tokens, dim]),
    its keys and values in blocks round the ring; ``attn_mask``: this rank's query rows, every key."""
    if dropout_p:
        raise InputError(
            f"attention dropout (p={dropout_p}) under context parallelism is not supported: the ring computes "
            f"attention in blocks; set the model's attention dropout to 0 to train with cp"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(cp, q, k, v, attn_mask, bool(is_causal), float(scale), int(seq_len))


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


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, x, seq_len):  # noqa: ANN001, ANN205 - autograd signature
        ctx.cp, ctx.seq_len = cp, seq_len
        return _tokens_to_heads(cp, x, seq_len)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205 - autograd signature
        return None, _heads_to_tokens(ctx.cp, grad.contiguous(), ctx.seq_len), None


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, x, seq_len):  # noqa: ANN001, ANN205 - autograd signature
        ctx.cp, ctx.seq_len = cp, seq_len
        return _heads_to_tokens(cp, x, seq_len)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205 - autograd signature
        return None, _tokens_to_heads(ctx.cp, grad.contiguous(), ctx.seq_len), None


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
    qh, kh, vh = (_TokensToHeads.apply(cp, t, seq_len) for t in (q, k, v))
    mask = attn_mask
    if mask is not None and mask.dim() >= 3 and mask.shape[-3] == q.shape[-3]:  # a mask per head: mine
        heads = q.shape[-3] // cp.degree
        mask = mask.narrow(-3, cp.rank * heads, heads)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa or kh.shape[-3] != qh.shape[-3],
    )  # fmt: skip
    return _HeadsToTokens.apply(cp, out, seq_len)
