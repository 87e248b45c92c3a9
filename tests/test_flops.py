"""FLOPs of every op with a FLOP rule, against counts worked out by hand (tier 1, no process group).

Each module's sizes differ from one another (channels, groups, kernel sides, contracted and output
widths, query and value widths), so a rule that reads the wrong size gives another number.
"""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from autoshard import passes
from autoshard.capture import capture
from autoshard.ir.meta import get_cost
from autoshard.ir.ops import packet

B = sympy.Symbol("B", integer=True, positive=True)
aten = torch.ops.aten


def flops(model: nn.Module, *inputs: torch.Tensor, **kwargs: object) -> list[tuple[object, sympy.Expr, sympy.Expr]]:
    """(op, forward FLOPs, backward FLOPs) of every node that has FLOPs, in graph order."""
    captured = capture(model, inputs, kwargs or None)
    passes.analyze(captured.gm, captured.rename)
    out = []
    for node in captured.gm.graph.nodes:
        if node.op == "call_function":
            cost = get_cost(node)
            if cost.flops_fwd != 0 or cost.flops_bwd != 0:
                out.append((packet(node.target), cost.flops_fwd, cost.flops_bwd))
    return out


def same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.expand(a - b) == 0


class TwoConvs(nn.Module):
    """A grouped conv on the data (no input gradient), then a strided, padded one on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(6, 4, kernel_size=(3, 2), groups=2)
        self.second = nn.Conv2d(4, 5, kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)).mean()


def test_conv_flops_count_input_channels_per_group_and_the_kernel() -> None:
    (op1, fwd1, bwd1), (op2, fwd2, bwd2) = flops(TwoConvs(), torch.randn(3, 6, 7, 5))
    assert op1 == op2 == aten.conv2d
    # first: out [B, 4, 5, 4]; each output sums C_in / groups x kh x kw = 3 x 3 x 2 products.
    assert same(fwd1, 2 * (B * 4 * 5 * 4) * (3 * 3 * 2))
    assert same(bwd1, fwd1)  # the input is data: only the weight's gradient
    # second: out [B, 5, 3, 2] (7x5 -> padded 9x7 -> stride 2 with a 3x3 kernel); 4 x 3 x 3 products each.
    assert same(fwd2, 2 * (B * 5 * 3 * 2) * (4 * 3 * 3))
    assert same(bwd2, 2 * fwd2)  # the input's gradient and the weight's


class BatchedProducts(nn.Module):
    """bmm with both operands needing gradients; baddbmm with only the second (and its own bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))
        self.weight = nn.Parameter(torch.randn(5, 7))
        self.bias = nn.Parameter(torch.randn(4, 7))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        w = self.weight.expand(a.shape[0], 5, 7)
        return torch.bmm(a * self.scale, w).mean() + torch.baddbmm(self.bias, a, w).mean()


def test_bmm_and_baddbmm_flops_contract_over_the_inner_size() -> None:
    (bmm, fwd1, bwd1), (baddbmm, fwd2, bwd2) = flops(BatchedProducts(), torch.randn(3, 4, 5))
    assert (bmm, baddbmm) == (aten.bmm, aten.baddbmm)
    # [B, 4, 5] @ [B, 5, 7]: B x 4 x 7 outputs, 5 products each; the bias adds no multiplies.
    assert same(fwd1, 2 * (B * 4 * 7) * 5)
    assert same(bwd1, 2 * fwd1)
    assert same(fwd2, 2 * (B * 4 * 7) * 5)
    assert same(bwd2, fwd2)  # a is data: only the weight's gradient


