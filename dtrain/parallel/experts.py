"""Mixture-of-experts layers: expert parallel over the `ep` mesh axis (the TP styles of the router
and the sparse block: dtrain/parallel/moe.py).

transformers 5 stores a layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) and computes them through its experts-function registry (`transformers.integrations.moe`).
dtrain registers its own function there (`EXPERTS`) and builds the families of STACKED_EXPERTS with
it, as it registers its attention: HF's router (top-k, its softmax and normalisation) is unchanged.

The layout (torchtitan's): the ep ranks are the innermost ranks FSDP shards over (dp_shard × cp).
Each expert parameter is a DTensor split over ep on its expert dimension (Shard(0)), replicated over
tp, and FSDP-shards each rank's experts over the remaining `efsdp` ranks (distributed.Parallel). Every
other parameter is laid out as in a dense model.

Tokens: each rank routes its own tokens (its rows, its context-parallel part of them, and at tp > 1
its sequence-parallel part), sends each (token, expert) pair to the ep rank holding the expert
(`all_to_all_single`, uneven splits, autograd), computes the experts it holds on what it received,
and sends the results back, where they are weighted by the router and summed per token in HF's
order. At tp > 1 the experts and the router are replicated over tp and each tp rank computes on its
own tokens: their gradients are partial sums over tp, which FSDP reduces (Partial → Replicate).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers.core_model_loading import WeightRenaming, rename_source_key
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from dtrain.config import ConfigError

EXPERTS = "dtrain_experts"
# model_type → the config key of the expert count. Families whose experts transformers stacks as
# gate_up_proj [E, 2I, H] and down_proj [E, H, I] (GPT-OSS: transposed, [E, H, 2I] and [E, I, H], with
# biases [E, 2I] and [E, H]).
STACKED_EXPERTS = {
    "qwen3_moe": "num_experts",
    "mixtral": "num_local_experts",
    "olmoe": "num_experts",
    "gpt_oss": "num_local_experts",
}
# The router module beside `experts` where it is not called `gate` (GPT-OSS's has a bias too).
ROUTERS = {"gpt_oss": "router"}
# The routing dtrain.estimate plans at ep > 1 (docs/estimate.md): the busiest ep rank receives this
# many times the mean (token, expert) rows; 1.0 is perfect balance. Fine-tuning with the aux loss
# keeps the per-layer expert load (metrics.jsonl's expert_load) mostly under it; a run's logged
# expert_load bounds its per-rank imbalance from above (a rank holds E/ep experts).
PLAN_IMBALANCE = 1.5
# Set on each experts module by `shard_experts`: the ep mesh its tokens travel over (None: ep = 1).
EP_MESH = "dtrain_ep_mesh"


def num_experts(model_config: Any) -> int:
    return getattr(model_config, STACKED_EXPERTS[model_config.model_type])


def configure(config: Any) -> None:
    """Make `config` build models whose experts run dtrain's function (families of STACKED_EXPERTS)."""
    if config.model_type in STACKED_EXPERTS:
        config._experts_implementation = EXPERTS


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every stacked-experts module (name, module): 3-D gate_up_proj and down_proj."""
    found = []
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3:
            found.append((name, module))
    return found


def expert_placements(ep: int, tp: int) -> list:
    """Placements of an expert parameter on its mesh before FSDP: split over ep, replicated over tp."""
    return [*([Shard(0)] if ep > 1 else []), *([Replicate()] if tp > 1 else [])]


def shard_experts(model: nn.Module, parallel: Any) -> None:
    """Split each layer's experts over ep (Shard(0)) and replicate them over tp, on the meta device
    before TP and FSDP; at ep = tp = 1 they stay plain, FSDP-sharded like any weight. Expert biases
    (GPT-OSS: [E, 2I] and [E, H]) are split as their weights: each rank holds its experts' rows."""
    ep, tp = parallel.ep_size, parallel.tp_size
    mesh = parallel["ep_tp"] if ep > 1 else parallel["tp"] if tp > 1 else None
    placements = expert_placements(ep, tp)
    for _, module in experts_modules(model):
        if not module.has_gate:
            raise ConfigError(f"{type(module).__name__}: experts without a gate projection are not supported")
        setattr(module, EP_MESH, parallel["ep"] if ep > 1 else None)
        if mesh is None:
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements)))


