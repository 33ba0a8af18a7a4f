"""Build the HF model on the meta device, then fill each rank's shards: HF safetensors slices read
straight into the sharded parameters, or a seeded init that is the same on every mesh."""

from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
)
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key

from dtrain import attention
from dtrain.config import Config, ConfigError, LoraConfig, ModelConfig
from dtrain.distributed import Parallel
from dtrain.parallel import experts, fused, lora, phi3, qlora, vocab
from dtrain.parallel.parallelize import (
    check_tp_divides,
    check_tp_support,
    keep_gradient_placements,
    parallelize,
)

# Copies of the config.json of the hub models conf/model/ names, so the planner works offline.
ARCHITECTURES = Path(__file__).parent / "assets" / "architectures"
# transformers' renamings of the family's checkpoint keys, set on the meta model by build_meta_model.
CHECKPOINT_TRANSFORMS = "dtrain_checkpoint_transforms"
# What activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def resolve_model_path(name_or_path: str) -> str:
    """A local folder as is; a hub id downloaded (config, tokenizer, safetensors) into the HF cache."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if looks_local(name_or_path):
        raise ConfigError(f"model.name_or_path={name_or_path!r}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as error:  # the hub's errors are many; the user needs the id and the cause
        raise ConfigError(
            f"model.name_or_path={name_or_path!r}: not a local folder, and the hub download failed: {error}"
        ) from error


def looks_local(path: str) -> bool:
    """A path meant as a folder on disk, so a typo is "no such folder", not a failed hub lookup (hub
    ids are `name` or `org/name`)."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


def load_model_config(settings: ModelConfig, offline: bool = False) -> PretrainedConfig:
    """The architecture of model.name_or_path (its config.json), with model.config's overrides on top.
    Without name_or_path, model.config is the whole architecture of a from-scratch model.

    offline=True (the planner) never downloads: a local folder is read as usual, a hub id from the
    copy of its config.json that dtrain ships (dtrain/assets/architectures/<hub id>/)."""
    overrides = dict(settings.config)
    if not settings.name_or_path:
        if "model_type" not in overrides:
            raise ConfigError("model.name_or_path: required (a local HF folder or a hub id)")
        return AutoConfig.for_model(**overrides)
    if offline and not os.path.isdir(settings.name_or_path):
        folder = ARCHITECTURES / settings.name_or_path
        if not (folder / "config.json").is_file():
            configs = ARCHITECTURES.glob("*/*/config.json")
            shipped = sorted(str(path.parent.relative_to(ARCHITECTURES)) for path in configs)
            raise ConfigError(
                f"model.name_or_path={settings.name_or_path!r}: not a local folder, and hub ids are not "
                f"downloaded offline; dtrain ships the architecture of {', '.join(shipped)}: "
                "point model.name_or_path at a local folder with the model's config.json"
            )
    else:
        folder = resolve_model_path(settings.name_or_path)
    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tokenizer_source(settings: ModelConfig) -> str:
    """The folder (or hub id) the tokenizer comes from: model.tokenizer, else name_or_path's."""
    return settings.tokenizer or resolve_model_path(settings.name_or_path)


def has_weights(name_or_path: str | None) -> bool:
    """Whether the model folder (or hub id) holds safetensors weights; no name_or_path holds none."""
    return bool(name_or_path) and any(Path(resolve_model_path(name_or_path)).glob("*.safetensors"))


def resolve_init(settings: ModelConfig) -> str:
    """model.init as it will run: `auto` is `pretrained` when name_or_path has weights (safetensors),
    else `random` (said in the log). `pretrained` without weights is an error."""
    weights = has_weights(settings.name_or_path)
    if settings.init == "pretrained" and not weights:
        where = (
            f"{settings.name_or_path!r} has no *.safetensors files"
            if settings.name_or_path
            else "no model.name_or_path"
        )
        raise ConfigError(f"model.init=pretrained: {where} (model.init=random trains from scratch)")
    if settings.init != "auto":
        return settings.init
    return "pretrained" if weights else "random"


# Model types whose fused projections are split into one module per part (dtrain/parallel/fused.py).
SPLIT_FUSED = {"phi3": phi3.split_fused_projections}


