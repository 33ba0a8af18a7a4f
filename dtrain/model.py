"""Build the HF model on the meta device, then fill each rank's shards: HF safetensors slices read
straight into the sharded parameters, or a seeded init that is the same on every mesh."""

from __future__ import annotations

import functools
import os
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key
from transformers.modeling_utils import AttentionInterface

from dtrain.config import ConfigError, ModelConfig
from dtrain.parallel import fused, phi3, vocab
from dtrain.parallel.context import CONTEXT_KWARG, ContextShard, document_ids

ATTENTION = "dtrain_causal"
# Copies of the config.json of the hub models conf/model/ names, so the planner works offline.
ARCHITECTURES = Path(__file__).parent / "assets" / "architectures"
# transformers' renamings of the family's checkpoint keys, set on the meta model by build_meta_model.
CHECKPOINT_TRANSFORMS = "dtrain_checkpoint_transforms"
# What activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the full (gathered) sequence. HF would build its mask from the local,
    sequence-sharded length, so it builds none (see the registration below); padding is on the right.
    Packed rows restart `position_ids` (full length: HF forwards them to here) at every document:
    then the mask is block-diagonal causal, so no token attends across documents. A sliding-window
    layer (HF passes `sliding_window`) sees only its last `sliding_window` keys, itself included, as
    HF's `sliding_window_overlay`; a window that covers the sequence is plain causal. On CUDA packed
    rows and windows go through flex attention with a block mask (only the blocks that hold an
    allowed pair are computed); elsewhere through sdpa with a dense mask. Both compute the same
    function."""
    check_supported(module)
    context = kwargs.get(CONTEXT_KWARG)  # context parallel: this rank holds a part of each row
    if context is not None:
        return context_attention(query, key, value, context, dropout, scaling, kwargs.get("sliding_window"))
    window = effective_window(kwargs.get("sliding_window"), query.shape[-2])
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    packed = getattr(module.config, PACKED_ROWS, False)
    if (packed or window) and packed_attention_backend(query.device) == "flex":
        if dropout:
            raise ValueError(
                f"attention dropout {dropout}: flex attention (packed rows or windows on CUDA) has none"
            )
        block_mask = kwargs.get(SLIDING_BLOCK_MASK_KWARG if window else BLOCK_MASK_KWARG)
        if block_mask is None:
            block_mask = sliding_block_mask(position_ids, window, packed) if window else None
        out = flex_document_attention(query, key, value, position_ids, scaling, gqa, block_mask)
    else:
        mask = dense_mask(position_ids, packed, window) if packed or window else None
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=gqa,
        )
    return out.transpose(1, 2).contiguous(), None


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: ContextShard,
    dropout: float,
    scale: float | None,
    window: int | None,
) -> tuple[torch.Tensor, None]:
    """Context parallel: this rank's queries against the whole row's keys and values, gathered over
    cp, under the causal, document and window mask of the global token indices (parallel/context.py)."""
    key, value = context.gather(key), context.gather(value)
    window = effective_window(window, key.shape[-2])
    gqa = query.shape[1] != key.shape[1]
    if packed_attention_backend(query.device) == "flex":
        if dropout:
            raise ValueError(
                f"attention dropout {dropout}: flex attention (context parallel on CUDA) has none"
            )
        out = flex_attention_call(query, key, value, context.block_mask(window), scale, gqa)
    else:
        mask = context.mask(window)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


def check_supported(module: nn.Module) -> None:
    """What dtrain does not compute must stop the run, not silently change the model. Checked here,
    the one place every model passes at any tp: bidirectional attention, attention softcapping, and
    final-logit softcapping, which the chunked loss (parallel.loss_chunk) would apply to the hidden
    states instead of the logits."""
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__}: bidirectional attention; dtrain trains causal LMs only")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(module.config, key, None) is not None:
            raise ValueError(
                f"{key}={getattr(module.config, key)}: dtrain has no softcapping; set it to null"
            )


def effective_window(window: int | None, seq: int) -> int | None:
    """The sliding window, or None where it covers all `seq` positions (then it is plain causal)."""
    return window if window is not None and window < seq else None


def config_window(config: PretrainedConfig, seq: int) -> int | None:
    """The window the sliding layers of this config use on rows of `seq` (Mistral, Qwen2 with
    use_sliding_window, Gemma 3's local layers: all pass config.sliding_window), or None."""
    return effective_window(getattr(config, "sliding_window", None), seq)


def packed_attention_backend(device: torch.device) -> str:
    """flex on CUDA (compiled Triton kernels, block-sparse); sdpa with a dense [seq, seq] mask on any
    other device (flex has no backward on CPU)."""
    return "flex" if device.type == "cuda" else "sdpa"


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean (True: may attend): causal within each document. A dense mask is
    what sdpa takes on any device."""
    return dense_mask(position_ids, packed=True, window=None)


def dense_mask(position_ids: torch.Tensor, packed: bool, window: int | None) -> torch.Tensor:
    """[batch or 1, 1, seq, seq] boolean (True: may attend): causal, within each document when
    `packed`, and within the last `window` positions (query included) when a window is given. The
    window counts row indices, which within a document are its positions."""
    seq = position_ids.shape[-1]
    index = torch.arange(seq, device=position_ids.device)
    distance = index[:, None] - index[None, :]  # query - key
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    if not packed:
        return allowed[None, None]
    documents = document_ids(position_ids)
    same = documents[:, :, None] == documents[:, None, :]
    return (same & allowed)[:, None]


# The model-level forward kwarg that carries the BlockMask: HF passes unknown forward kwargs down to
# every layer's attention function, so the mask is built once per forward, outside compiled layers.
BLOCK_MASK_KWARG = "dtrain_block_mask"


# The same for the sliding-window layers' BlockMask (layers of one model may differ: Gemma 3).
SLIDING_BLOCK_MASK_KWARG = "dtrain_sliding_block_mask"


def document_block_mask(position_ids: torch.Tensor) -> Any:
    """flex attention's BlockMask for causal attention within each document of each row."""
    return _block_mask(position_ids, packed=True, window=None)


def sliding_block_mask(position_ids: torch.Tensor, window: int, packed: bool) -> Any:
    """flex attention's BlockMask of dense_mask(position_ids, packed, window)."""
    return _block_mask(position_ids, packed, window)


def _block_mask(position_ids: torch.Tensor, packed: bool, window: int | None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    documents = document_ids(position_ids)

    def allowed(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if packed:
            keep = keep & (documents[b, q_idx] == documents[b, kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    batch, seq = position_ids.shape
    return create_block_mask(allowed, batch if packed else None, None, seq, seq, device=position_ids.device)


def _attach_block_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a packed or sliding-window model: build this batch's flex BlockMasks once."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or packed_attention_backend(position_ids.device) != "flex":
        return args, kwargs
    packed = getattr(module.config, PACKED_ROWS, False)
    if packed:
        kwargs[BLOCK_MASK_KWARG] = document_block_mask(position_ids)
    window = config_window(module.config, position_ids.shape[-1])
    if window is not None:
        kwargs[SLIDING_BLOCK_MASK_KWARG] = sliding_block_mask(position_ids, window, packed)
    return args, kwargs


@functools.cache
def _compiled_flex_attention() -> Any:
    """Flex attention is only fast compiled (eager, it is a reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor,
    scale: float | None,
    gqa: bool,
    block_mask: Any = None,
) -> torch.Tensor:
    """[batch, heads, seq, head_dim] attention within documents, as sdpa with document_mask gives."""
    if block_mask is None:
        block_mask = document_block_mask(position_ids)
    return flex_attention_call(query, key, value, block_mask, scale, gqa)


def flex_attention_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: Any,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Compiled on CUDA (inside a compiled layer, dynamo compiles the call itself); eager elsewhere
    (forward only: how the CPU tests compare it with sdpa)."""
    from torch.nn.attention.flex_attention import flex_attention

    eager_call = query.is_cuda and not torch.compiler.is_compiling()
    attend = _compiled_flex_attention() if eager_call else flex_attention
    return attend(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


# No mask function is registered for ATTENTION: HF then skips mask creation altogether (its path for
# custom attention), including the scan of position_ids for packed rows, which reads a device value
# on the host in every forward.
AttentionInterface.register(ATTENTION, causal_attention)


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


PACKED_ROWS = "dtrain_packed_rows"  # a config attribute: rows may hold several documents
# Model types whose fused projections are split into one module per part (dtrain/parallel/fused.py).
SPLIT_FUSED = {"phi3": phi3.split_fused_projections}


def build_meta_model(
    config: PretrainedConfig, packed: bool = False, vocab_rows: int | None = None
) -> nn.Module:
    """The model on the meta device. `packed` (data.packing) turns on the document mask: a setting,
    not a test of each batch, so no step waits on the device to decide it. `vocab_rows`
    (vocab.padded_vocab_size) pads the embedding and lm_head for a tp that vocab_size is not a
    multiple of."""
    config._attn_implementation = ATTENTION
    config.use_cache = False
    setattr(config, PACKED_ROWS, packed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION, dtype=torch.float32)
    # Looked up by class name, which fully_shard changes: kept from the plain HF class.
    setattr(model, CHECKPOINT_TRANSFORMS, get_model_conversion_mapping(model))
    if config.model_type in SPLIT_FUSED:
        SPLIT_FUSED[config.model_type](model)
    vocab.pad_vocab(model, vocab_rows or config.vocab_size)
    if packed or getattr(config, "sliding_window", None) is not None:
        model.register_forward_pre_hook(_attach_block_mask, with_kwargs=True)
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of decoder layers of any HF causal LM: the ModuleList of the layer class the model
    declares unsplittable (`_no_split_modules`). What checkpointing, compile and FSDP wrap one by one."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in layer_classes:
            return module
    raise ConfigError(
        f"model type {model.config.model_type!r}: no stack of decoder layers "
        f"({', '.join(sorted(layer_classes)) or 'no _no_split_modules'}) found in {type(model).__name__}"
    )


def materialize(model: nn.Module, device: torch.device, settings: ModelConfig, seed: int) -> None:
    """Allocate this rank's shards on `device` and fill them."""
    model.to_empty(device=device)
    reset_rotary_buffers(model, device)
    if resolve_init(settings) == "pretrained":
        assert settings.name_or_path
        load_hf_weights(model, resolve_model_path(settings.name_or_path))
    else:
        init_weights(model, seed)


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
    """The model's state dict under HF names, without the tied lm_head (HF files omit it)."""
    state = {canonical_name(k): v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def file_keys(model: nn.Module, files: list[Path], state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{parameter name: its key in the safetensors files}, by transformers' own renamings of the
    family's checkpoints (GPT-NeoX's `embed_out` is the model's `lm_head`, a base model's files
    lack the `model.` prefix, checked against `state`, hf_state_dict's names); keys that need more
    than a rename are refused, not misread."""
    transforms = getattr(model, CHECKPOINT_TRANSFORMS)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = {}
    for file in files:
        with safe_open(file, "pt") as reader:
            for key in reader.keys():
                name, converter = rename_source_key(
                    key, renamings, converters, model.base_model_prefix, state
                )
                if converter is not None:
                    raise ConfigError(
                        f"{file}: {key} needs transformers' weight conversion {converter!r} "
                        f"(model_type={model.config.model_type!r}), which dtrain does not do"
                    )
                names[name] = key
    return names


def load_hf_weights(model: nn.Module, folder: str) -> None:
    """Each rank reads only its slices of the safetensors files (DCP's HF reader does the planning)."""
    files = list(Path(folder).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.name_or_path={folder!r}: no *.safetensors files to load")
    state = hf_state_dict(model)
    keys = file_keys(model, files, state)
    state = {keys.get(name, name): tensor for name, tensor in state.items()}
    # Padded vocabulary matrices have more rows than the files: read by hand, the rest by DCP.
    padded = {name: state.pop(name) for name in vocab.padded_params(model) if name in state}
    fused.load_parts(model, state, files)  # split fused projections: their rows of HF's tensors
    dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
    vocab.load_padded_rows(padded, files, model.config.vocab_size)


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
    for name, param in model.named_parameters():
        name = canonical_name(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        if name.endswith("norm.weight"):
            local.fill_(norm_value)
            continue
        if name.endswith(".bias"):
            local.zero_()
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        rows = model.config.vocab_size if id(param) in padded else param.shape[0]  # padded rows: zeros
        full = torch.empty(rows, *param.shape[1:]).normal_(0.0, std, generator=generator)
        full = vocab.pad_rows(full, param.shape[0]) if rows != param.shape[0] else full
        local.copy_(full[local_slices(param)])
