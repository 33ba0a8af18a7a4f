"""LoRA adapters on the sharded model, with PEFT's semantics: `W x + (alpha / r) B A dropout(x)`
(alpha / sqrt(r) with rsLoRA), A Kaiming-uniform(a=sqrt(5)) and B zero at init, under PEFT's
parameter names (`...q_proj.lora_A.weight`), so a PEFT adapter folder loads and exports as is.

Each adapter takes its layout from its base layer's TP placement, read off the sharded weight:
- colwise base (weight `Shard(0)`): A replicated over tp, B `Shard(0)` like the base; the input is
  replicated, each rank computes its own output columns of base + adapter.
- rowwise base (weight `Shard(1)`): A `Shard(1)` like the base, B replicated; base and adapter
  outputs are both partial sums, added before the style's output hook reduces them, so the
  row-parallel all-reduce (or sequence parallel's reduce-scatter) carries base + adapter once.
The adapted Linear keeps its TP style's hooks (they wrap the whole forward); its class becomes
LoraLinear, whose forward adds the adapter on DTensors, so DTensor sums A's gradient over tp.

The base is frozen (`requires_grad=False`: no gradient, no optimizer state) and optionally kept in
bf16 (lora.base_dtype), while the adapters stay fp32; FSDP2 shards both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtrain.config import ConfigError, LoraConfig
from dtrain.distributed import gather_whole
from dtrain.parallel.fused import FUSED_ATTR

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's saved names: this + the HF parameter name
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SETTINGS_ATTR = "dtrain_lora"  # the resolved LoraConfig, set on the model by apply_lora (for export)


def enabled(settings: LoraConfig) -> bool:
    return settings.r > 0 or bool(settings.adapter)


def resolve(settings: LoraConfig) -> LoraConfig:
    """lora.adapter's r, alpha, dropout, target modules and rsLoRA from its adapter_config.json, in
    place of the settings' own; without an adapter, the settings as they are."""
    if not settings.adapter:
        return settings
    path = Path(settings.adapter) / ADAPTER_CONFIG
    if not path.is_file() or not (Path(settings.adapter) / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(
            f"lora.adapter={settings.adapter!r}: no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} there"
        )
    saved = json.loads(path.read_text())
    if saved.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"lora.adapter={settings.adapter!r}: peft_type {saved['peft_type']!r}, not LORA")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if saved.get(key):  # PEFT variants whose model is not W x + scaling B A x on every target
            raise ConfigError(f"lora.adapter={settings.adapter!r}: {key}={saved[key]!r} is not supported")
    if saved.get("bias", "none") != "none":
        raise ConfigError(f"lora.adapter={settings.adapter!r}: bias={saved['bias']!r} is not supported")
    targets = saved.get("target_modules") or []
    return dataclasses.replace(
        settings,
        r=int(saved["r"]),
        alpha=float(saved.get("lora_alpha", 8)),
        dropout=float(saved.get("lora_dropout", 0.0)),
        target_modules=[targets] if isinstance(targets, str) else sorted(targets),
        use_rslora=bool(saved.get("use_rslora", False)),
    )


def base_dtype(settings: LoraConfig, precision: str) -> torch.dtype:
    """lora.base_dtype as it runs: auto is the training precision (bf16 runs keep a bf16 base); nf4
    too for the weights it leaves dense, and for what the NF4 ones are quantized from."""
    return DTYPES[precision if settings.base_dtype in ("auto", "nf4") else settings.base_dtype]


def scaling(settings: LoraConfig) -> float:
    return settings.alpha / (math.sqrt(settings.r) if settings.use_rslora else settings.r)


def is_target(name: str, targets: list[str]) -> bool:
    """PEFT's rule for a list of names: the module's name is one of them or ends with `.` + one."""
    return any(name == target or name.endswith("." + target) for target in targets)


