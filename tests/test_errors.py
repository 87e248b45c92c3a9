"""Bad input gets a clear error naming the problem and the fix, before any rank works (exact messages)."""

from __future__ import annotations

import re

import pytest
import torch
from cases import build_case
from torch import nn

import autoshard
from autoshard import CaptureError, InputError, Mesh, MeshError


@pytest.fixture(scope="module")
def mlp():
    return build_case("mlp")


def compile_mlp(case, mesh=1, **kw):
    batch = case.batches[0]
    args = {"loss_fn": case.loss_fn, "example_target": batch.target, **kw}
    inputs = args.pop("example_inputs", batch.inputs)
    return autoshard.compile(case.model, mesh, inputs, **args)


def test_non_positive_degree() -> None:
    msg = "mesh degree dp=0 is not a positive integer; give every degree as an int >= 1, e.g. Mesh(dp=2, tp=1, pp=1)"
    with pytest.raises(MeshError, match=re.escape(msg)):
        Mesh(dp=0)


def test_non_positive_int_mesh(mlp) -> None:
    msg = "mesh=0 is not a positive world size; pass the number of ranks or a Mesh"
    with pytest.raises(MeshError, match=re.escape(msg)):
        compile_mlp(mlp, mesh=0)


def test_batch_not_divisible_by_dp(mlp) -> None:
    msg = "the example global batch of 8 rows is not divisible by dp=3; use a global batch that is a multiple of 3"
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, mesh=Mesh(dp=3))


def test_batch_not_divisible_by_the_planned_dp(mlp) -> None:
    msg = "the example global batch of 8 rows is not divisible by dp=16; use a global batch that is a multiple of 16"
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, mesh=autoshard.Mesh(dp=16))


def test_example_inputs_of_the_wrong_type(mlp) -> None:
    msg = (
        "example_inputs[0] is of type list, expected a torch.Tensor; pass non-tensor arguments as example_kwargs "
        "(they are baked into the graph as constants)"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, example_inputs=([1.0, 2.0],))
    msg = (
        "example_inputs must be a non-empty tuple of tensors (one global batch), got dict; "
        "e.g. example_inputs=(input_ids,)"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, example_inputs={"x": 1})


def test_example_kwargs_of_the_wrong_type(mlp) -> None:
    msg = (
        "example_kwargs['mask'] is of type list; keyword inputs must be tensors or constants "
        "(None, bool, int, float, str)"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, example_kwargs={"mask": [1, 0]})


def test_optimizer_that_is_not_callable(mlp) -> None:
    msg = (
        "optimizer must be a callable(params) -> torch.optim.Optimizer, got str; "
        "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, optimizer="adamw")


def test_step_before_an_optimizer_was_given(mlp) -> None:
    program = compile_mlp(mlp)
    msg = "step() needs an optimizer: compile(..., optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))"
    with pytest.raises(InputError, match=re.escape(msg)):
        program.step(*mlp.batches[0].inputs, target=mlp.batches[0].target)


def test_optimizer_factory_that_returns_something_else(mlp) -> None:
    msg = "optimizer(params) must return a torch.optim.Optimizer, got list"
    with pytest.raises(InputError, match=re.escape(msg)):  # at compile time, before any step
        compile_mlp(mlp, optimizer=lambda params: list(params))


def test_loss_fn_without_example_target(mlp) -> None:
    msg = "loss_fn needs an example target to capture the loss: pass example_target=..."
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, example_target=None)


def test_loss_that_is_not_a_scalar(mlp) -> None:
    msg = (
        "the loss must be a floating-point scalar tensor, got a 2-d float32 tensor; "
        "reduce it with .mean() or .sum() in loss_fn"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, loss_fn=lambda out, target: out)


