"""Model families, deterministic batches, and the functions real ranks run in the equivalence tests.

Everything here is importable by the spawned worker processes (tests/ is on their sys.path).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import capture_memo
import torch
import torch._dynamo.config
import torch.nn.functional as F
from autoshard.passes.tp_rewrite import collectives_by_layer
from torch import nn

import autoshard
from autoshard.graph_ops.weight_grad import WEIGHT_GRADS

GLOBAL_BATCH = 8
SEQ = 12
VOCAB = 64
IMAGE = 16  # ViT images: 16 x 16 pixels in 4 x 4 patches
FAMILIES = ("mlp", "gpt2", "llama", "bert")

# torch's fake-tensor dispatch cache costs more than it saves when capturing this suite's two-layer models
# with B and S symbolic (capture ~25-30% faster without it; large models gain from it, so the library
# keeps torch's default). Set here because every rank worker and the main process import this module.
torch._dynamo.config.fake_tensor_cache_enabled = False
capture_memo.install()


@dataclass
class Batch:
    inputs: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None


@dataclass
class Case:
    model: nn.Module
    batches: list[Batch]
    loss_fn: Any = None


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 4), batchnorm: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norms = nn.ModuleList(nn.BatchNorm1d(b) if batchnorm else nn.Identity() for b in sizes[1:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(self.norms[i](x))
        return x


def cross_entropy(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, target)


def build_model(family: str, seed: int = 0, **shape: Any) -> nn.Module:
    model = _build_model(family, seed, **shape)
    # What the model is built from, so a capture of an equal build is reused in this process (capture_memo.py).
    setattr(model, capture_memo.BUILD_KEY, (family, tuple(sorted((k, repr(v)) for k, v in shape.items()))))
    return model


def _build_model(family: str, seed: int, **shape: Any) -> nn.Module:
    torch.manual_seed(seed)
    if family == "mlp":
        return MLP(tuple(shape.get("sizes", (16, 32, 32, 4))), shape.get("batchnorm", False))
    import transformers

    transformers.logging.set_verbosity_error()
    layers = shape.get("layers", 2)
    if family in ("moe", "moe_mixing_rows", "moe_loop", "moe_loop_mixed"):  # hand-written: _grouped_mm, or a loop
        from expert_cases import GroupedMoELM

        loop = family.startswith("moe_loop")
        return GroupedMoELM(VOCAB, layers, family == "moe_mixing_rows", loop, mixed=family == "moe_loop_mixed")
    if family == "mixtral_aux":  # a router load-balancing loss in the training loss
        cfg = transformers.MixtralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
            max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(cfg)
    if family.startswith("hf:"):  # any family of tests/hf_families.py, e.g. "hf:qwen2:causal"
        import hf_families

        return hf_families.build(hf_families.by_name(family.removeprefix("hf:")), seed)[2]
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=layers, n_embd=shape.get("width", 32), n_head=shape.get("heads", 4),
            vocab_size=shape.get("vocab", VOCAB), n_positions=shape.get("positions", 32),
            resid_pdrop=shape.get("dropout", 0.0), embd_pdrop=shape.get("dropout", 0.0),
            attn_pdrop=shape.get("dropout", 0.0), bos_token_id=0, eos_token_id=0,
            attn_implementation=shape.get("attention"),
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=32, num_attention_heads=8,
            num_key_value_heads=shape.get("kv_heads", 4),
            intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=shape.get("positions", 32),
            bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=shape.get("dropout", 0.0),
            attn_implementation=shape.get("attention"),
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)
    if family == "bert":
        cfg = transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=shape.get("positions", 32),
            hidden_dropout_prob=shape.get("dropout", 0.0), attention_probs_dropout_prob=shape.get("dropout", 0.0),
            pad_token_id=0,
            attn_implementation=shape.get("attention"),
        )  # fmt: skip
        return transformers.BertForMaskedLM(cfg)
    if family == "vit":
        cfg = transformers.ViTConfig(
            image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=layers,
            num_attention_heads=4, intermediate_size=64, num_labels=8, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return transformers.ViTForImageClassification(cfg)
    raise ValueError(f"unknown family {family!r}")


def build_case(
    family: str, steps: int = 3, seed: int = 0, batch: int = GLOBAL_BATCH, device: str | None = None, **shape: Any
) -> Case:
    """The model and its global batches (drawn on the CPU, then moved to ``device`` with the model)."""
    case = _build_case(family, steps, seed, batch, **shape)
    if device is None:
        return case
    case.model.to(device)
    for b in case.batches:
        b.inputs = tuple(x.to(device) for x in b.inputs)
        b.kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.kwargs.items()}
        b.target = b.target.to(device) if isinstance(b.target, torch.Tensor) else b.target
    return case


def _build_case(family: str, steps: int, seed: int, batch: int, **shape: Any) -> Case:
    model = build_model(family, seed, **shape)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        if family == "mlp":
            width = model.layers[0].in_features
            classes = model.layers[-1].out_features
            x = torch.randn(batch, width, generator=gen)
            y = torch.randint(0, classes, (batch,), generator=gen)
            batches.append(Batch(inputs=(x,), target=y))
        elif family == "vit":
            pixels = torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)
            labels = torch.randint(0, model.config.num_labels, (batch,), generator=gen)
            batches.append(Batch(inputs=(pixels,), kwargs={"labels": labels}))
        else:
            ids = torch.randint(1, VOCAB, (batch, shape.get("seq", SEQ)), generator=gen)
            kwargs: dict[str, Any] = {"labels": ids.clone()}
            takes_cache = "use_cache" in inspect.signature(model.forward).parameters
            if family in ("gpt2", "llama", "mixtral_aux") or family.startswith("hf:") and takes_cache:
                kwargs["use_cache"] = False
            batches.append(Batch(inputs=(ids,), kwargs=kwargs))
    return Case(model=model, batches=batches, loss_fn=cross_entropy if family == "mlp" else None)


def adamw(params: Any) -> torch.optim.Optimizer:
    # eps=1e-6: GPT-2's key bias has a true gradient of zero (softmax ignores a shift shared by all
    # keys), so its computed gradient is rounding noise near 1e-11 whose sign differs between any two
    # summation orders; with eps=1e-8 Adam turns that noise into steps of ~1e-6, with 1e-6 into ~1e-8.
    # Real gradients here are >= 1e-4, so their steps are unchanged.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=1e-6)


def _loss(case: Case, batch: Batch) -> torch.Tensor:
    out = case.model(*batch.inputs, **batch.kwargs)
    return case.loss_fn(out, batch.target) if case.loss_fn is not None else out.loss


def train_single_device(
    family: str,
    steps: int = 3,
    max_grad_norm: float | None = None,
    optimizer: Any = None,
    norms: list[float] | None = None,
    **shape: Any,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: eager single-device training on the global batch."""
    case = build_case(family, steps, **shape)
    case.model.train()
    opt = (optimizer or adamw)(case.model.parameters())
    losses = []
    for batch in case.batches:
        opt.zero_grad()
        loss = _loss(case, batch)
        loss.backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(case.model.parameters(), max_grad_norm)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in case.model.state_dict().items()}