def decoder_linears(layers: nn.ModuleList, prefix: str = "") -> dict[str, nn.Linear]:
    """{name under `prefix`: module} of the Linears in the decoder layers (those LoRA can adapt)."""
    found = {}
    for name, module in layers.named_modules(prefix=prefix):
        if isinstance(module, nn.Linear):
            found[name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")] = module
    return found


def check_targets(model: nn.Module, layers: nn.ModuleList, targets: list[str]) -> None:
    """Every lora.target_modules entry names a Linear of the decoder layers (by its end, or whole as
    PEFT's "all-linear" writes them)."""
    names = decoder_linears(layers, layer_prefix(model, layers))
    for target in targets:
        if not any(is_target(name, [target]) for name in names):
            short = sorted({name.rsplit(".", 1)[-1] for name in names})
            raise ConfigError(
                f"lora.target_modules: {target!r} names no linear projection of the decoder layers "
                f"(they are {', '.join(short)})"
            )


class LoraLinear(nn.Linear):
    """An nn.Linear with a LoRA adapter (`lora_A`, `lora_B`). Made by `attach` from a Linear already
    sharded by its TP style, whose hooks stay: inputs arrive as DTensors at tp > 1, and the output
    hook reduces base + adapter together."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float
    dropout: float
    dropout_seed: int
    dropout_calls: int
    bypassed = False  # adapters_bypassed(): the base Linear alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.bypassed:
            return result
        lora_x = self._dropout(x.to(self.lora_A.weight.dtype)) if self.dropout > 0 else x
        return result + F.linear(F.linear(lora_x, self.lora_A.weight), self.lora_B.weight) * self.scaling

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen base Linear's output (QLoRA's NF4 base: dtrain.parallel.qlora.QLoraLinear)."""
        return F.linear(x, self.weight, self.bias)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Inverted dropout with a mask every tp rank of the group draws alike: from a generator
        seeded by (seed, this module, forward count), over the whole feature width and then cut to
        this rank's columns when the input is sharded over features (rowwise base). Activation
        checkpointing's recompute (in backward) reuses the forward's mask."""
        if not self.training:
            return x
        if torch._C._current_graph_task_id() == -1:  # a forward, not a recompute in backward
            self.dropout_calls += 1
        local = x.to_local() if isinstance(x, DTensor) else x
        shape = list(local.shape)
        columns = slice(None)
        if isinstance(x, DTensor) and isinstance(x.placements[0], Shard):
            rank, width = x.device_mesh.get_local_rank(), shape[-1]
            shape[-1], columns = x.shape[-1], slice(rank * width, (rank + 1) * width)
        generator = torch.Generator(device=local.device).manual_seed(self.dropout_seed + self.dropout_calls)
        keep = torch.rand(shape, generator=generator, device=local.device)[..., columns] >= self.dropout
        dropped = local * keep.to(local.dtype) / (1.0 - self.dropout)
        if isinstance(x, DTensor):
            return DTensor.from_local(dropped, x.device_mesh, x.placements, run_check=False)
        return dropped

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.lora_A.out_features}, scaling={self.scaling}"


@contextlib.contextmanager
def adapters_bypassed(model: nn.Module) -> Iterator[None]:
    """The base model alone while inside: every adapter skipped, no dropout mask drawn (dtrain.dpo's
    dpo.reference=adapters_off: the reference without a second model)."""
    adapted = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for module in adapted:
        module.bypassed = True
    try:
        yield
    finally:
        for module in adapted:
            module.bypassed = False


def adapter_placements(weight: torch.Tensor) -> tuple[list, list] | None:
    """(A's, B's) placements over tp from the base weight's: colwise Shard(0) → (Replicate,
    Shard(0)); rowwise Shard(1) → (Shard(1), Replicate); replicated → both replicated. None at
    tp = 1 (plain tensors)."""
    if not isinstance(weight, DTensor):
        return None
    placement = weight.placements[0]
    if placement == Shard(0):
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


def attach(
    linear: nn.Linear, settings: LoraConfig, dropout_seed: int, lora_a: nn.Linear | None = None
) -> LoraLinear:
    """Give `linear` (on the meta device, TP already applied) its adapter, in place; `lora_a`: an A
    it shares with the other parts of its fused projection (their placements agree: all colwise)."""
    placements = adapter_placements(linear.weight)
    mesh = linear.weight.device_mesh if placements is not None else None
    lora_b = nn.Linear(settings.r, linear.out_features, bias=False, device="meta", dtype=torch.float32)
    modules = [lora_b]
    if lora_a is None:
        lora_a = nn.Linear(linear.in_features, settings.r, bias=False, device="meta", dtype=torch.float32)
        modules.insert(0, lora_a)
    if placements is not None:
        for module, placement in zip(modules, placements[-len(modules) :], strict=True):
            module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, placement))
    linear.__class__ = LoraLinear
    assert isinstance(linear, LoraLinear)
    linear.lora_A, linear.lora_B = lora_a, lora_b
    linear.scaling = scaling(settings)
    linear.dropout = settings.dropout
    linear.dropout_seed, linear.dropout_calls = dropout_seed, 0
    return linear


def apply_lora(
    model: nn.Module, layers: nn.ModuleList, settings: LoraConfig, dtype: torch.dtype, seed: int
) -> None:
    """Freeze the model, cast it to `dtype` (the base's), then give every targeted Linear of the
    decoder layers an fp32 adapter. On the meta model, after TP and before checkpointing and FSDP.
    `seed` keys the dropout masks (the same on the tp ranks of a group). The parts of a split fused
    projection (Phi-3's qkv_proj) are targeted by the fused name and share one A, as PEFT's single
    adapter of the fused Linear: `B A x` is then the parts' `B_part A x` stacked in HF's row order."""
    setattr(model, SETTINGS_ATTR, settings)
    model.requires_grad_(False)
    if dtype != torch.float32:
        model.to(dtype)  # swaps DTensor parameters in place: tied weights stay tied
    prefix = layer_prefix(model, layers)
    parts = fused_parts(model)
    shared: dict[str, nn.Linear] = {}  # fused name: the A its parts share
    for name, linear in decoder_linears(layers, prefix).items():
        peft_name = parts.get(name, (name, 0))[0]
        if settings.target_modules and not is_target(peft_name, settings.target_modules):
            continue
        module = attach(
            linear, settings, seed * 1_000_003 + zlib.crc32(peft_name.encode()), shared.get(peft_name)
        )
        shared[peft_name] = module.lora_A


def fused_parts(model: nn.Module) -> dict[str, tuple[str, int]]:
    """{part module name: (HF fused module name, its first row there)} of the split fused
    projections (dtrain/parallel/fused.py; Phi-3), empty for other families."""
    return {
        part.removesuffix(".weight"): (hf.removesuffix(".weight"), first)
        for part, (hf, first) in getattr(model, FUSED_ATTR, {}).items()
    }


def layer_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, module in model.named_modules() if module is layers)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """{HF name: module} of the adapted Linears."""
    wrappers = ("_checkpoint_wrapped_module.", "_orig_mod.")
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            for wrapper in wrappers:
                name = name.replace(wrapper, "")
            found[name] = module
    return found


@torch.no_grad()
def init_adapters(model: nn.Module, settings: LoraConfig, seed: int) -> None:
    """PEFT's init (init_lora_weights=True): A Kaiming-uniform(a=sqrt(5)), as nn.Linear's reset,
    drawn over the full shape from a generator keyed on (seed, name) so it does not depend on the
    mesh; B zero, so the adapted model starts as the base. lora.init=gaussian: A normal(0, 1/r)."""
    parts = fused_parts(model)
    for name, module in adapter_modules(model).items():
        a, b = module.lora_A.weight, module.lora_B.weight
        peft_name = parts.get(name, (name, 0))[0]  # a shared A: drawn alike for each of its parts
        generator = torch.Generator().manual_seed(
            seed * 1_000_003 + zlib.crc32(f"{peft_name}.lora_A".encode())
        )
        full = torch.empty(a.shape)
        if settings.init == "gaussian":
            full.normal_(0.0, 1.0 / settings.r, generator=generator)
        else:
            bound = 1.0 / math.sqrt(
                a.shape[1]
            )  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3/fan_in)
            full.uniform_(-bound, bound, generator=generator)
        _copy_full(a, full)
        _local(b).zero_()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of the full tensor into the (sharded) parameter."""
    if isinstance(param, DTensor):
        mesh, placements = param.device_mesh, param.placements
        shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
        full = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    _local(param).copy_(full.to(param.dtype))


@torch.no_grad()
def load_adapter(model: nn.Module, folder: str) -> None:
    """Each rank copies its slices of a PEFT adapter folder's weights into its adapter shards (a
    fused projection's part: the fused A, and its rows of the fused B)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    params = adapter_parameters(model)
    for name, (peft_name, first) in peft_names(model).items():
        key = PEFT_PREFIX + peft_name
        if key not in saved:
            raise ConfigError(f"lora.adapter={folder!r}: {ADAPTER_WEIGHTS} has no tensor {key}")
        param, tensor = params[name], saved[key]
        if ".lora_B." in name:
            tensor = tensor[first : first + param.shape[0]]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ConfigError(
                f"lora.adapter={folder!r}: {key} has shape {tuple(saved[key].shape)}, the model's "
                f"adapter {tuple(param.shape)}"
            )
        _copy_full(param, tensor)


def adapter_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """{HF name (`model.layers.0.self_attn.q_proj.lora_A.weight`): parameter} of every adapter, each
    once (a shared A under its first part's name): the names checkpoints hold."""
    found, seen = {}, set()
    for name, module in adapter_modules(model).items():
        if id(module.lora_A.weight) not in seen:
            seen.add(id(module.lora_A.weight))
            found[f"{name}.lora_A.weight"] = module.lora_A.weight
        found[f"{name}.lora_B.weight"] = module.lora_B.weight
    return found


def peft_names(model: nn.Module) -> dict[str, tuple[str, int]]:
    """{adapter_parameters name: (PEFT's name without PEFT_PREFIX, first row there)}: the fused
    module's name for a split part's adapter (its B's rows from `first`), the name itself otherwise."""
    parts = fused_parts(model)
    names = {}
    for name in adapter_parameters(model):
        module, adapter = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])
        fused, first = parts.get(module, (module, 0))
        names[name] = (f"{fused}.{adapter}", first)
    return names


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective. The adapters whole, fp32 on the CPU, under PEFT's saved names: a fused
    projection's parts' B concatenated in HF's row order, their shared A once."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    params = adapter_parameters(model)
    for name, (peft_name, first) in peft_names(model).items():
        param = params[name]
        full = gather_whole(param).detach().float().cpu()
        pieces.setdefault(PEFT_PREFIX + peft_name, []).append((first, full))
    return {
        key: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for key, parts in pieces.items()
    }


def peft_config(settings: LoraConfig, model: nn.Module, base_model: str | None) -> dict:
    """adapter_config.json as PEFT writes it (the keys PEFT needs; the rest take PEFT's defaults)."""
    parts = fused_parts(model)
    targets = sorted({parts.get(name, (name, 0))[0].rsplit(".", 1)[-1] for name in adapter_modules(model)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "use_rslora": settings.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": settings.init if settings.init == "gaussian" else True,
        "modules_to_save": None,
        "inference_mode": True,
    }


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{HF name of each adapted base weight: W + scaling · B A}, in W's sharding (the product of
    B's and A's placements is W's placement over tp)."""
    return {
        f"{name}.weight": merge(module.weight, module.lora_A.weight, module.lora_B.weight, module.scaling)
        for name, module in adapter_modules(model).items()
    }


@torch.no_grad()
def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's merge of one adapter, in fp32: `W + (B @ A) · scaling`, laid out as W (DTensors: W's
    sharding, the product of B's and A's placements being W's over tp; plain tensors: PEFT's own
    arithmetic on the whole matrices). An NF4 base dequantizes. The product is PEFT's on the whole
    adapters (small: gathered an axis at a time, gather_whole, as a DTensor product of FSDP-sharded
    factors would redistribute them all at once, with torch's warning), then cut as W is cut."""
    delta = (gather_whole(lora_b) @ gather_whole(lora_a)) * scaling
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        whole = DTensor.from_local(delta, mesh, [Replicate()] * mesh.ndim)
        delta = whole.redistribute(mesh, weight.placements)
    return weight.to(torch.float32, copy=True) + delta
