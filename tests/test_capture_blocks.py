"""Capture of deep models on the meta device: two and three blocks traced, the rest stamped (tier 1).

The stamped graph must be the one a full trace makes, node for node; blocks that are not copies of one
another (configured apart, or computing with their index) must be traced in full.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import autoshard
import autoshard.planner.api
from autoshard import capture as capture_module
from autoshard.capture import capture
from autoshard.capture.blocks import MIN_BLOCKS, _in_block, find_repeated_blocks, first_difference

transformers.logging.set_verbosity_error()


def _meta_model(family: str, layers: int = MIN_BLOCKS, **config: object) -> nn.Module:
    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                       max_position_embeddings=64, **config)  # fmt: skip
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=96, n_positions=64, **config)
        cls = transformers.GPT2LMHeadModel
    with torch.device("meta"):
        return cls(cfg)


def _ids() -> torch.Tensor:
    return torch.zeros(4, 16, dtype=torch.long, device="meta")


def _capture(model: nn.Module, full: bool, monkeypatch: pytest.MonkeyPatch) -> capture_module.Captured:
    with monkeypatch.context() as patch:
        if full:
            patch.setattr(capture_module, "find_repeated_blocks", lambda model: None)
        return capture(model, (_ids(),), {"labels": _ids(), "use_cache": False})


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def captures(request: pytest.FixtureRequest) -> tuple[nn.Module, capture_module.Captured, capture_module.Captured]:
    """A meta model's capture stamped, and traced in full."""
    model = _meta_model(request.param)
    with pytest.MonkeyPatch.context() as patch:
        stamped = _capture(model, False, patch)
        full = _capture(model, True, patch)
    return model, stamped, full


def test_stamped_graph_is_the_full_trace(
    captures: tuple[nn.Module, capture_module.Captured, capture_module.Captured],
) -> None:
    _, stamped, full = captures
    assert stamped.stamped_blocks is not None and stamped.stamped_blocks.count == MIN_BLOCKS
    assert full.stamped_blocks is None
    assert f"traced 2 and 3 blocks deep, stamped to all {MIN_BLOCKS}" in str(stamped)
    assert first_difference(full.gm, stamped.gm) is None
    assert (stamped.rename, stamped.example_sizes, stamped.call) == (full.rename, full.example_sizes, full.call)
    shapes = {name: (p.shape, p.dtype) for name, p in full.gm.named_parameters()}
    assert {name: (p.shape, p.dtype) for name, p in stamped.gm.named_parameters()} == shapes
    assert [n for n, _ in stamped.gm.named_buffers()] == [n for n, _ in full.gm.named_buffers()]


