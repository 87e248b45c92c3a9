"""Small Hugging Face models built from a config for ``autoshard ... --model gpt2|llama|bert`` (no weights
are downloaded), with a batch of the demo's successor task as example inputs."""

from __future__ import annotations

from typing import Any

import torch

from autoshard.demo import successor_batch

__all__ = ["VOCAB", "build"]

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
