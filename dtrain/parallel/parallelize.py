"""Apply, in this order: tensor parallel (every parameter covered; skipped at tp = 1) → re-tie
embeddings → LoRA adapters (lora.r > 0: laid out by each base layer's TP style; with
lora.base_dtype=nf4 their base weights stored as NF4, dtrain/parallel/qlora.py) → activation
checkpointing → torch.compile per decoder layer → FSDP2 per decoder layer and root, where FSDP has
ranks to shard over (Parallel.sharded; else bf16 runs compute under autocast). Then check that every
parameter is on the one mesh: a DTensor on (dp, tp), on tp alone without FSDP, or a plain tensor on
one process.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dtrain.config import ConfigError, LoraConfig, ParallelConfig
from dtrain.distributed import Parallel
from dtrain.parallel import experts, gemma3, llama, lora, moe, olmo2, phi3, qlora, qwen3

# By `config.model_type`. Mistral and Qwen2 name their modules as Llama does (Qwen2's q/k/v biases
# are sharded with their colwise weights); Qwen3 adds per-head q/k norms; Gemma 3 four norms a
# layer; OLMo 2 and 3 post-norms and whole-width q/k norms.
TP_PLANS = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": qwen3,
    # mixtures of experts: the dense relative's attention; the router and experts: parallel/experts.py
    "qwen3_moe": moe.QWEN3_MOE,
    "mixtral": moe.MIXTRAL,
    "olmoe": moe.OLMOE,
    "gpt_oss": moe.GPT_OSS,  # Llama's attention with biases and per-head sinks
    "gemma3_text": gemma3,
    "olmo2": olmo2,
    "olmo3": olmo2,
    "phi3": phi3,  # its fused projections are split at build time: Llama's table then
    "smollm3": llama,  # NoPE layers: HF skips their rotary; the modules are Llama's
    "granite": llama,  # the multipliers are scalars in HF's forward, linear or pointwise on shards
}

# Set by apply_autocast on a model that computes in bf16 under torch.autocast: the device type.
AUTOCAST = "dtrain_autocast"


def check_tp_divides(model_config: Any, tp: int, model: str = "model") -> None:
    """The heads and the MLP width split over tp (vocab_size need not: the embedding and lm_head are
    padded, dtrain.parallel.vocab). `model`: how the message names the model."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model_config, key, None)
        if value is not None and value % tp:
            raise ConfigError(f"{model} {key}={value} is not divisible by parallel.tp={tp}")


def check_tp_support(model_type: str, tp: int, model: str = "model") -> None:
    """A family without a TP plan trains FSDP-only (tp=1); at tp > 1 it is refused before launch.
    `model`: how the message names the model."""
    if tp > 1 and model_type not in TP_PLANS:
        raise ConfigError(
            f"{model} type {model_type!r} has no TP plan, so it runs with parallel.tp=1 only (FSDP); "
            f"parallel.tp={tp} needs one of: {', '.join(TP_PLANS)}"
        )


# activation_checkpointing=selective keeps these ops' outputs and recomputes the rest (norms,
# activations, rotary, casts): the matmuls and attention are most of the FLOPs, the rest most of
# the activation bytes. The reduce-scatter is saved so backward does not repeat TP's communication.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of decoder layers of any HF causal LM: the ModuleList of the layer class the model
    declares unsplittable (`_no_split_modules`). What checkpointing, compile and FSDP wrap one by one."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and type(unwrapped(module[0])).__name__ in layer_classes
        ):
            return module
    raise ConfigError(
        f"model type {model.config.model_type!r}: no stack of decoder layers "
        f"({', '.join(sorted(layer_classes)) or 'no _no_split_modules'}) found in {type(model).__name__}"
    )


