"""Rank functions of the context-parallel tests: ring attention against SDPA on the whole sequence."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.distributed.comm import CommCounter
from autoshard.graph_ops import context, ring_attention


def ring_against_sdpa(
    rank: int, world_size: int, cases: list[dict[str, Any]], fused: bool = True, attention: str = "ring"
) -> list[dict[str, float]]:
    """For each case (heads, kv_heads, seq, mask: None | "padding" | "random" | "additive" | "causal", causal):
    this rank's ring attention of its tokens, forward and backward, against SDPA on the whole sequence (every
    rank draws the same q, k, v, mask and output gradient); the largest differences. ``fused=False``: the
    blocks as other devices than the CPU compute them (the formulas written out). ``attention="all_to_all"``:
    the sequence traded for heads instead of the ring."""
    cp = context.ContextParallel(world_size, rank, dist.group.WORLD, CommCounter())
    kernel = ring_attention._fused
    if not fused:
        ring_attention._fused = lambda q: False
    try:
        return [_one_case(cp, case, attention) for case in cases]
    finally:
        ring_attention._fused = kernel


def _one_case(cp: context.ContextParallel, case: dict[str, Any], attention: str) -> dict[str, float]:
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    batch, heads, kv_heads, seq, dim = 2, case["heads"], case["kv_heads"], case["seq"], 8
    q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64)
    mask = None
    if case["mask"] == "padding":  # the last keys of the second row are padding
        mask = torch.ones(batch, 1, 1, seq, dtype=torch.bool)
        mask[1, ..., seq - seq // 4 :] = False
    elif case["mask"] == "random":  # every query keeps its own key (no row wholly masked)
        mask = (torch.rand(batch, 1, seq, seq, generator=gen) > 0.4) | torch.eye(seq, dtype=torch.bool)
    elif case["mask"] == "additive":
        mask = torch.randn(batch, 1, seq, seq, generator=gen, dtype=torch.float64)
    elif case["mask"] == "causal":  # as Hugging Face models pass it: whole quarters of blocks hidden
        mask = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    gqa = {"enable_gqa": True} if kv_heads != heads else {}
    expected = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=case["causal"], **gqa)
    expected.backward(grad)
    pos = cp.positions(seq, q.device)
    local = [t.index_select(2, pos).clone().requires_grad_() for t in (q, k, v)]
    rows = mask if mask is None or mask.shape[-2] == 1 else mask.index_select(2, pos)
    if attention == "all_to_all":  # every query attends: the mask whole
        got = context.all_to_all_attention(cp, *local, mask, is_causal=case["causal"], seq_len=seq)
    else:
        got = context.ring_attention(cp, *local, rows, is_causal=case["causal"], enable_gqa=bool(gqa), seq_len=seq)
    got.backward(grad.index_select(2, pos))
    diffs = {"out": (got - expected.index_select(2, pos)).abs().max().item()}
    for name, mine, ref in zip(("dq", "dk", "dv"), local, whole):
        diffs[name] = (mine.grad - ref.grad.index_select(2, pos)).abs().max().item()
    diffs["ring_bytes"] = float(cp.comm.volume_bytes["cp_ring"])
    diffs["all_to_all_bytes"] = float(cp.comm.volume_bytes["cp_all_to_all"])
    cp.comm.reset()
    return diffs


def tiny_gpt_cp(rank: int, world_size: int, seq: int, steps: int = 3) -> dict[str, Any]:
    """The demo's TinyGPT (causal SDPA by is_causal, targets given apart, logits flattened for the loss) trained
    at cp=world_size on one sequence batch; and on one device, here, for comparison."""
    import autoshard
    from autoshard.models import TinyGPT, next_token_loss

    def model() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(vocab=64, dim=32, heads=4, layers=2, max_seq=seq)

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, seq + 1), generator=gen) for _ in range(steps)]

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)

    ids, target = batches[0][:, :-1], batches[0][:, 1:]
    program = autoshard.compile(
        model(), autoshard.Mesh(cp=world_size), (ids,), loss_fn=next_token_loss, optimizer=adamw,
        example_target=target, plan={},
    )  # fmt: skip
    losses = [program.step(b[:, :-1], target=b[:, 1:]) for b in batches]
    reference, optimizer, expected = model(), None, []
    optimizer = adamw(reference.parameters())
    for b in batches:
        optimizer.zero_grad()
        loss = next_token_loss(reference(b[:, :-1]), b[:, 1:])
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    state = program.full_state_dict()
    worst = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()) if state else 0.0
    return {"losses": losses, "expected": expected, "worst": worst}


class PooledAuxGPT(torch.nn.Module):
    """TinyGPT whose loss adds a penalty on the mean hidden state over every token (a sum over the sequence read
    nonlinearly: under cp a partial value all-reduced before it is squared)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        from autoshard.models import TinyGPT

        torch.manual_seed(0)
        self.gpt = TinyGPT(vocab=64, dim=32, heads=4, layers=2, max_seq=seq)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gpt = self.gpt
        x = gpt.wte(ids) + gpt.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in gpt.blocks:
            x = block(x)
        pooled = x.mean(dim=(0, 1))
        return gpt.lm_head(gpt.ln_f(x)), (pooled - 0.1).pow(2).sum()


def pooled_loss(outputs: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    logits, penalty = outputs
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + 10.0 * penalty


def pooled_gpt_cp(rank: int, world_size: int, seq: int, mesh: dict[str, int], steps: int = 3) -> dict[str, Any]:
    """PooledAuxGPT trained under ``mesh`` and on one device, here: losses and the largest parameter difference."""
    import autoshard

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2 * mesh.get("dp", 1), seq + 1), generator=gen) for _ in range(steps)]

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)

    ids, target = batches[0][:, :-1], batches[0][:, 1:]
    program = autoshard.compile(
        PooledAuxGPT(seq), autoshard.Mesh(**mesh), (ids,), loss_fn=pooled_loss, optimizer=adamw,
        example_target=target, plan={},
    )  # fmt: skip
    local = program.local_batch
    losses = [program.step(local(b[:, :-1]), target=local(b[:, 1:])) for b in batches]
    reference = PooledAuxGPT(seq)
    optimizer, expected = adamw(reference.parameters()), []
    for b in batches:
        optimizer.zero_grad()
        loss = pooled_loss(reference(b[:, :-1]), b[:, 1:])
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    state = program.full_state_dict()
    worst = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()) if state else 0.0
    return {"losses": losses, "expected": expected, "worst": worst, "report": str(program.compiled.cp_report)}


def kept_against_accounting(rank: int, world_size: int, attention: str, seq: int) -> dict[str, int]:
    """A TinyGPT forward of this rank's tokens at cp=world_size: the distinct storages autograd saves (not the
    parameters or the inputs), and what the compiler's accounting of the rank graph says it keeps."""
    import autoshard
    from autoshard.models import TinyGPT, next_token_loss

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=4, layers=2, max_seq=seq)
    ids = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    ids, target = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    program = autoshard.compile(
        model, autoshard.Mesh(cp=world_size), (ids,), loss_fn=next_token_loss, example_target=target,
        plan={"cp_attention": attention},
    )  # fmt: skip
    gm = program.runtime.graphs[0]
    held = {t.untyped_storage()._cdata for t in [*gm.parameters(), *gm.buffers(), ids, target]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in held:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gm(ids, target)[0]
    loss.backward()
    ((_, memory),) = program.compiled.cost.saved_for_backward
    return {
        "saved": sum(saved.values()), "accounted": int(memory.evaluate(B=2, S=seq)["kept"]),
        "unaccounted": list(memory.unaccounted),
    }  # fmt: skip