def test_first_difference_names_a_changed_node(
    captures: tuple[nn.Module, capture_module.Captured, capture_module.Captured],
) -> None:
    _, stamped, full = captures
    blocks = stamped.stamped_blocks
    assert blocks is not None
    in_a_stamped_block = [
        n
        for n in stamped.gm.graph.nodes
        if n.op == "call_function" and _in_block(n, blocks.graph_prefix, blocks.count - 2)
    ]
    stamped_block = in_a_stamped_block[len(in_a_stamped_block) // 2]
    target = stamped_block.target
    stamped_block.target = torch.ops.aten.neg.default
    try:
        difference = first_difference(full.gm, stamped.gm)
        assert difference is not None and "aten.neg.default" in difference.split(" traced, ")[1]
    finally:
        stamped_block.target = target
    assert first_difference(full.gm, stamped.gm) is None


def test_a_plan_from_the_stamped_graph_is_the_full_traces(
    captures: tuple[nn.Module, capture_module.Captured, capture_module.Captured], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, *traced = captures

    def planned(captured: capture_module.Captured) -> list[tuple[str, float, int]]:
        monkeypatch.setattr(autoshard.planner.api, "capture", lambda *args: captured)
        report = autoshard.plan(model, 8, (_ids(),), {"labels": _ids(), "use_cache": False})
        return [(str(c.plan), c.step_time, c.memory.total) for c in report.candidates]

    stamped, full = map(planned, traced)
    assert stamped == full


class _Block(nn.Module):
    def __init__(self, index: int, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.index = index
        self.kind = "wide" if index % 3 == 2 else "narrow"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * (2.0 if self.kind == "wide" else 1.0)


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


class _Scaled(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) / (self.index + 1)


def test_blocks_that_compute_with_their_index_are_traced_in_full() -> None:
    # Their attributes match (the index aside) but their graphs do not: the check between the two and the
    # three block traces sees it.
    with torch.device("meta"):
        model = _Stack([_Scaled(0) for _ in range(MIN_BLOCKS)])
        for i, block in enumerate(model.blocks):
            block.index = i
    assert find_repeated_blocks(model) is not None
    captured = capture(model, (torch.zeros(4, 8, device="meta"),))
    assert captured.stamped_blocks is None
    divisors = [n.args[1] for n in captured.gm.graph.nodes if n.target is torch.ops.aten.div.Tensor]
    assert divisors == [float(i + 1) for i in range(MIN_BLOCKS)]


def test_blocks_configured_apart_are_not_stamped() -> None:
    # GPT-2 scaling attention by 1 / (layer_idx + 1) keeps the scale as an attribute of each block.
    assert find_repeated_blocks(_meta_model("gpt2", scale_attn_by_inverse_layer_idx=True)) is None
    # Every third block differs in an attribute its forward reads (as sliding-window layers do), which the
    # two and three block traces would not show: the attributes are compared first.
    with torch.device("meta"):
        model = _Stack([_Block(i) for i in range(MIN_BLOCKS)])
    assert find_repeated_blocks(model) is None
    captured = capture(model, (torch.zeros(4, 8, device="meta"),))
    assert captured.stamped_blocks is None
    assert sum(n.target is torch.ops.aten.relu.default for n in captured.gm.graph.nodes) == MIN_BLOCKS


def test_blocks_alike_but_for_their_index_are_stamped() -> None:
    with torch.device("meta"):
        model = _Stack([_Block(0) for _ in range(MIN_BLOCKS)])
        for i, block in enumerate(model.blocks):
            block.index = i
    blocks = find_repeated_blocks(model)
    assert blocks is not None and (blocks.path, blocks.count) == ("blocks", MIN_BLOCKS)
    captured = capture(model, (torch.zeros(4, 8, device="meta"),))
    assert captured.stamped_blocks == blocks
    linears = [n.args[1].target for n in captured.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears == [f"model.blocks.{i}.linear.weight" for i in range(MIN_BLOCKS)]


def test_tables_of_functions_are_compared_and_hooks_refused() -> None:
    # transformers (5.25) keeps each attention's kernel functions in a dict of modules outside _modules:
    # alike when every block's table holds the same names and alike modules; a hook (keyed by its handle)
    # is not known to be alike.
    def stack() -> _Stack:
        with torch.device("meta"):
            model = _Stack([_Block(0) for _ in range(MIN_BLOCKS)])
        for block in model.blocks:
            block.kernels = {"activation": nn.ReLU()}
        return model

    assert find_repeated_blocks(stack()) is not None
    model = stack()
    model.blocks[3].kernels = {"activation": nn.GELU()}
    assert find_repeated_blocks(model) is None
    model = stack()
    model.blocks[3].register_forward_hook(lambda module, args, out: out)
    assert find_repeated_blocks(model) is None
    model = stack()  # each block keeps a reference back to the model, outside _modules: refused, not recursed
    for block in model.blocks:
        block.kernels = {"owner": model}
    assert find_repeated_blocks(model) is None


def test_models_with_weights_and_short_lists_are_traced_in_full() -> None:
    model = _Stack([_Block(0) for _ in range(MIN_BLOCKS)])  # real weights: the graph runs, so it is traced
    assert capture(model, (torch.zeros(4, 8),)).stamped_blocks is None
    with torch.device("meta"):
        short = _Stack([_Block(0) for _ in range(MIN_BLOCKS - 1)])
    assert find_repeated_blocks(short) is None


class _Counted(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.blocks) != MIN_BLOCKS:
            raise ValueError("this model runs all of its blocks or none")
        return super().forward(x)


def test_a_model_that_refuses_fewer_blocks_is_traced_in_full() -> None:
    with torch.device("meta"):
        model = _Counted([_Block(0) for _ in range(MIN_BLOCKS)])
    captured = capture(model, (torch.zeros(4, 8, device="meta"),))
    assert captured.stamped_blocks is None
    assert len(model.blocks) == MIN_BLOCKS  # the list is whole again