def unwrapped(module: nn.Module) -> nn.Module:
    """A decoder layer without the wrappers activation checkpointing and torch.compile put around it."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if inner is None:
            return module
        module = inner


def parallelize(
    model: nn.Module,
    parallel: Parallel,
    settings: ParallelConfig,
    precision: str,
    lora_settings: LoraConfig | None = None,
    seed: int = 0,
    frozen: bool = False,
) -> nn.Module:
    """Shard a meta-device HF causal LM over the mesh, in place. Returns the same model.
    `lora_settings` (resolved: lora.resolve) with r > 0: a frozen base with adapters (dtrain/parallel/
    lora.py); `seed` keys their dropout masks, per data shard (dp and cp rank). `frozen`: a model
    that only runs forwards (dtrain.dpo's live reference): no gradients, its weights in the compute
    dtype (bf16 runs: half the bytes of fp32 master weights)."""
    layers = decoder_layers(model)
    experts.shard_experts(model, parallel)  # over ep, and replicated over tp: before TP's coverage check
    if parallel.tp_size > 1:
        # At tp = 1 the plan would only wrap every parameter in a DTensor over a one-rank axis, and
        # every op would pay DTensor dispatch for nothing: FSDP alone gives the same numerics. So
        # families without a plan train at tp = 1 (check_tp_support refuses more).
        apply_tp(model, layers, parallel, settings, TP_PLANS[model.config.model_type])
    if lora_settings is not None and lora.enabled(lora_settings):
        shard = parallel.dp_rank * parallel["cp"].size() + parallel["cp"].get_local_rank()
        dtype = lora.base_dtype(lora_settings, precision)
        lora.apply_lora(model, layers, lora_settings, dtype, seed * 65_537 + shard)
        if lora_settings.base_dtype == "nf4":  # QLoRA: the adapted weights stored as NF4
            qlora.quantize_base(model, parallel.shape.dp_shard * parallel.shape.cp)
    if frozen:
        model.requires_grad_(False)
        model.to(lora.DTYPES[precision])  # swaps DTensor parameters in place: tied weights stay tied
    apply_activation_checkpointing(layers, settings.activation_checkpointing)
    if settings.compile:
        apply_compile(model, layers, parallel.tp_size)
    if parallel.sharded:
        apply_fsdp(model, layers, parallel, settings, precision)
    elif precision == "bf16":
        apply_autocast(model, parallel.device.type)
    check_on_mesh(model, parallel)
    return model


def apply_tp(
    model: nn.Module, layers: nn.ModuleList, parallel: Parallel, settings: ParallelConfig, plans
) -> None:
    parallelize_module(
        model, parallel["tp"], plans.model_plan(settings.sequence_parallel, settings.loss_parallel)
    )
    for layer in layers:
        parallelize_module(layer, parallel["tp"], plans.layer_plan(settings.sequence_parallel))
    check_tp_coverage(model)
    if model.config.tie_word_embeddings:  # parallelize_module replaced both Parameters; both Shard(0)
        model.lm_head.weight = model.model.embed_tokens.weight


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(layers: nn.ModuleList, mode: str) -> None:
    """full: keep only each decoder layer's input, recompute the layer in backward. selective: keep
    the outputs of _SAVED_OPS too (op-level policy), recompute only the cheap ops."""
    if mode == "none":
        return
    options: dict = {"preserve_rng_state": False}
    if mode == "selective":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer, **options)


def apply_compile(model: nn.Module, layers: nn.ModuleList, tp: int) -> None:
    """torch.compile each decoder layer (all layers share one graph: same code, parameters as
    inputs). The embedding, final norm, head and loss stay eager; FSDP's hooks stay outside the
    compiled region because fully_shard wraps the compiled module. A layer with experts compiles in
    parts (compile_sparse_layer). At tp > 1 the embedding's output enters the first layer's graph as
    a plain tensor (materialized)."""
    if tp > 1:
        model.get_input_embeddings().register_forward_hook(materialized)
    for index, layer in enumerate(layers):
        if experts.experts_modules(layer):
            compile_sparse_layer(layer)
        else:
            layers[index] = torch.compile(layer, fullgraph=True)


def materialized(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output at tp > 1 is an AsyncCollectiveTensor (RowwiseParallel redistributes
    it with async_op=True), a view awaiting its reduce. Entering a compiled graph as an input, torch
    2.13 drops the gradient that flows back through it: the embedding's gradient is zero at 2x2 (the
    first step's grad norm 0.82x eager's), 0.86x its norm where only the layer's norms take it, and
    backward fails at tp alone (a plain tensor where the redistribute's backward wants a DTensor).
    The copy waits for the reduce and hands the graph a plain tensor with its autograd edge (one
    activation of the layers' input size, once a forward)."""
    return output.clone()


def compile_sparse_layer(layer: nn.Module) -> None:
    """A mixture-of-experts layer cannot be one graph: its dispatch sizes buffers from the routing on
    the host (the all-to-all's splits, the rows per expert), and at ep > 1 FSDP's hooks of the experts
    module sit inside it. So each dense part is compiled whole and in place (attention, norms, the
    router: one graph each, shared by the layers), and the experts' grouped matmuls with the gate
    between them as one graph of dynamic row count (experts.compile_experts); the dispatch, the
    layer's residual adds and the block's reshapes stay eager (torchtitan compiles its MoE layers
    so)."""
    block = layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper) else layer
    for child in block.children():
        if not experts.experts_modules(child):
            child.compile(fullgraph=True)
            continue
        for part in child.children():  # the sparse block: its router and its experts
            if experts.experts_modules(part):
                experts.compile_experts(part)
            else:
                part.compile(fullgraph=True)


