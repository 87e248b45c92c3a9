"""The small models autoshard itself builds: the demo's TinyGPT and its successor task (also what
``Hardware.measure()`` times), and Hugging Face models built from a config for ``autoshard ... --model
gpt2|llama|bert`` (no weights are downloaded)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VOCAB", "TinyGPT", "build", "next_token_loss", "successor_batch"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        # No attention biases (as in Llama): a key bias has a true gradient of zero (softmax ignores a
        # shift shared by all keys), so Adam would amplify rounding noise in it and blur the comparison.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model: token and position embeddings, pre-LN blocks, tied LM head."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, max_seq: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def successor_batch(step: int, batch: int, seq: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step`` of a task a small model learns in seconds, so the loss visibly falls: every
    token is followed by its successor in one fixed permutation of the vocabulary, from a random first
    token per row. The same on every rank (seeded by ``step``), so a resumed run continues the stream."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    tokens = [torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(1000 + step))]
    for _ in range(seq):
        tokens.append(successor[tokens[-1]])
    rows = torch.stack(tokens, dim=1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


VOCAB = 256


def build(name: str, batch: int, seq: int) -> dict[str, Any]:
    """``{"model", "inputs", "kwargs"}`` for a 2-block, width-64 ``name`` with labels (the model's own loss)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=max(seq, 64), resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                                          num_key_value_heads=4, intermediate_size=128,
                                          max_position_embeddings=max(seq, 64), pad_token_id=0, **common)  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    elif name == "bert":
        config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         intermediate_size=128, vocab_size=VOCAB, pad_token_id=0,
                                         max_position_embeddings=max(seq, 64), hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)  # fmt: skip
        model = transformers.BertForMaskedLM(config)
    else:
        raise ValueError(f"unknown model {name!r}; choose gpt2, llama or bert")
    ids, _ = successor_batch(0, batch, seq, VOCAB)
    kwargs: dict[str, Any] = {"labels": ids.clone()}
    if name != "bert":
        kwargs["use_cache"] = False
    return {"model": model, "inputs": (ids,), "kwargs": kwargs, "loss_fn": None, "target": None}