def fully_shard_experts(layer: nn.Module, parallel: Any, **fsdp_options: Any) -> None:
    """ep > 1: FSDP over the efsdp ranks for each experts module of the layer (before the layer's own
    fully_shard, which then leaves them out); its parameters end up on the experts mesh."""
    if parallel.ep_size == 1:
        return
    for _, module in experts_modules(layer):
        fully_shard(module, mesh=parallel["efsdp"], **fsdp_options)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts. Replicated over tp, each tp rank computes on its own tokens: the
    gradient is a partial sum over tp (FSDP reduces it)."""
    if not isinstance(param, DTensor):
        return param
    grads = [Partial() if isinstance(p, Replicate) else p for p in param.placements]
    return param.to_local(grad_placements=grads)


class LocalWeights(NamedTuple):
    """This rank's experts in HF's layout, as plain tensors (`_local`): gate_up [E, 2I, H] and down
    [E, H, I], or [E, H, 2I] and [E, I, H] when `transposed` (GPT-OSS); biases [E, 2I] and [E, H]."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    transposed: bool


def local_weights(module: nn.Module) -> LocalWeights:
    biases = (module.gate_up_proj_bias, module.down_proj_bias) if module.has_bias else (None, None)
    gate_up_bias, down_bias = (None if bias is None else _local(bias) for bias in biases)
    return LocalWeights(
        _local(module.gate_up_proj), _local(module.down_proj), gate_up_bias, down_bias, module.is_transposed
    )


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts interface: [tokens, hidden] in, each token's weighted sum of its top-k
    experts' outputs out. The (token, expert) pairs in expert order (token order within an expert),
    computed where their expert lives, weighted and summed per token in expert order, as HF's eager
    loop sums them."""
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    pairs = hidden_states[tokens]
    weights = local_weights(self)
    mesh = getattr(self, EP_MESH, None)
    if is_fake(top_k_index):  # dtrain.estimate: the routing is data, which fake tensors do not hold
        out = planned_experts(self, pairs, weights, mesh)
    else:
        counts = torch.bincount(flat, minlength=self.num_experts)
        if mesh is None:
            out = local_experts(self, pairs, counts.tolist(), weights)
        else:
            out = dispatched_experts(self, pairs, counts, weights, mesh)
    weighted = out * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, tokens, weighted.to(hidden_states.dtype))


def grouped_mm_runs(weights: LocalWeights) -> bool:
    """Which kernel computes the local experts, by one rule: torch's grouped_mm (every expert in one
    call) where it has a kernel for the weights' device and dtype, a loop of one matmul per expert
    elsewhere. grouped_mm's kernels: CUDA in bf16 on SM >= 80 (so bf16 training on A100/H100, not
    fp32); CPU in any float dtype whose matrix rows are multiples of 16 bytes (its kernel's stride
    rule: hidden and intermediate sizes multiples of 4 in fp32). dtrain.estimate's fake tensors plan
    a CUDA run (grouped_mm's fake kernel takes CUDA's dtypes): bf16 there. Both compute the same
    function (fp32 on CPU: bitwise equal, forward and backward)."""
    gate_up = weights.gate_up
    if is_fake(gate_up):
        return gate_up.dtype == torch.bfloat16
    if gate_up.device.type == "cuda":
        return gate_up.dtype == torch.bfloat16 and torch.cuda.get_device_capability(gate_up.device) >= (8, 0)
    if gate_up.device.type == "cpu":
        sizes = (*gate_up.shape[1:], *weights.down.shape[1:])
        return all(size * gate_up.element_size() % 16 == 0 for size in sizes)
    return False


def local_experts(
    module: nn.Module, rows: torch.Tensor, counts: list[int], weights: LocalWeights
) -> torch.Tensor:
    """Rows grouped by local expert (`counts` rows each, in expert order) through their expert: HF's
    x·W (+ b) per expert, then the module's own gate (`_apply_gate`: SiLU·up, or GPT-OSS's clamped
    interleaved one), then the down projection (+ b)."""
    if grouped_mm_runs(weights):
        sizes = torch.tensor(counts, device=rows.device)
        offsets = sizes.cumsum(0).to(torch.int32)
        experts = None  # each row's expert, to add its bias
        if weights.gate_up_bias is not None:
            experts = torch.repeat_interleave(
                torch.arange(len(counts), device=rows.device), sizes, output_size=rows.shape[0]
            )
        hidden = _grouped(rows, weights.gate_up, weights.gate_up_bias, offsets, experts, weights.transposed)
        return _grouped(
            module._apply_gate(hidden), weights.down, weights.down_bias, offsets, experts, weights.transposed
        )
    outs = []
    for expert, part in enumerate(rows.split(counts)):
        hidden = _linear(part, weights.gate_up, weights.gate_up_bias, expert, weights.transposed)
        outs.append(
            _linear(module._apply_gate(hidden), weights.down, weights.down_bias, expert, weights.transposed)
        )
    return torch.cat(outs)


def _grouped(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    experts: torch.Tensor | None,
    transposed: bool,
) -> torch.Tensor:
    out = F.grouped_mm(rows, weight if transposed else weight.transpose(-2, -1), offs=offsets)
    return out if bias is None else out + bias[experts]


def _linear(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expert: int, transposed: bool
) -> torch.Tensor:
    out = rows @ weight[expert] if transposed else F.linear(rows, weight[expert])
    return out if bias is None else out + bias[expert]


def dispatched_experts(
    module: nn.Module, pairs: torch.Tensor, counts: torch.Tensor, weights: LocalWeights, mesh: DeviceMesh
) -> torch.Tensor:
    """The (token, expert) rows, in global expert order, sent to the ep ranks that hold their experts
    (rank r holds experts [r·E/ep, (r+1)·E/ep): expert order is rank order), computed there and sent
    back in the same order."""
    ranks, local = mesh.size(), weights.gate_up.shape[0]
    group = mesh.get_group()
    received_counts = torch.empty_like(counts)  # [source rank, local expert]: rows each sends me
    torch.distributed.all_to_all_single(received_counts, counts, group=group)
    send = counts.view(ranks, local).sum(1).tolist()
    received_counts = received_counts.view(ranks, local)
    receive = received_counts.sum(1).tolist()
    rows = all_to_all_single_autograd(pairs, receive, send, mesh)
    # Received source by source, each in expert order: regroup by expert (source order within it).
    experts = torch.arange(local, device=counts.device).repeat(ranks)
    regroup = torch.argsort(torch.repeat_interleave(experts, received_counts.flatten()), stable=True)
    out = local_experts(module, rows[regroup], received_counts.sum(0).tolist(), weights)
    out = out[torch.argsort(regroup)]  # back to source order
    return all_to_all_single_autograd(out, send, receive, mesh)


def _even(total: int, parts: int) -> list[int]:
    """`total` split in `parts` as evenly as integers allow (the first ones one larger)."""
    return [total // parts + (part < total % parts) for part in range(parts)]


def planned_experts(
    module: nn.Module, pairs: torch.Tensor, weights: LocalWeights, mesh: DeviceMesh | None
) -> torch.Tensor:
    """The planner's path (fake tensors: how many tokens each expert gets is data). The same
    operations and buffers as the real path under a planned routing: at ep = 1 the (token, expert)
    pairs split evenly over the experts (their total, hence the activations, is the real one); at
    ep > 1 this rank receives PLAN_IMBALANCE × the mean rows (what the busiest ep rank receives when
    routing is that unbalanced), evenly from each source, for its experts evenly, and sends back
    what it received."""
    local = weights.gate_up.shape[0]
    if mesh is None:
        return local_experts(module, pairs, _even(pairs.shape[0], local), weights)
    ranks = mesh.size()
    send = _even(pairs.shape[0], ranks)
    receive = _even(math.ceil(PLAN_IMBALANCE * pairs.shape[0]), ranks)
    rows = all_to_all_single_autograd(pairs, receive, send, mesh)
    regroup = torch.arange(rows.shape[0], device=rows.device)  # the real path's two permutations
    out = local_experts(module, rows[regroup], _even(rows.shape[0], local), weights)
    return all_to_all_single_autograd(out[regroup], send, receive, mesh)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts_forward)


def load_stacked(
    state: dict[str, torch.Tensor], where: dict[str, Path], transforms: list, base_model_prefix: str
) -> None:
    """Fill each rank's experts (their stacked parameters popped from `state`, HF's names) from the
    per-expert tensors of HF's checkpoints, found by transformers' own conversions of the family
    (`transforms`: Qwen3-MoE's `mlp.experts.{e}.gate_proj.weight`, Mixtral's
    `block_sparse_moe.experts.{e}.w1.weight` ...; `where`: each tensor's file; the keys read are
    popped from it): gate_up_proj[e] is the gate's rows then the up projection's, down_proj[e] the
    down projection. Only this rank's experts are read. A folder dtrain exported holds the stacked
    tensors themselves: those stay for DCP's reader."""
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    sources: dict[str, dict[tuple[int, int], tuple[str, Path]]] = {}
    for key in list(where):
        name, pattern = rename_source_key(key, renamings, converters, base_model_prefix, state)
        if pattern is None or not name.endswith((".gate_up_proj", ".down_proj")) or name not in state:
            continue
        part = next(c for c in converters if pattern in c.source_patterns).source_patterns.index(pattern)
        expert = int(re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key).group(1))
        sources.setdefault(name, {})[(expert, part)] = (key, where.pop(key))
    for name, parts in sources.items():
        param = state.pop(name)
        experts, rows, columns = _local_slices(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        count = 1 + max(part for _, part in parts)
        for index, expert in enumerate(range(experts.start, experts.stop)):
            blocks = []
            for part in range(count):
                if (expert, part) not in parts:
                    raise ConfigError(f"{name}: expert {expert}'s part {part} is in no safetensors file")
                key, file = parts[(expert, part)]
                with safe_open(file, "pt") as reader:
                    blocks.append(reader.get_tensor(key))
            local[index].copy_(torch.cat(blocks)[rows, columns])


def _local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


class RouterStats:
    """Each step's routing, read off the routers by forward hooks while `recording`: the expert counts
    per layer (for the expert load and the aux loss) and, for the aux loss, each layer's summed router
    probabilities of this forward (differentiable).

    The load-balancing loss is HF's (`load_balancing_loss_func` without an attention mask, as HF
    computes it for dtrain's calls): E · Σ_e (C_e / (L·N)) · (P_e / (L·N)), with C_e the top-k
    assignments to expert e and P_e its router probability summed over the L expert layers and the N
    tokens, here of the whole global batch: every rank and micro-batch, so it is the same on every
    mesh. C is known only after every micro-batch's forward, and the gradient needs it, so a step with
    the aux loss first counts the routes in a forward without gradients (`count`); each micro-batch
    then adds coef · E/(L·N)² · Σ_e C_e · P_e(its tokens) to its loss, which sums to coef · aux over
    the step."""

    def __init__(self, model: nn.Module, routers: list[nn.Module]) -> None:
        config = model.config
        self.num_experts, self.layers, self.top_k = (
            num_experts(config),
            len(routers),
            config.num_experts_per_tok,
        )
        self.index = {id(router): layer for layer, router in enumerate(routers)}
        self.coef = config.router_aux_loss_coef if getattr(config, "output_router_logits", False) else 0.0
        self.recording = False
        self.counted = False  # whether this step's counts come from `count`, already global
        self.counts = torch.zeros(0)
        self.probs: list[torch.Tensor] = []
        self.aux = torch.zeros(())
        for router in routers:
            router.register_forward_hook(self._record)

    @classmethod
    def attach(cls, model: nn.Module) -> RouterStats | None:
        """Hooks on every router (the experts' sibling `gate`, or ROUTERS' name); None for a model
        without experts."""
        modules, router = dict(model.named_modules()), ROUTERS.get(model.config.model_type, "gate")
        routers = [modules[f"{name.rsplit('.', 1)[0]}.{router}"] for name, _ in experts_modules(model)]
        return cls(model, routers) if routers else None

    def begin_step(self, micro_batches: list, forward: Any) -> None:
        """Start the step's record; with an aux loss, count the whole step's routes first (`count`:
        its gradient needs the global counts). `forward(micro_batch)` runs the objective's forward."""
        device = micro_batches[0]["input_ids"].device
        self.counts = torch.zeros(self.layers, self.num_experts, device=device)
        self.aux, self.counted, self.probs = torch.zeros((), device=device), False, []
        if self.coef:
            self.count(forward, micro_batches)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        logits, _, indices = output
        probs = None
        if self.coef and torch.is_grad_enabled():
            # also when not recording: activation checkpointing's recomputed forward (not recorded)
            # must save the tensors the recorded forward saved
            probs = torch.softmax(logits.float(), dim=-1).sum(0)
        if not self.recording:  # eval, other forwards, and the recomputed forward in backward
            return
        if not self.counted:
            counts = torch.bincount(indices.flatten(), minlength=self.num_experts)
            self.counts[self.index[id(module)]] += counts.to(self.counts.dtype)
        if probs is not None:
            self.probs.append(probs)

    def count(self, forward: Any, micro_batches: list) -> None:
        """The step's global counts before its first gradient (aux loss only): a forward of every
        micro-batch without gradients, the counts summed over every rank (each holds other tokens:
        its rows, its cp part, its sequence-parallel part at tp > 1)."""
        self.recording = True
        with torch.no_grad():
            for micro_batch in micro_batches:
                forward(micro_batch)
        self.recording = False
        torch.distributed.all_reduce(self.counts)
        self.counted = True

    def aux_term(self) -> torch.Tensor | None:
        """This forward's share of coef · aux (None without the aux loss), to add to its loss."""
        self.recording = False
        if not self.coef:
            return None
        assigned = self.counts.sum(0)  # C_e over every layer
        rows = assigned.sum() / self.top_k  # L·N: each token is assigned top_k times per layer
        share = self.num_experts * (assigned * torch.stack(self.probs).sum(0)).sum() / rows**2
        self.probs = []
        self.aux += share.detach()
        return self.coef * share

    def figures(self) -> dict[str, float]:
        """The step's aux_loss (unscaled, HF's `aux_loss`) and expert load: the worst layer's busiest
        expert over its mean (1.0: perfectly balanced). A collective: every rank calls it."""
        aux = self.aux.clone()
        torch.distributed.all_reduce(aux)
        counts = self.counts.clone()
        if not self.counted:
            torch.distributed.all_reduce(counts)
        load = (counts.max(dim=1).values / counts.mean(dim=1)).max().item()
        return {**({"aux_loss": aux.item()} if self.coef else {}), "expert_load": load}