def apply_fsdp(
    model: nn.Module, layers: nn.ModuleList, parallel: Parallel, settings: ParallelConfig, precision: str
) -> None:
    # bf16: compute in bf16, reduce gradients in fp32. fp32: the empty policy (an fp32 one still
    # walks every forward's inputs to cast them to the dtype they already have).
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    layers = list(layers)
    for index, layer in enumerate(layers):
        reshard = reshards(settings.reshard_after_forward, index, len(layers))
        experts.fully_shard_experts(layer, parallel, mp_policy=mp_policy, reshard_after_forward=reshard)
        fully_shard(layer, mesh=parallel["fsdp"], mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=parallel["fsdp"], mp_policy=mp_policy)
    # The loss is already divided by the global token count: FSDP must sum, not average, over dp.
    # With one dp rank it already sums, and a divide factor (even 1.0) costs a pass over the grads.
    if parallel["fsdp"].size() > 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    if settings.fsdp_prefetch > 0:
        set_prefetch(layers, settings.fsdp_prefetch)


class _Autocast:
    """torch.autocast entered by a module's forward pre-hook and left by its forward hook (also when
    the forward raises): a context of its own per call, so calls nest (lm_head inside the model)."""

    def __init__(self, device_type: str) -> None:
        self.device_type, self.active = device_type, []

    def enter(self, module: nn.Module, args: tuple) -> None:
        context = torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False)
        context.__enter__()
        self.active.append(context)

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.active.pop().__exit__(None, None, None)


def apply_autocast(model: nn.Module, device_type: str) -> None:
    """bf16 without FSDP (whose MixedPrecisionPolicy casts the gathered weights): the model's forward
    and lm_head's (the chunked and fused losses call the head after the forward) run under
    torch.autocast, as torchtitan and nanoGPT train on one device. The matmuls and attention compute
    in bf16 from fp32 master weights, the casts' backward hands fp32 gradients to them; the residual
    stream and the norms stay fp32 (FSDP's bf16 computes them in bf16). Without autocast's cache of
    the casts, which would hold every layer's bf16 weights until the forward ends (2 bytes a weight:
    3.7 GiB a rank for Llama-3-8B at tp 4); each matmul keeps its cast weight for its backward, or
    with activation checkpointing casts it again in the recompute."""
    autocast = _Autocast(device_type)
    for module in (model, model.lm_head):
        module.register_forward_pre_hook(autocast.enter)
        module.register_forward_hook(autocast.leave, always_call=True)
    setattr(model, AUTOCAST, device_type)


def compute_precision(model: nn.Module) -> contextlib.AbstractContextManager:
    """The autocast apply_autocast gave the model's forward, for a loss that computes the head after
    it (loss_impl chunked and fused); nothing for a model FSDP casts, or an fp32 run."""
    device_type = getattr(model, AUTOCAST, None)
    if device_type is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)


