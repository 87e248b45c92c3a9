"""Ring attention: this rank's queries attend to every token, the K/V blocks passed round the cp ranks.

One step of the ring attends this rank's queries to one rank's K/V block. A block is computed by the
device's fused attention kernel where it returns its log-sum-exp (the CPU's flash kernel), else by the
same formulas written out; its backward takes the merged output and log-sum-exp, so each block's
gradients are exactly its part of the whole. Work the mask rules out is skipped: with is_causal, a block
of an earlier rank's tokens is read by every query but only its first chunk of keys counts, one of a later
rank's only by this rank's second chunk of queries (torch's and Megatron's head-tail split); with a mask
(the form Hugging Face models pass), each quarter (a chunk of queries by a chunk of keys) that the mask
hides entirely.

Backward walks the ring the other way round, from the block forward ended on (kept for it: one K/V block
a layer) to the rank's own, so each block's gradients, which follow the block, end at its home with nothing
left to send after the last block (torch's and Megatron's rings send the gradients one hop more, exposed).

``cp`` is the rank's context-parallel module (graph_ops/context.py): its degree, its rank, its positions,
and ``exchange`` / ``wait`` (a lap of the ring, started, then waited where the block is needed).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autoshard.errors import InputError
from autoshard.graph_ops.graph_break import stays_eager
from autoshard.ir.ops import TOKEN_MAJOR

__all__ = ["ring_attention"]


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
        degree = cp.degree
        acc = _accumulate(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=acc)
        # token-major, as the fused kernels lay out theirs: the usual swap of heads and tokens after attention is
        # a view of it (what passes/saved_tensors counts: autoshard.ir.ops.TOKEN_MAJOR)
        out = q.new_zeros(*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1], dtype=acc).transpose(-3, -2)
        bias = _as_bias(mask, q.dtype)
        q_pos = cp.positions(seq_len, q.device)
        block = (k, v)
        for step in range(degree):
            if step + 1 < degree:  # the next block travels while this one is computed
                pending = cp.exchange(list(block))
            src = (cp.rank - step) % degree  # whose block this rank holds at this step
            columns, kb, vb, calls = _step(cp, src, block, bias, causal, q_pos, seq_len, q.shape)
            for r, c, local_causal in calls:
                part_out, part_lse = _block_forward(
                    q[..., r, :], kb[..., c, :], vb[..., c, :], _rows(columns, r, c), local_causal, scale
                )
                if step == 0 and r == slice(None):  # the rank's own block comes first: nothing to merge yet
                    out.copy_(part_out)
                    lse = part_lse.to(acc)
                else:  # with is_causal alone every row saw its own key in the first block
                    _merge(out, lse, part_out, part_lse.to(acc), r, hidden_rows=bias is not None)
            if step + 1 < degree:
                block = tuple(cp.wait(pending))
        ctx.cp, ctx.causal, ctx.scale, ctx.seq_len = cp, causal, scale, seq_len
        result = out.to(q.dtype)
        # The last block the ring brought (the next rank's) is kept: backward starts on it (see backward)
        ctx.save_for_backward(q, k, v, mask, result, lse, *block)
        return result

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205 - autograd signature
        """The blocks in the ring's other direction, from the one forward ended on (the next rank's, kept) to
        the rank's own, last. A block's gradients follow it, so they come home with it: the partial sum of every
        other rank arrives while this rank computes its own block's share, and no lap is left to wait for after
        the last block (nor a K/V hop to it: the own block is here). cp - 2 K/V hops and cp - 1 gradient hops,
        each overlapped with a block's backward."""
        cp, causal, scale, seq_len = ctx.cp, ctx.causal, ctx.scale, ctx.seq_len
        q, k, v, mask, out, lse, next_k, next_v = ctx.saved_tensors
        degree, heads, kv_heads = cp.degree, q.shape[-3], k.shape[-3]
        acc = _accumulate(q)
        grad_out = grad_out.contiguous()
        bias = _as_bias(mask, q.dtype)
        q_pos = cp.positions(seq_len, q.device)
        lse = torch.where(torch.isfinite(lse), lse, 0.0).to(acc)
        grad_q = torch.zeros(q.shape, device=q.device, dtype=acc)
        kv: tuple[torch.Tensor, ...] = (next_k, next_v)
        pending_kv = pending_grads = None
        for step in range(degree):
            if step == degree - 1:
                kv = (k, v)
            elif pending_kv is not None:
                kv = tuple(cp.wait(pending_kv))
            if step + 2 < degree:  # the block after this one travels while this one is computed
                pending_kv = cp.exchange(list(kv), hop=-1)
            src = (cp.rank + 1 + step) % degree
            columns, kb, vb, calls = _step(cp, src, kv, bias, causal, q_pos, seq_len, q.shape)
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
            if pending_grads is not None:  # what the ranks after this one added to this block's gradients
                arrived = cp.wait(pending_grads)
                grad_k, grad_v = arrived[0] + grad_k, arrived[1] + grad_v
            if step + 1 < degree:  # on to the rank that holds this block next
                pending_grads = cp.exchange([grad_k, grad_v], hop=-1)
        return None, grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


def _step(cp, src, block, bias, causal, q_pos, seq_len, q_shape):  # noqa: ANN001, ANN202
    """What one step of the ring attends to, forward and backward alike: ``src``'s block's bias, its keys and
    values with as many heads as the queries, and the kernel calls the mask leaves."""
    columns = _block_bias(bias, causal, q_pos, cp.positions(seq_len, q_pos.device, src))
    heads = q_shape[-3]
    kb, vb = _repeat_kv(block[0], heads), _repeat_kv(block[1], heads)
    return columns, kb, vb, _calls(columns, causal, cp.rank, src, q_shape[-2])


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


@stays_eager  # sends round the ring, between the compiled parts
def ring_attention(
    cp: Any,  # graph_ops/context.py's ContextParallel
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


TOKEN_MAJOR.add(ring_attention)
