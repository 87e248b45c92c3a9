"""Factories for the command-line tests (``autoshard explain cli_factories:tiny_gpt``)."""

from __future__ import annotations

import torch

from autoshard.demo import TinyGPT, next_token_loss, successor_batch


def tiny_gpt(batch: int = 8, seq: int = 16) -> dict:
    torch.manual_seed(0)
    ids, target = successor_batch(0, batch, seq)
    return {"model": TinyGPT(), "inputs": (ids,), "loss_fn": next_token_loss, "target": target}


class SquaredOutput(torch.nn.Module):  # returns its own loss, as a model without loss_fn must
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).square().mean()


def pair() -> tuple:
    return SquaredOutput(), (torch.randn(8, 4),)


def raises() -> None:
    raise RuntimeError("no weights here")


def wrong_shape() -> list:
    return [1, 2, 3]