class Attention(nn.Module):
    """5 queries over 3 keys, 2 heads, query/key width 4 and value width 6."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.v = nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.q(x).view(b, 5, 2, 4).transpose(1, 2)
        k = self.k(x[:, :3]).view(b, 3, 2, 4).transpose(1, 2)
        v = self.v(x[:, :3]).view(b, 3, 2, 6).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).mean()


def test_attention_flops_with_a_value_width_unlike_the_query_width() -> None:
    costs = flops(Attention(), torch.randn(3, 5, 8))
    [(fwd, bwd)] = [(f, b) for op, f, b in costs if op == aten.scaled_dot_product_attention]
    # Scores: B x 2 heads x 5 x 3, each 4 products (q.k); output: B x 2 x 5 x 6, each 3 products (p.v).
    scores, values = 2 * (B * 2 * 5 * 3) * 4, 2 * (B * 2 * 5 * 6) * 3
    assert same(fwd, scores + values)
    assert same(bwd, 2 * fwd)
    # The projections: 5 (then 3, 3) rows per sample, 8 inputs each.
    linears = [(f, b) for op, f, b in costs if op == aten.linear]
    assert [f for f, _ in linears] == [2 * B * 5 * 8 * 8, 2 * B * 3 * 8 * 8, 2 * B * 3 * 12 * 8]
    assert [b for _, b in linears] == [f for f, _ in linears]  # x is data: weight gradients only


class Products(nn.Module):
    """mm and addmm (HF GPT-2's Conv1D) and matmul on 2-d operands: [n, 5] x [5, 7]."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 7))
        self.bias = nn.Parameter(torch.randn(7))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        flat = a.reshape(-1, 5)
        return (torch.mm(flat, self.weight).mean() + torch.addmm(self.bias, flat, self.weight).mean()
                + torch.matmul(flat, self.weight).mean())  # fmt: skip


@pytest.mark.parametrize("op", [aten.mm, aten.addmm, aten.matmul])
def test_matrix_products_contract_over_the_inner_size(op) -> None:
    costs = flops(Products(), torch.randn(3, 2, 5))
    [(fwd, bwd)] = [(f, b) for o, f, b in costs if o == op]
    assert same(fwd, 2 * (2 * B * 7) * 5)
    assert same(bwd, fwd)


def test_a_mixture_of_experts_costs_its_active_experts_only() -> None:
    """Hugging Face Mixtral's experts run as grouped matmuls over the k x tokens (token, expert) pairs, sorted
    by expert: each pair meets one expert's matrices, so the FLOPs are those of the pairs through one
    expert's MLP, not E of them (and not zero, as before the grouped matmuls had a rule)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hidden, inter, experts, top_k = 32, 48, 4, 2
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    counted = flops(model, ids, labels=ids, use_cache=False)
    grouped = [(fwd, bwd) for op, fwd, bwd in counted if "grouped_mm" in str(op)]
    assert len(grouped) == 2, counted  # gate and up fused, then down
    s = sympy.Symbol("S", integer=True, positive=True)
    pairs = top_k * B * s
    (up_fwd, up_bwd), (down_fwd, down_bwd) = grouped
    assert same(up_fwd, 2 * pairs * hidden * 2 * inter)  # [pairs, H] by [E, H, 2I]
    assert same(down_fwd, 2 * pairs * inter * hidden)  # [pairs, I] by [E, I, H]
    assert same(up_bwd, 2 * up_fwd) and same(down_bwd, 2 * down_fwd)  # the pairs' and the experts' gradients


class GroupedMatmuls(nn.Module):
    """aten._grouped_mm both ways: rows by a group's matrix ([B, 16] by [2, 16, 24]), and each group's rows
    contracted on their own ([16, B] by [B, 24] -> [2, 16, 24], the form of an expert's weight gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, 16, 24, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, x_by_column: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        y = torch._grouped_mm(x, self.experts, offs)
        return torch._grouped_mm(x_by_column, y, offs).float().sum()


def test_grouped_matmul_flops_are_one_matrix_a_row_and_one_product_a_group() -> None:
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    (op1, fwd1, bwd1), (op2, fwd2, bwd2) = flops(GroupedMatmuls(), x, x.t().contiguous(), offs)
    assert op1 == op2 == aten._grouped_mm
    assert same(fwd1, 2 * B * 16 * 24)  # each of the B rows through one [16, 24] matrix
    assert same(bwd1, fwd1)  # the rows are data: only the experts' gradient
    assert same(fwd2, 2 * 16 * 24 * 8)  # [16, 24] per group, over its rows: 8 in all (a width, not the batch)
    assert same(bwd2, fwd2)  # y's gradient; the other operand is data