def keep_gradient_placements(model: nn.Module) -> None:
    """Tensor parallel without FSDP: each gradient laid out as its parameter before it accumulates.
    DTensor's backward hands some in another layout: partial sums over tp for the weights TP
    replicates and computes with on sequence shards (the sequence-parallel norms, LoRA's replicated
    factors, experts), the whole embedding gradient for its vocabulary shard. FSDP redistributes them
    in its reduce; here a hook per parameter does, per micro-batch as FSDP: the all-reduce of a
    partial sum, the rows of a vocabulary shard (so no whole embedding gradient stays). Called on
    the allocated model (to_empty swaps the parameters, and their hooks with them)."""
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        return
    for param in model.parameters():
        if param.requires_grad and isinstance(param, DTensor):
            param.register_hook(functools.partial(_placed_as, param.device_mesh, tuple(param.placements)))


def _placed_as(mesh: DeviceMesh, placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    if not isinstance(grad, DTensor) or tuple(grad.placements) == placements:
        return grad
    return grad.redistribute(mesh, placements)


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter. FSDP keeps the root gathered after a forward without backward,
    its module's parameters swapped for the unsharded ones (not the optimizer's). Without FSDP:
    nothing to free."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reshards(mode: str, index: int, num_layers: int) -> bool:
    """Whether decoder layer `index` frees its gathered parameters after forward. auto: every layer
    but the last, whose backward starts right after forward and would gather them again at once."""
    if mode == "auto":
        return index < num_layers - 1
    return mode == "always"


def set_prefetch(layers: list, depth: int) -> None:
    """Explicit FSDP prefetch: forward all-gathers the next `depth` layers while one computes,
    backward the `depth` layers before it (FSDP2's implicit default is one layer in backward)."""
    for index, layer in enumerate(layers):
        later = layers[index + 1 : index + 1 + depth]
        earlier = layers[max(0, index - depth) : index][::-1]
        if later:
            layer.set_modules_to_forward_prefetch(later)
        if earlier:
            layer.set_modules_to_backward_prefetch(earlier)


def check_tp_coverage(model: nn.Module) -> None:
    """Every parameter must be sharded or replicated by the plan: a forgotten module would stay a
    plain tensor, off the mesh, and silently train as a different model on each tp rank."""
    missing = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if missing:
        raise RuntimeError(f"the TP plan covers no style for these parameters: {', '.join(missing)}")


def check_on_mesh(model: nn.Module, parallel: Parallel) -> None:
    """Fail loudly if any parameter is off the training mesh: the whole (dp, tp) mesh, or at tp = 1
    (no TP applied) the dp mesh alone; with ep > 1, expert parameters on the experts mesh. Without
    FSDP (Parallel.sharded false): the tp mesh, or at tp = 1 plain tensors."""
    on_experts = {id(p) for _, m in experts.experts_modules(model) for p in m.parameters()}
    for name, param in model.named_parameters():
        expected = tuple(parallel_mesh_names(parallel, id(param) in on_experts))
        if not expected:
            if isinstance(param, DTensor):
                raise RuntimeError(f"parameter {name} is a DTensor on {param.device_mesh}, expected a tensor")
            continue
        if not isinstance(param, DTensor):
            raise RuntimeError(f"parameter {name} is not a DTensor after parallelize")
        names = tuple(param.device_mesh.mesh_dim_names or ())
        if names != expected:
            raise RuntimeError(f"parameter {name} is on mesh {names}, expected {expected}")


def parallel_mesh_names(parallel: Parallel, expert: bool) -> tuple[str, ...]:
    """The mesh axes a parameter lives on: the parameters' mesh (without tp at tp = 1, without the
    FSDP axes where FSDP has nothing to shard), or with ep > 1 an expert parameter's (dp_replicate,)
    efsdp, ep (, tp)."""
    if expert and parallel.ep_size > 1:
        names = parallel["experts"].mesh_dim_names
    else:
        names = parallel.mesh.mesh_dim_names if parallel.sharded else ("tp",)
    return tuple(name for name in names if name != "tp" or parallel.tp_size > 1)