def test_model_that_returns_no_loss(mlp) -> None:
    msg = (
        "loss_fn is None, so the model's output is taken as the loss, but it is a 2-d float32 tensor, not a "
        "floating-point scalar; return the loss from the model, or pass loss_fn=callable(outputs, target) and "
        "example_target=..."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        autoshard.compile(mlp.model, 1, mlp.batches[0].inputs)
    msg = (
        "loss_fn is None, so the model must return the loss (a scalar tensor, an output with .loss, or a tuple "
        "whose first element is the loss), but it returned dict"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        autoshard.compile(ReturnsDict(), 1, mlp.batches[0].inputs)


class ReturnsDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": x}


class DataDependentBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:  # the line the error must point at
            return y.mean()
        return -y.mean()


def test_model_that_cannot_be_captured() -> None:
    with pytest.raises(CaptureError) as info:
        autoshard.compile(DataDependentBranch(), 1, (torch.randn(4, 4),))
    message = str(info.value)
    first, where, hint = message.splitlines()
    assert first.startswith(
        "autoshard could not capture DataDependentBranch with torch.export (non-strict, batch dimension dynamic): "
        "GuardOnDataDependentSymNode: "
    )
    assert where == (
        f'  failing source: File "{__file__}", line {DataDependentBranch.forward.__code__.co_firstlineno + 2}, '
        f"in forward: if y.sum() > 0:  # the line the error must point at"
    )
    assert hint == (
        "  try: make data-dependent Python control flow tensor-free (torch.where, torch.cond), pass constant "
        "arguments through example_kwargs (e.g. use_cache=False for HF models), and check that the model runs "
        "eagerly on example_inputs"
    )


def test_model_that_is_not_a_module() -> None:
    msg = "model must be a torch.nn.Module, got function"
    with pytest.raises(InputError, match=re.escape(msg)):
        autoshard.compile(lambda x: x, 1, (torch.randn(2, 2),))


def test_mesh_of_the_wrong_type(mlp) -> None:
    msg = "mesh must be an autoshard.Mesh, a torch DeviceMesh, or an int world size, got str"
    with pytest.raises(InputError, match=re.escape(msg)):
        compile_mlp(mlp, mesh="dp=2")


def test_step_inputs_that_do_not_match_the_compiled_call(mlp) -> None:
    program = compile_mlp(mlp, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    msg = "expected 1 positional input tensor(s) as at compile time, got 2"
    with pytest.raises(InputError, match=re.escape(msg)):
        program.step(*mlp.batches[0].inputs, mlp.batches[0].inputs[0], target=mlp.batches[0].target)
    msg = "this program computes loss_fn(outputs, target): pass step(..., target=...)"
    with pytest.raises(InputError, match=re.escape(msg)):
        program.step(*mlp.batches[0].inputs)


def test_step_inputs_of_another_dtype_or_size_than_compiled() -> None:
    case = build_case("gpt2")
    batch = case.batches[0]
    program = autoshard.compile(case.model, 1, batch.inputs, example_kwargs=batch.kwargs, optimizer=torch.optim.SGD)
    ids, labels = batch.inputs[0], batch.kwargs["labels"]
    msg = (
        "step(): input 0 is torch.float32 of shape (8, 12); the program was compiled for torch.int64 of shape (B, S) "
        "(B and S may vary, other sizes and the dtype may not)"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        program.step(ids.float(), labels=labels)
    with pytest.raises(InputError, match=re.escape("step(): labels is torch.int64 of shape (8,); the program was")):
        program.step(ids, labels=labels[:, 0])


def test_step_target_of_another_size_than_compiled(mlp) -> None:
    program = compile_mlp(mlp, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = mlp.batches[0].inputs[0], mlp.batches[0].target
    with pytest.raises(InputError, match=re.escape("step(): input 0 is torch.float32 of shape (8, 15); the program")):
        program.step(x[:, :15], target=y)
    with pytest.raises(InputError, match=re.escape("step(): target is torch.float32 of shape (8,); the program")):
        program.step(x, target=y.float())


def test_a_mixture_of_experts_in_transformers_eager_loop_is_told_the_implementation_that_captures() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def mixtral(implementation: str) -> nn.Module:
        config = transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
            experts_implementation=implementation,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(config)

    ids = torch.randint(0, 64, (2, 8))
    kwargs = {"labels": ids, "use_cache": False}
    with pytest.raises(CaptureError) as info:
        autoshard.compile(mixtral("eager"), 1, (ids,), kwargs)
    lines = str(info.value).splitlines()
    assert "GuardOnDataDependentSymNode" in lines[0] and "modeling_mixtral.py" in lines[1]
    assert lines[2] == (
        "  this model's experts run transformers' 'eager' implementation, a Python loop over the experts the "
        "batch routes to, which no trace can hold: build it with experts_implementation='grouped_mm' "
        "(transformers' default), which runs the same experts as grouped matmuls"
    )
    autoshard.compile(mixtral("grouped_mm"), 1, (ids,), kwargs)  # the fix the message names
