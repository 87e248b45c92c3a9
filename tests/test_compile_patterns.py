"""Graph patterns from Hugging Face families that crashed compile: each compiles, or is refused cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import sharding as sharding_rules
from autoshard.capture import capture
from autoshard.ir.placements import Shard

aten = torch.ops.aten


def _ce(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, -2), target.flatten())


class LegacyCacheAttention(nn.Module):
    """XLM / GraniteMoe / a DynamicCache's first update: ``cat([torch.tensor([]), k], -2)``."""

    def __init__(self, width: int = 16, heads: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, w = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, w // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        k = torch.cat([torch.tensor([]), k], dim=-2)  # an empty cache, skipped by cat
        v = torch.cat([torch.tensor([]), v], dim=-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.o(y.transpose(1, 2).reshape(b, s, w)))


class NoGradGate(nn.Module):
    """A ``torch.no_grad()`` region in each block's forward (CPM-Ant's position bias, PhiMoE's router masks)."""

    def __init__(self, width: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = torch.sigmoid(self.gate(x))
        return x + self.down(F.gelu(self.up(x))) * scale


class NoGradModel(nn.Module):
    def __init__(self, width: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(NoGradGate(width, vocab) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DataDependentRouting(nn.Module):
    """Tokens picked by a computed mask: the linear's rows are a size known only from the data."""

    def __init__(self, width: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.expert = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        flat = x.reshape(-1, x.shape[-1])
        picked = torch.nonzero(flat[:, 0] > 0).squeeze(-1)
        out = flat.index_add(0, picked, self.expert(flat[picked]))
        return self.head(out.view_as(x))


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (4, 8), generator=gen)
    return ids, torch.randint(0, 32, (4, 8), generator=gen)


def _compile(model: nn.Module, mesh: autoshard.Mesh) -> autoshard.Program:
    ids, target = _example()
    return autoshard.compile(model, mesh, example_inputs=(ids,), loss_fn=_ce, example_target=target)


def test_cat_with_an_empty_cache_keeps_heads_sharded() -> None:
    torch.manual_seed(0)
    program = _compile(LegacyCacheAttention(), autoshard.Mesh(tp=2))
    weights = program.tp_report.weights
    for name in ("q", "k", "v"):
        assert weights[f"model.{name}.weight"] == Shard(0), name
    assert weights["model.o.weight"] == Shard(1)
    assert program.tp_report.fallbacks == {}


def test_a_rule_that_names_a_missing_dimension_falls_back_to_replicated(monkeypatch) -> None:
    def broken(ctx: sharding_rules.RuleInput) -> sharding_rules.Decision:
        x = ctx.node.args[0]
        return sharding_rules.Decision(Shard(7), {x: Shard(9)} if ctx.p(x) != sharding_rules.R else {})

    monkeypatch.setitem(sharding_rules.RULES, aten.gelu.default, broken)
    torch.manual_seed(0)
    program = _compile(NoGradModel(), autoshard.Mesh(tp=2))
    assert program.tp_report.fallbacks == {"aten.gelu.default": 2}
    assert "no valid placement" in program.explain()


def test_no_grad_region_is_inlined_with_eager_gradients() -> None:
    torch.manual_seed(0)
    model = NoGradModel()
    ids, target = _example()
    captured = capture(model, (ids,), loss_fn=_ce, example_target=target)
    assert not [n for n in captured.gm.graph.nodes if n.op == "get_attr" and n.target.startswith("submod")]
    loss = captured.gm(ids, target)[0]
    loss.backward()
    graph_grads = {k.removeprefix("model."): p.grad for k, p in captured.gm.named_parameters()}
    model.zero_grad()
    eager = _ce(model(ids), target)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for name, p in model.named_parameters():
        if p.grad is None:  # the gate is only read under no_grad
            assert graph_grads[name] is None or not graph_grads[name].any(), name
        else:
            torch.testing.assert_close(graph_grads[name], p.grad, msg=name)
    assert model.blocks[0].gate.weight.grad is None


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}, {"dp": 2}])
def test_no_grad_region_compiles_for_every_mesh(mesh: dict[str, int]) -> None:
    torch.manual_seed(0)
    program = _compile(NoGradModel(), autoshard.Mesh(**mesh))
    if "tp" in mesh:
        assert any(isinstance(p, Shard) for p in program.tp_report.weights.values())
        assert program.tp_report.fallbacks == {}


def test_sizes_known_only_from_the_data_are_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(autoshard.AutoshardError, match="known only from the data"):
        _compile(DataDependentRouting(), autoshard.Mesh(dp=2))