def build_model(
    model_config: PretrainedConfig,
    config: Config,
    parallel: Parallel,
    device: torch.device | None,
    vocab_rows: int | None = None,
    attention_backend: str = "auto",
    frozen: bool = False,
) -> nn.Module:
    """The one way dtrain makes a model: on the meta device, sharded over the mesh (TP, activation
    checkpointing, compile, FSDP2: parallelize), then this rank's shards allocated on `device` and
    filled as model.init says. `device=None` leaves the shards on the meta device for the caller
    to allocate (the planner, on fake tensors; export, from a checkpoint). `vocab_rows` defaults
    to the vocabulary padded for this tp (a resumed run passes the checkpoint's). `frozen`: forwards
    only, in the compute dtype (parallelize's; dtrain.dpo's live reference)."""
    rows = vocab_rows or vocab.padded_vocab_size(model_config.vocab_size, parallel.tp_size)
    model = build_meta_model(model_config, config.data.packing, rows, attention_backend)
    lora_settings = lora.resolve(config.lora)
    precision, seed = config.train.precision, config.train.seed
    parallelize(model, parallel, config.parallel, precision, lora_settings, seed, frozen)
    if device is not None:
        materialize(model, device, config.model, config.train.seed, lora_settings)
    return model


def build_frozen_model(
    config: Config,
    parallel: Parallel,
    device: torch.device | None,
    folder: str | None = None,
    policy: PretrainedConfig | None = None,
    vocab_rows: int | None = None,
    attention_backend: str = "auto",
    offline: bool = False,
) -> nn.Module:
    """A frozen model (forwards only, the compute dtype) built and sharded on the policy's mesh as the
    policy is (build_model): with `folder` None, the starting policy (model.*'s weights, LoRA's starting
    adapters included; `policy` its architecture, `vocab_rows` its vocabulary rows); else the Hugging
    Face model folder (or hub id) `folder`, its own architecture and weights, no adapters (dtrain.dpo's
    dpo.ref_model, dtrain.distill's teacher), its vocabulary padded to the policy's `vocab_rows` so both
    heads split it alike over tp. `offline`: a hub id's shipped architecture (the planner)."""
    if folder is None:
        assert policy is not None
        return build_model(policy, config, parallel, device, vocab_rows, attention_backend, frozen=True)
    settings = ModelConfig(name_or_path=folder, init="pretrained")
    own = dataclasses.replace(config, model=settings, lora=LoraConfig())
    architecture = load_model_config(settings, offline=offline)
    check_other_model(folder, architecture, policy, parallel.tp_size)
    return build_model(architecture, own, parallel, device, vocab_rows, attention_backend, frozen=True)


def check_other_model(
    folder: str, architecture: PretrainedConfig, policy: PretrainedConfig | None, tp: int
) -> None:
    """A model of another folder beside the policy: it scores the policy's token ids (the same
    vocabulary size) and runs on the policy's mesh (the policy's own checks, dtrain.checks). Every
    rank raises alike, before any collective of its build."""
    named = f"the model in {folder}"
    if policy is not None and architecture.vocab_size != policy.vocab_size:
        raise ConfigError(
            f"{named}: vocab_size {architecture.vocab_size}, the policy's {policy.vocab_size}: it must score "
            "the same token ids (the same tokenizer)"
        )
    check_tp_support(architecture.model_type, tp, named)
    check_tp_divides(architecture, tp, named)


def build_meta_model(
    config: PretrainedConfig,
    packed: bool = False,
    vocab_rows: int | None = None,
    attention_backend: str = "auto",
) -> nn.Module:
    """The model on the meta device, unsharded. `packed` (data.packing) turns on the document mask: a
    setting, not a test of each batch, so no step waits on the device to decide it. `vocab_rows`
    (vocab.padded_vocab_size) pads the embedding and lm_head for a tp that vocab_size is not a
    multiple of. `attention_backend`: see dtrain.attention."""
    attention.configure(config, packed, attention_backend)
    experts.configure(config)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention.ATTENTION, dtype=torch.float32
        )
    # Looked up by class name, which fully_shard changes: kept from the plain HF class.
    setattr(model, CHECKPOINT_TRANSFORMS, get_model_conversion_mapping(model))
    if config.model_type in SPLIT_FUSED:
        SPLIT_FUSED[config.model_type](model)
    vocab.pad_vocab(model, vocab_rows or config.vocab_size)
    attention.attach_block_masks(model)
    return model


