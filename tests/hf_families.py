"""Hugging Face language-model families built small from their config alone (no download).

Every causal-LM, masked-LM and seq2seq model class that ``transformers`` registers, with each size
attribute its config names made small (recursively through sub-configs) and dropout off, so the
sweep in test_families.py can compile each one and the training tests can run some on real ranks.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

BATCH, SEQ = 4, 16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, POS, LAYERS = 64, 4, 2, 16, 128, 256, 64, 2
MAX_PARAMS = 30_000_000

# Size attributes by name -> small value. Names are matched exactly, in every (sub-)config.
OVERRIDES: dict[str, Any] = {}
for _names, _value in (
    # layers
    (
        "num_hidden_layers n_layer n_layers num_layers encoder_layers decoder_layers num_decoder_layers "
        "num_encoder_layers speech_encoder_layers t2u_encoder_layers t2u_decoder_layers n_input_layers "
        "n_recurrent_layers n_output_layers num_layers_per_stack num_sparse_encoder_layers "
        "num_sparse_decoder_layers num_self_attends_per_block",
        LAYERS,
    ),
    # width
    (
        "hidden_size n_embd d_model dim embed_dim d_embed model_dim embedding_size word_embed_proj_dim "
        "emb_dim embedding_dim true_hidden_size attention_hidden_size lru_width backbone_hidden_size "
        "pooler_hidden_size input_embedding_size output_embedding_size d_latents router_hidden_size",
        HIDDEN,
    ),
    # heads
    (
        "num_attention_heads n_head n_heads num_heads encoder_attention_heads decoder_attention_heads "
        "attention_heads num_encoder_attention_heads num_decoder_attention_heads swa_num_attention_heads "
        "index_n_heads linear_num_value_heads linear_num_heads num_self_attention_heads "
        "num_cross_attention_heads speech_encoder_attention_heads t2u_encoder_attention_heads "
        "t2u_decoder_attention_heads mamba_n_heads mamba_num_heads n_mamba_heads",
        HEADS,
    ),
    (
        "num_key_value_heads num_kv_heads n_kv_heads multi_query_group_num swa_num_key_value_heads "
        "linear_num_key_heads num_query_groups",
        KV_HEADS,
    ),
    # per-head sizes
    (
        "head_dim d_kv kv_channels attention_head_size d_head dim_head swa_head_dim index_head_dim "
        "qk_head_dim v_head_dim linear_key_head_dim linear_value_head_dim linear_head_dim attention_head_dim "
        "mamba_d_head mamba_head_dim mamba_headdim",
        HEAD_DIM,
    ),
    ("qk_rope_head_dim qk_nope_head_dim rotary_dim", 8),
    (
        "q_lora_rank kv_lora_rank o_lora_rank laurel_rank embedding_rank gated_norm_rank loop_gate_rank "
        "adapter_rank hc_lowrank",
        32,
    ),
    # feed-forward
    (
        "intermediate_size n_inner ffn_dim d_ff encoder_ffn_dim decoder_ffn_dim ffn_hidden_size "
        "moe_intermediate_size shared_expert_intermediate_size hidden_dim dim_ff dff d_inner "
        "shared_intermediate_size shared_experts_intermediate_size dense_intermediate_size "
        "intermediate_size_mlp expert_ffn_hidden_size moe_shared_expert_intermediate_size feed_forward_size "
        "t2u_encoder_ffn_dim t2u_decoder_ffn_dim speech_encoder_intermediate_size intra_bottleneck_size "
        "prompt_mid_dim mamba_d_ssm",
        INTER,
    ),
    # vocabularies
    ("vocab_size src_vocab_size tgt_vocab_size decoder_vocab_size unpadded_vocab_size", VOCAB),
    ("vocab_size_per_layer_input", VOCAB),
    (
        "entity_vocab_size t2u_vocab_size char_vocab_size "
        "pronunciation_vocab_size shape_vocab_size encoder_hash_byte_group_vocab",
        64,
    ),
    ("hidden_size_per_layer_input ple_embed_dim pronunciation_embed_dim shape_embed_dim entity_emb_size", 16),
    # positions
    (
        "max_position_embeddings n_positions n_ctx max_seq_len max_sequence_length seq_length "
        "max_encoder_position_embeddings max_decoder_position_embeddings max_2d_position_embeddings "
        "max_target_positions left_max_position_embeddings right_max_position_embeddings context_length",
        POS,
    ),
    # experts
    ("num_experts num_local_experts n_routed_experts moe_num_experts num_centroids", 4),
    ("num_experts_per_tok num_experts_per_token moe_topk moe_k top_k centroid_intermediate_top_k", 2),
    (
        "n_shared_experts num_shared_experts n_group topk_group num_expert_group first_k_dense_replace "
        "decoder_sparse_step encoder_sparse_step moe_layer_freq",
        1,
    ),
    # state-space / recurrent
    ("state_size mamba_d_state ssm_state_size d_state", 16),
    ("mamba_chunk_size chunk_size", 16),
    ("time_step_rank mamba_dt_rank", 8),
    ("num_kv_shared_layers", 0),
    ("n_groups mamba_n_groups", 1),
):
    for _name in _names.split():
        OVERRIDES[_name] = _value

SPECIAL_IDS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 0,
    "sep_token_id": 2,
    "cls_token_id": 1,
    "mask_token_id": 3,
    "unk_token_id": 3,
}
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers")


def fix_up(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Keep the relations configs validate between the sizes just shrunk."""
    heads = next((k for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(d.get(k), int)), None)
    for kv in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        if heads and isinstance(d.get(kv), int) and d[kv] == d[heads]:
            out[kv] = out[heads]  # multi-head attention stays multi-head (some families refuse GQA)
    if isinstance(d.get("qk_rope_head_dim"), int):  # multi-head latent attention
        out["qk_rope_head_dim"], out["qk_nope_head_dim"] = 8, 8
        if "qk_head_dim" in d:
            out["qk_head_dim"] = 16
        if "head_dim" in d:
            out["head_dim"] = 8
        if "v_head_dim" in d:
            out["v_head_dim"] = 16
    for key in ("num_experts_per_tok",):
        if key in d and d[key] is None:
            out[key] = OVERRIDES[key]
    hidden = out.get("hidden_size")
    for n_heads, d_head, expand in (
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("mamba_num_heads", "mamba_head_dim", "mamba_expand"),
        ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
        ("num_heads", "head_dim", "expand"),
    ):
        if isinstance(out.get(n_heads), int) and isinstance(out.get(d_head), int) and isinstance(hidden, int):
            if n_heads == "num_heads" and d.get("model_type") not in ("mamba2",):
                continue
            inner = out.get("mamba_d_ssm") or int((out.get(expand) or 2) * hidden)
            out[n_heads] = max(1, inner // out[d_head])
    split = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
    if all(isinstance(out.get(k), int) for k in split) and "num_hidden_layers" in out:
        for k in split:
            out[k] = 1
        out["num_hidden_layers"] = len(split)
    if isinstance(d.get("per_layer_config"), dict):
        per_layer = {}
        for k, v in d["per_layer_config"].items():  # keyed by layer index or by layer type
            if str(k).isdigit() and int(k) >= out.get("num_hidden_layers", LAYERS):
                continue
            v = shrink(v) if isinstance(v, dict) else v
            if isinstance(v, dict) and "head_dim" in v:
                nope = v.get("qk_nope_head_dim", out.get("qk_nope_head_dim"))
                rope = v.get("qk_rope_head_dim", out.get("qk_rope_head_dim"))
                if isinstance(nope, int) and isinstance(rope, int):
                    v["head_dim"] = nope + rope
            per_layer[k] = v
        out["per_layer_config"] = per_layer


def shrink(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict with every known size attribute made small (recursively into sub-configs)."""
    out = dict(d)
    old_layers = next((d[k] for k in LAYER_COUNT_KEYS if isinstance(d.get(k), int)), None)
    for key, value in d.items():
        if key in ("id2label", "label2id", "rope_parameters", "rope_scaling"):
            continue
        if isinstance(value, dict) and ("model_type" in value or any(k in value for k in OVERRIDES)):
            out[key] = shrink(value)
        elif key == "attention_window":  # Longformer / LED: windows smaller than the sequence
            out[key] = [8] * len(value) if isinstance(value, list) else 8
        elif key in ("vocab_size",) and value is None:
            out[key] = VOCAB
        elif key in OVERRIDES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, OVERRIDES[key]) if value > 0 else value
        elif key in SPECIAL_IDS and value is not None:
            small = SPECIAL_IDS[key]
            if isinstance(value, list):
                out[key] = [v if v < VOCAB else small for v in value]
            elif isinstance(value, int) and value >= VOCAB:
                out[key] = small
        elif isinstance(value, list) and old_layers and len(value) == old_layers and old_layers > LAYERS:
            kinds = []  # keep one layer of each kind (e.g. attention and mamba), up to LAYERS
            for v in value:
                if v not in kinds:
                    kinds.append(v)
            keep = (kinds + [value[0]] * LAYERS)[:LAYERS] if len(kinds) < LAYERS else kinds[:LAYERS]
            out[key] = keep
    for key, value in d.items():  # the training tests compare exactly with one device: no dropout
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            out[key] = 0.0
    fix_up(d, out)
    if isinstance(out.get("sliding_window"), int) and out["sliding_window"] > POS:
        out["sliding_window"] = POS
    for key in ("max_window_layers",):
        if isinstance(out.get(key), int):
            out[key] = min(out[key], LAYERS)
    return out


def families() -> list[dict[str, str]]:
    """Every (model type, class) of the seq2seq, causal and masked LM auto mappings, sorted."""
    from transformers.models.auto import modeling_auto as m

    rows, seen = [], set()
    for task, mapping in (
        ("seq2seq", m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        ("causal", m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("masked", m.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
    ):
        for model_type, cls in mapping.items():
            key = (model_type, cls)
            if key in seen:
                continue
            seen.add(key)
            rows.append({"family": f"{model_type}:{task}", "model_type": model_type, "cls": cls, "task": task})
    return sorted(rows, key=lambda r: r["family"])


class Skip(Exception):
    """This family is outside the sweep: its config or model does not build small, or it needs a package."""


def oneline(err: BaseException, n: int = 400) -> str:
    return " ".join(str(err).split())[:n]


def for_class(config, cls):
    """The config itself, or its sub-config of the class the model wants (a text head on a multimodal config)."""
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        subs = [getattr(config, k) for k in vars(config) if isinstance(getattr(config, k, None), wanted)]
        if subs:
            return subs[0]
    return config


def build(fam: dict[str, str], seed: int = 0):
    """(config, model class, model) for one family, or Skip saying why it is outside the sweep."""
    import transformers
    from transformers import AutoConfig

    transformers.logging.set_verbosity_error()

    try:
        base = AutoConfig.for_model(fam["model_type"])
    except Exception as err:  # noqa: BLE001
        raise Skip(f"default config does not build: {type(err).__name__}: {oneline(err)}") from err
    small = shrink(base.to_dict())
    small.pop("model_type", None)
    small.pop("transformers_version", None)
    small.pop("architectures", None)
    try:
        config = type(base).from_dict(small)
    except Exception as err:  # noqa: BLE001
        raise Skip(f"shrunk config does not build: {type(err).__name__}: {oneline(err)}") from err
    cls = getattr(transformers, fam["cls"], None)
    if cls is None:
        raise Skip(f"{fam['cls']} is not exported by transformers")
    config = for_class(config, cls)
    torch.manual_seed(seed)
    try:
        model = cls(config)
    except Exception as err:  # noqa: BLE001 - optional packages, configs whose shrunk sizes contradict
        raise Skip(f"model does not build from the shrunk config: {type(err).__name__}: {oneline(err)}") from err
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise Skip(f"not small: {n / 1e6:.1f}M parameters after shrinking")
    return config, cls, model


def by_name(family: str) -> dict[str, str]:
    """``"model_type:task"``, e.g. ``"qwen2:causal"``."""
    return next(f for f in families() if f["family"] == family)


def text_vocab(config) -> int:
    """The decoder's vocabulary (a multimodal config's text sub-config's)."""
    try:
        text = config.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001
        text = config
    v = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or VOCAB
    return int(v)


def make_inputs(model, config, fam):
    """Token ids within the text vocabulary, labels, and ``use_cache=False`` where forward takes it."""
    vocab = min(text_vocab(config), 100_000)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (BATCH, SEQ), generator=gen)
    kwargs: dict[str, Any] = {"labels": ids.clone()}
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return ids, kwargs