def train_single_device_mixed(
    family: str, dtype: torch.dtype, steps: int = 3, **shape: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The mixed-precision reference: compute in ``dtype``, AdamW on fp32 master weights."""
    case = build_case(family, steps, **shape)
    model = case.model.train()
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
    model.to(dtype)
    opt = adamw(masters)
    losses = []
    for batch in case.batches:
        model.zero_grad()
        loss = _loss(case, batch)
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tensor_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def sgd_momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def compile_case(case: Case, mesh: Any, plan: Any = "auto", optimizer: Any = None) -> autoshard.Program:
    first = case.batches[0]
    return autoshard.compile(
        case.model,
        mesh,
        example_inputs=first.inputs,
        example_kwargs=first.kwargs,
        loss_fn=case.loss_fn,
        optimizer=optimizer or adamw,
        plan=plan,
        example_target=first.target,
    )


def train_distributed(
    rank: int, world_size: int, family: str, mesh: dict[str, int], steps: int = 3, **shape: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One rank of the distributed run: compile for the mesh, train on local batches."""
    case = build_case(family, steps, **shape)
    program = compile_case(case, autoshard.Mesh(**mesh))
    losses, _ = train_local_batches(program, case)
    return losses, program.full_state_dict()


def train_local_batches(
    program: autoshard.Program, case: Case, norms: list[float | None] | None = None, after_step: Any = None
) -> tuple[list[float], list[dict[str, int]]]:
    """Step through the case's global batches, each rank on its slice; losses and comm volume per step
    (and into ``norms`` each step's gradient norm before clipping; ``after_step()`` after each)."""
    losses, volumes = [], []
    for batch in case.batches:
        local = program.local_batch
        inputs = tuple(local(x) for x in batch.inputs)
        kwargs = {k: local(v) for k, v in _tensor_kwargs(batch.kwargs).items()}
        target = None if batch.target is None else local(batch.target)
        program.comm.reset()
        losses.append(program.step(*inputs, target=target, **kwargs))
        volumes.append(dict(program.comm.volume_bytes))
        if norms is not None:
            norms.append(program.last_grad_norm)
        if after_step is not None:
            after_step()
    return losses, volumes


def error_message(rank: int, world_size: int, family: str, mesh: Any) -> str:
    """Compile under a real process group and return the error message (or '' when none)."""
    case = build_case(family)
    try:
        compile_case(case, autoshard.Mesh(**mesh) if isinstance(mesh, dict) else mesh)
    except autoshard.AutoshardError as err:
        return f"{type(err).__name__}: {err}"
    return ""


def overlap_probe(rank: int, world_size: int, family: str) -> dict[str, int]:
    """Count the buckets launched while backward was still running, and the bytes all-reduced."""
    case = build_case(family)
    program = compile_case(case, autoshard.Mesh(dp=world_size), plan={"bucket_mb": 0.002})
    batch = case.batches[0]
    local = program.local_batch
    kwargs = {k: local(v) for k, v in _tensor_kwargs(batch.kwargs).items()}
    target = None if batch.target is None else local(batch.target)
    holder = program.runtime.holder
    seen: dict[str, int] = {}
    end = holder.end

    def end_and_count() -> None:
        seen["launched_during_backward"] = len(holder.works)
        end()

    holder.end = end_and_count
    program.comm.reset()
    program.step(*(local(x) for x in batch.inputs), target=target, **kwargs)
    seen["buckets"] = len(holder.order)
    seen["bytes_reduced"] = program.comm.volume_bytes["all_reduce"] // 2  # volume counts an all-reduce twice
    seen["param_bytes"] = sum(p.numel() * p.element_size() for p in program.parameters())
    return seen


def device_mesh_probe(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return str(autoshard.Mesh.from_device_mesh(device_mesh))


def state_roundtrip(rank: int, world_size: int, family: str) -> bool:
    """Train one step, load the starting state back, and check every rank holds it again."""
    case = build_case(family)
    program = compile_case(case, autoshard.Mesh(dp=world_size))
    start = {k: v.clone() for k, v in program.state_dict().items()}
    batch = case.batches[0]
    local = program.local_batch
    kwargs = {k: local(v) for k, v in _tensor_kwargs(batch.kwargs).items()}
    program.step(*(local(x) for x in batch.inputs), **kwargs)
    changed = any(not torch.equal(start[k], v) for k, v in program.state_dict().items())
    program.load_state_dict(start)
    restored = all(torch.equal(start[k], v) for k, v in program.state_dict().items())
    return changed and restored


def train_zero(
    rank: int, world_size: int, family: str, plan: dict[str, Any], steps: int = 3, optimizer: Any = None, **shape: Any
) -> dict[str, Any]:
    """One rank of a ZeRO run: losses, consolidated state, memory by category, communication volume."""
    case = build_case(family, steps, **shape)
    program = compile_case(case, autoshard.Mesh(dp=world_size), plan=plan, optimizer=optimizer)
    norms: list[float | None] = []
    losses, volumes = train_local_batches(program, case, norms)
    zero3 = program.runtime.holder.runtime if program.plan.zero == 3 else None
    return {
        "losses": losses,
        "state": program.full_state_dict(),
        "memory": program.last_step_memory,
        "volumes": volumes,
        "param_bytes": program.cost.param_bytes,
        "peak_gathered": zero3.peak_gathered_bytes if zero3 is not None else None,
        "group_bytes": [lay.padded * 4 for lay in zero3.layouts.values()] if zero3 is not None else None,
        "graph": program.graph_modules[0].code,
        "grad_norms": norms,
    }


def train_pipeline(
    rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any], steps: int = 3, **shape: Any
) -> dict[str, Any]:
    """One rank of a pipeline run: losses, consolidated state, and the last step's pipeline measurements."""
    case = build_case(family, steps, **shape)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    norms: list[float | None] = []
    deferred_before = WEIGHT_GRADS.deferred_total
    losses, volumes = train_local_batches(program, case, norms)
    stats = program.pipeline_stats
    return {
        "losses": losses,
        "state": program.full_state_dict(),
        "peak_in_flight": stats.peak_in_flight,
        "weight_grads_deferred": WEIGHT_GRADS.deferred_total - deferred_before,  # held back by B for W
        "microbatch_sizes": stats.microbatch_sizes,
        "idle_fraction": stats.idle_fraction,
        "param_names": [name for name, _ in program.named_parameters()],
        "volumes": volumes,
        "graphs": [gm.code for gm in program.graph_modules],
        "grad_norms": norms,
        "collectives": {k: v for gm in program.graph_modules for k, v in collectives_by_layer(gm).items()},
    }


def pipeline_state_roundtrip(rank: int, world_size: int) -> dict[str, Any]:
    """Under pp=2: train a step, load the starting state back, and check that every rank holds it again."""
    case = build_case("gpt2")
    program = compile_case(case, autoshard.Mesh(pp=2), plan={"microbatches": 2})
    start = program.full_state_dict()
    held = {k: v.clone() for k, v in program.state_dict().items()}
    batch = case.batches[0]
    program.step(*batch.inputs, labels=batch.kwargs["labels"])
    changed = any(not torch.equal(held[k], v) for k, v in program.state_dict().items())
    everything = [None]
    dist_broadcast_object(everything, start)
    program.load_state_dict(everything[0])
    restored = all(torch.equal(held[k], v) for k, v in program.state_dict().items())
    logits = program(*batch.inputs, labels=batch.kwargs["labels"]).logits
    expected = build_case("gpt2").model(*batch.inputs, labels=batch.kwargs["labels"]).logits
    return {
        "changed": changed,
        "restored": restored,
        "held": sorted(held),
        "logits_shape": tuple(logits.shape),
        "logits_error": (logits - expected).abs().max().item(),
    }


def dist_broadcast_object(box: list[Any], value: Any) -> None:
    """Rank 0's ``value`` into ``box[0]`` on every rank."""
    import torch.distributed as dist

    box[0] = value
    dist.broadcast_object_list(box, src=0)


class Stack(nn.Module):
    """A model of identical blocks and nothing else: the pipeline balance reference."""

    def __init__(self, blocks: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def largest_collective_numel(gm: Any, sizes: dict[str, int]) -> int:
    """The most elements any TP collective node of the graph moves, at the given symbol values."""
    from autoshard.ir.meta import TP_COMM, evaluate_expr, get_shape

    numels = [
        evaluate_expr(get_shape(n).tensor.numel, sizes) for n in gm.graph.nodes if n.meta.get(TP_COMM) is not None
    ]
    return max(numels, default=0)


def train_tp(
    rank: int,
    world_size: int,
    family: str,
    mesh: dict[str, int],
    plan: dict[str, Any] | None = None,
    steps: int = 3,
    optimizer: Any = None,
    **shape: Any,
) -> dict[str, Any]:
    """One rank of a tensor-parallel run: losses, consolidated state, collectives, and what the rank holds."""
    case = build_case(family, steps, **shape)
    full_bytes = {k: v.numel() * v.element_size() for k, v in case.model.state_dict().items()}
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan or "auto", optimizer=optimizer)
    norms: list[float | None] = []
    losses, volumes = train_local_batches(program, case, norms)
    gm = program.graph_modules[0]
    held = {k: v.numel() * v.element_size() for k, v in program.state_dict().items()}
    placements = {n: str(p["tp"]) for n, p in program.for_rank(rank).placements.items()}
    return {
        "losses": losses,
        "state": program.full_state_dict(),
        "local_state": {k: v.clone() for k, v in program.state_dict().items()},
        "collectives": collectives_by_layer(gm),
        "largest_collective": largest_collective_numel(gm, program.plan_report.sizes),
        "held_bytes": held,
        "full_bytes": full_bytes,
        "placements": placements,
        "volumes": volumes,
        "grad_norms": norms,
        "explain": program.explain(),
    }


def tp_dropout_probe(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 with dropout 0.1 under tp: two steps; then random draws from the shared and the rank's own stream."""
    case = build_case("gpt2", steps=2, dropout=0.1)
    torch.manual_seed(1000 + rank)  # ranks seeded differently: the program must still agree on shared masks
    program = compile_case(case, autoshard.Mesh(tp=world_size), plan=plan)
    losses, _ = train_local_batches(program, case)
    replicated = {
        k: v.clone()
        for k, v in program.state_dict().items()
        if str(program.for_rank(rank).placements.get(k, {}).get("tp", "R")) == "R"
    }
    shared = torch.rand(4)
    with program.runtime.tp.rank_stream(torch.device("cpu")):
        own = torch.rand(4)
    return {"losses": losses, "replicated": replicated, "shared": shared, "own": own,
            "graph": program.graph_modules[0].code}  # fmt: skip


def tp_state_and_forward(rank: int, world_size: int) -> dict[str, Any]:
    """GPT-2 at tp=2: full state round trip through load_state_dict, and forward-only logits joined whole."""
    case = build_case("gpt2")
    reference = build_case("gpt2").model.eval()
    program = compile_case(case, autoshard.Mesh(tp=world_size))
    box: list[Any] = [None]
    dist_broadcast_object(box, program.full_state_dict())
    start = box[0]
    held = {k: v.clone() for k, v in program.state_dict().items()}
    batch = case.batches[0]
    program.step(*batch.inputs, labels=batch.kwargs["labels"])
    changed = any(not torch.equal(held[k], v) for k, v in program.state_dict().items())
    program.load_state_dict(start)
    restored = all(torch.equal(held[k], v) for k, v in program.state_dict().items())
    logits = program(*batch.inputs, labels=batch.kwargs["labels"]).logits
    expected = reference(*batch.inputs, labels=batch.kwargs["labels"]).logits
    return {
        "changed": changed,
        "restored": restored,
        "start_matches_model": all(torch.equal(start[k], v) for k, v in reference.state_dict().items()),
        "logits_shape": tuple(logits.shape),
        "logits_error": (logits - expected).abs().max().item(),
    }


def grouped_adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (none on norms and biases): two parameter groups."""
    params = list(params)
    matrices = [p for p in params if p.dim() >= 2]
    others = [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)


def decaying_lr(step: int) -> float:
    return 1.0 / (1.0 + step)


def train_single_device_scheduled(family: str, steps: int = 3, **shape: Any) -> tuple[list[float], dict, list]:
    """The reference for parameter groups: grouped AdamW and a LambdaLR schedule on one device."""
    case = build_case(family, steps, **shape)
    opt = grouped_adamw(case.model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, decaying_lr)
    losses = []
    for batch in case.batches:
        opt.zero_grad()
        loss = _loss(case, batch)
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    lrs = [g["lr"] for g in opt.param_groups]
    return losses, {k: v.detach().clone() for k, v in case.model.state_dict().items()}, lrs


def train_plan(
    rank: int,
    world_size: int,
    family: str,
    mesh: dict[str, int],
    plan: dict[str, Any],
    steps: int = 3,
    optimizer: Any = None,
    lr_schedule: bool = False,
    **shape: Any,
) -> dict[str, Any]:
    """One rank of any plan: losses, consolidated state, gradient norms; with ``lr_schedule`` a LambdaLR
    steps ``program.optimizer`` after every step, as a user would."""
    case = build_case(family, steps, **shape)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan, optimizer=optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(program.optimizer, decaying_lr) if lr_schedule else None
    norms: list[float | None] = []
    losses, _ = train_local_batches(program, case, norms, schedule.step if schedule else None)
    groups = [{k: v for k, v in g.items() if k in ("lr", "weight_decay")} for g in program.optimizer.param_groups]
    return {
        "losses": losses,
        "state": program.full_state_dict(),
        "grad_norms": norms,
        "param_groups": groups,
        "memory": program.last_step_memory,
        "held": sorted(k for k, t in program.compiled.model.state_dict().items() if t.numel()),
    }


def eval_logits(rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any], **shape: Any):
    """Logits of the compiled program in eval and in training mode, and the model's own in eval mode."""
    case = build_case(family, **shape)
    reference = build_case(family, **shape).model.eval()
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    batch = case.batches[0]
    kwargs = {k: program.local_batch(v) for k, v in _tensor_kwargs(batch.kwargs).items()}
    ids = program.local_batch(batch.inputs[0])
    state_before = program.full_state_dict()
    evaluated = program.eval()(ids, **kwargs)
    state_after = program.full_state_dict()
    trained = program.train()(ids, **kwargs)
    expected = reference(ids, **kwargs, **{k: v for k, v in batch.kwargs.items() if not isinstance(v, torch.Tensor)})
    logits = (lambda out: out.logits) if family != "mlp" else (lambda out: out)
    return {
        "eval_error": (logits(evaluated) - logits(expected)).abs().max().item(),
        "train_differs": not torch.allclose(logits(trained), logits(expected)),
        "state_unchanged": all(torch.equal(state_before[k], v) for k, v in state_after.items()),
    }


def dp_reductions_per_step(
    rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any], **shape: Any
) -> dict[str, Any]:
    """Losses and state of any plan, and how often each step launched each gradient group's dp reduction."""
    case = build_case(family, **shape)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    holder = program.runtime.holder
    launched: list[int] = []
    launch = holder.launcher.launch

    def counted(group: int) -> None:
        launched.append(group)
        launch(group)

    holder.launcher.launch = counted
    per_step: list[dict[int, int]] = []
    losses: list[float] = []
    for batch in case.batches:
        launched.clear()
        losses.extend(train_local_batches(program, Case(case.model, [batch], case.loss_fn), [])[0])
        per_step.append({g: launched.count(g) for g in sorted(set(launched))})
    return {"losses": losses, "state": program.full_state_dict(), "launches": per_step, "groups": len(holder.order)}


def groups_after_compiles(rank: int, world_size: int, mesh: dict[str, int], compiles: int) -> list[int]:
    """How many process groups this process holds after each of ``compiles`` compiles of one plan."""
    import torch.distributed as dist

    counts = []
    for _ in range(compiles):
        case = build_case("gpt2", steps=1)
        program = compile_case(case, autoshard.Mesh(**mesh))
        train_local_batches(program, case)
        counts.append(len(dist.distributed_c10d._world.pg_map))
    return counts


def shared_processors(rank: int, world_size: int) -> tuple[list[int], float]:
    """This rank's processors (its affinity) and the processors Hardware.measure() counts the ranks sharing."""
    import os

    from autoshard.planner.calibrate import shared_processors as shared

    return sorted(os.sched_getaffinity(0)), shared(None)


def timed_spans(rank: int, world_size: int, shared: bool) -> list[tuple[float, float]]:
    """(start, end) on the host's clock of every call ``planner.timing.compute_seconds`` makes, timing a sleep on
    CPU ranks as the calibration times them (``shared``: the ranks share processors)."""
    import time

    import torch
    import torch.distributed as dist

    from autoshard.planner import timing

    spans = []

    def work() -> None:
        start = time.perf_counter()
        time.sleep(0.002)
        spans.append((start, time.perf_counter()))

    timing.TOGETHER[0] = dist.group.WORLD
    try:
        timing.compute_seconds(work, torch.device("cpu"), 0.01, shared)
    finally:
        timing.TOGETHER[0] = None
    return spans


def measured_hardware(rank: int, world_size: int, times: int) -> list[tuple[str, int]]:
    """Hardware.measure() ``times`` times on this rank: each result as JSON, and the process groups held after."""
    import torch.distributed as dist

    out = []
    for _ in range(times):
        hardware = autoshard.Hardware.measure()
        out.append((hardware.to_json(), len(dist.distributed_c10d._world.pg_map)))
    return out


def small_gpt() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small GPT (tied head, 2 blocks) with a batch of token ids and their targets."""
    from autoshard.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=64, heads=4, layers=2, max_seq=32)
    gen = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 256, (4, 32), generator=gen), torch.randint(0, 256, (4, 32), generator=gen)


def tp_collectives(rank: int, world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """The tensor-parallel collectives one training step of ``small_gpt`` issues on this rank at tp=world_size:
    (op -> calls, op -> bytes as the runtime counts them)."""
    from autoshard.demo import next_token_loss

    model, ids, target = small_gpt()
    program = autoshard.compile(
        model, autoshard.Mesh(tp=world_size), (ids,), loss_fn=next_token_loss, example_target=target,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), plan={"microbatches": 1},
    )  # fmt: skip
    x, y = program.local_batch(ids), program.local_batch(target)
    program.step(x, target=y)
    program.comm.reset()
    program.step(x, target=y)
    return dict(program.comm.calls), dict(program.comm.volume_bytes)