def plain_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a dtrain model's config as transformers builds the model outside dtrain (an export,
    a generator): transformers' own attention and experts code (the private implementation choices
    are not copied) without dtrain's attention settings, and the KV cache on (build_meta_model turns
    it off for training)."""
    values = config.to_dict()
    for key in attention.CONFIG_KEYS:
        values.pop(key, None)
    plain = type(config).from_dict(values)
    plain.use_cache = True
    return plain


def save_config(model_config: PretrainedConfig, folder: Path, dtype: torch.dtype) -> None:
    """config.json and generation_config.json of a Hugging Face folder of the model: the plain
    transformers architecture (plain_config), its class named, weights in `dtype`."""
    config = plain_config(model_config)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
    config.dtype = dtype
    config.save_pretrained(folder)
    _generation_config(model_config).save_pretrained(folder)


def _generation_config(model_config: PretrainedConfig) -> GenerationConfig:
    try:
        return GenerationConfig.from_model_config(model_config)
    except Exception:  # a config without generation fields still exports
        return GenerationConfig()


def materialize(
    model: nn.Module,
    device: torch.device,
    settings: ModelConfig,
    seed: int,
    lora_settings: LoraConfig | None = None,
) -> None:
    """Allocate this rank's shards on `device` and fill them; LoRA adapters from lora.adapter's
    folder or PEFT's init."""
    allocate(model, device)
    if resolve_init(settings) == "pretrained":
        assert settings.name_or_path
        load_hf_weights(model, resolve_model_path(settings.name_or_path))
    else:
        init_weights(model, seed)
    if lora_settings is not None and lora_settings.adapter:
        lora.load_adapter(model, lora_settings.adapter)
    elif lora_settings is not None and lora.enabled(lora_settings):
        lora.init_adapters(model, lora_settings, seed)


def allocate(model: nn.Module, device: torch.device) -> None:
    """This rank's shards on `device`, not yet filled (weights come next: HF files, the seeded init or a
    checkpoint); the rotary buffers, which no file holds, computed. Tied weights stay one parameter:
    to_empty makes a new Parameter per module for plain meta tensors (no FSDP on one process), so
    each module's is set back to the first one's."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for shared in places.values():
        first = getattr(*shared[0])
        for module, name in shared[1:]:
            setattr(module, name, first)
    reset_rotary_buffers(model, device)
    keep_gradient_placements(model)


def reset_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """inv_freq is a non-persistent buffer: to_empty() leaves garbage and no checkpoint restores it.
    Gemma 3 keeps one per layer type (`sliding_attention_inv_freq`, ...) with its own rope base, and
    its embedding's `embed_scale` is such a buffer too."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            init_fn = (
                module.compute_default_rope_parameters
                if module.rope_type == "default"
                else _rope_init_functions()[module.rope_type]
            )
            inv_freq, module.attention_scaling = init_fn(module.config)
            module.inv_freq = inv_freq.to(device)
            module.original_inv_freq = inv_freq.clone().to(device)
        elif isinstance(getattr(module, "rope_type", None), dict):
            for layer_type, rope_type in module.rope_type.items():
                init_fn = (
                    module.compute_default_rope_parameters
                    if rope_type == "default"
                    else _rope_init_functions()[rope_type]
                )
                inv_freq, scaling = init_fn(module.config, layer_type=layer_type)
                setattr(module, f"{layer_type}_inv_freq", inv_freq.to(device))
                setattr(module, f"{layer_type}_original_inv_freq", inv_freq.clone().to(device))
                setattr(module, f"{layer_type}_attention_scaling", scaling)
        if hasattr(module, "scalar_embed_scale"):
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)


def _rope_init_functions() -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def canonical_name(name: str) -> str:
    """The HF name of a parameter, whatever wrappers (activation checkpointing, compile) sit around it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under HF names, without the tied lm_head (HF files omit it) and
    without LoRA adapters (dtrain.parallel.lora.adapter_parameters has those)."""
    state = {canonical_name(k): v for k, v in model.state_dict().items() if not lora.is_adapter(k)}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def tensor_files(folder: str) -> dict[str, Path]:
    """{tensor key: the safetensors file that holds it}, from the files' headers, read once per load."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.name_or_path={folder!r}: no *.safetensors files to load")
    where = {}
    for file in files:
        try:
            with safe_open(file, "pt") as reader:
                where |= dict.fromkeys(reader.keys(), file)
        except SafetensorError as error:  # truncated, or not safetensors at all: on every rank alike
            raise ConfigError(f"{file}: not a readable safetensors file ({error}); copy it again") from None
    return where


def file_keys(model: nn.Module, where: dict[str, Path], state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{parameter name: its key in the safetensors files (`where`: tensor_files)}, by transformers'
    own renamings of the family's checkpoints (GPT-NeoX's `embed_out` is the model's `lm_head`, a
    base model's files lack the `model.` prefix, checked against `state`, hf_state_dict's names);
    keys that need more than a rename are refused, not misread."""
    transforms = getattr(model, CHECKPOINT_TRANSFORMS)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = {}
    for key, file in where.items():
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if converter is not None:
            raise ConfigError(
                f"{file}: {key} needs transformers' weight conversion {converter!r} "
                f"(model_type={model.config.model_type!r}), which dtrain does not do"
            )
        names[name] = key
    return names


def load_hf_weights(model: nn.Module, folder: str) -> None:
    """Each rank reads only its slices of the safetensors files (DCP's HF reader does the planning).
    NF4 base weights (QLoRA) are read dense a decoder layer at a time and quantized on each shard."""
    where = tensor_files(folder)
    state = hf_state_dict(model)
    # HF's files keep one tensor per expert: read by hand (transformers' converters would stack them)
    experts.load_stacked(state, where, getattr(model, CHECKPOINT_TRANSFORMS), model.base_model_prefix)
    keys = file_keys(model, where, state)
    quantized = {name: state.pop(name) for name in qlora.nf4_parameters(model)}
    read_shards(model, state, keys, where, folder)
    for layer in qlora.by_layer(quantized):
        dense = {name: qlora.dense_like(param) for name, param in layer.items()}
        read_shards(model, dict(dense), keys, where, folder)
        qlora.quantize_all(model, dense)


def read_shards(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    keys: dict[str, str],
    where: dict[str, Path],
    folder: str,
) -> None:
    """Fill `state`'s tensors (this rank's shards, by parameter name) from the files."""
    state = {keys.get(name, name): tensor for name, tensor in state.items()}
    # Padded vocabulary matrices have more rows than the files: read by hand, the rest by DCP.
    padded = {name: state.pop(name) for name in vocab.padded_params(model) if name in state}
    fused.load_parts(model, state, where)  # split fused projections: their rows of HF's tensors
    if state:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
    vocab.load_padded_rows(padded, where, model.config.vocab_size)


def local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    """Which part of the full tensor this rank holds."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


# Model types whose RMSNorm multiplies by (1 + weight): HF initialises those weights to zero.
ZERO_CENTRED_NORMS = {"gemma3_text"}


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """HF Llama's init (normal(0, initializer_range), norms at one; at zero for Gemma's norms, which
    scale by 1 + weight), drawn per parameter from a generator keyed on (seed, name) over the full
    shape, so the weights do not depend on the mesh. Only one full parameter exists at a time, on
    the CPU."""
    std = model.config.initializer_range
    norm_value = 0.0 if model.config.model_type in ZERO_CENTRED_NORMS else 1.0
    padded = {id(p) for p in vocab.padded_params(model).values()}
    quantized = qlora.nf4_parameters(model)

    def draw(name: str, param: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        rows = model.config.vocab_size if id(param) in padded else param.shape[0]  # padded rows: zeros
        full = torch.empty(rows, *param.shape[1:]).normal_(0.0, std, generator=generator)
        full = vocab.pad_rows(full, param.shape[0]) if rows != param.shape[0] else full
        return full[local_slices(param)]

    for name, param in model.named_parameters():
        name = canonical_name(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        if name in quantized:
            continue
        if name.endswith("norm.weight"):
            local.fill_(norm_value)
        elif name.endswith(".bias"):
            local.zero_()
        else:
            local.copy_(draw(name, param))
    for layer in qlora.by_layer(quantized):  # NF4 base weights: quantized from their draws
        qlora.quantize_all(model, {name: draw(name, param).to(param.dtype) for name, param in layer.items()})
