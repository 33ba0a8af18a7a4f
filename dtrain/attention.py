"""dtrain's attention function, registered with transformers as `dtrain_causal`: causal attention on
full-length `position_ids` (HF would build its mask from the local, sequence-sharded length), with the
document mask of packed rows, sliding windows, attention sinks (GPT-OSS), and context parallel's
gathered keys and values.

Two kernels compute the same function: flex attention with a block mask (CUDA: only the blocks that
hold an allowed pair are computed) and sdpa with a dense mask (any device). Which one a model takes is
a setting made when it is built (`configure`), never a guess inside the step.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig
from transformers.modeling_utils import AttentionInterface

from dtrain.parallel.context import CONTEXT_KWARG, ContextShard, document_ids

ATTENTION = "dtrain_causal"
# Config attributes set by `configure`: rows may hold several documents (data.packing), and which
# kernel packed rows, windows and context parallel take.
PACKED_ROWS = "dtrain_packed_rows"
BACKEND = "dtrain_attention_backend"
# auto: flex on CUDA, sdpa elsewhere (flex has no backward on CPU); flex or sdpa on any device (the
# planner plans CUDA's kernel; the CPU tests compare the two).
BACKENDS = ("auto", "flex", "sdpa")
# What `configure` adds to a model's config: exported configs drop them.
CONFIG_KEYS = (PACKED_ROWS, BACKEND)


def configure(config: PretrainedConfig, packed: bool, backend: str = "auto") -> None:
    """Make `config` build models that attend through dtrain's function, with this kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: must be one of {', '.join(BACKENDS)}")
    config._attn_implementation = ATTENTION
    setattr(config, PACKED_ROWS, packed)
    setattr(config, BACKEND, backend)


def set_backend(model: nn.Module, backend: str) -> None:
    """Switch a built model's kernel (the tests run one model through both)."""
    configure(model.config, getattr(model.config, PACKED_ROWS, False), backend)


def attach_block_masks(model: nn.Module) -> None:
    """Packed or windowed models build their flex block masks once per forward, not once per layer."""
    if getattr(model.config, PACKED_ROWS, False) or getattr(model.config, "sliding_window", None) is not None:
        model.register_forward_pre_hook(_attach_block_mask, with_kwargs=True)


def backend_for(config: PretrainedConfig, device: torch.device) -> str:
    """The kernel this model's packed rows, windows and context parallel run on `device`."""
    chosen = getattr(config, BACKEND, "auto")
    if chosen != "auto":
        return chosen
    return "flex" if device.type == "cuda" else "sdpa"


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
    function. Attention sinks (GPT-OSS passes `s_aux`, one logit per head): see `sdpa_attention` and
    `flex_attention_call`; with sinks every layer takes the chosen kernel, plain causal ones too."""
    check_supported(module)
    sinks = kwargs.get("s_aux")
    if isinstance(sinks, DTensor):  # tp > 1: this rank's heads (Shard(0), as its q heads)
        sinks = sinks.to_local()
    context = kwargs.get(CONTEXT_KWARG)  # context parallel: this rank holds a part of each row
    if context is not None:
        window = kwargs.get("sliding_window")
        flex = backend_for(module.config, query.device) == "flex"
        return context_attention(query, key, value, context, dropout, scaling, window, flex, sinks)
    window = effective_window(kwargs.get("sliding_window"), query.shape[-2])
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    packed = getattr(module.config, PACKED_ROWS, False)
    masked = packed or window or sinks is not None
    if masked and backend_for(module.config, query.device) == "flex":
        if dropout:
            raise ValueError(
                f"attention dropout {dropout}: flex attention (packed rows, windows, sinks on CUDA) has none"
            )
        block_mask = kwargs.get(SLIDING_BLOCK_MASK_KWARG if window else BLOCK_MASK_KWARG)
        if block_mask is None:
            block_mask = sliding_block_mask(position_ids, window, packed) if window else None
        out = flex_document_attention(query, key, value, position_ids, scaling, gqa, block_mask, sinks)
    else:
        mask = dense_mask(position_ids, packed, window) if masked else None
        out = sdpa_attention(query, key, value, mask, dropout, scaling, gqa, sinks)
    return out.transpose(1, 2).contiguous(), None


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scale: float | None,
    gqa: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """sdpa under a boolean `mask` (None: causal). With `sinks` ([heads]), HF's eager attention sinks:
    the softmax runs over each query's scores and its head's sink logit, and the sink's share is
    dropped. Here: one more key whose key and value are zero, so its score is 0 and adds nothing to
    the output, with the additive mask value of that column the head's sink."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
    key, value = F.pad(key, (0, 0, 0, 1)), F.pad(value, (0, 0, 0, 1))  # one zero key and value per head
    batch, heads, queries = mask.shape[0], query.shape[1], query.shape[2]
    scores_mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, float("-inf")
    )
    sink_column = sinks.to(query.dtype)[None, :, None, None].expand(batch, heads, queries, 1)
    additive = torch.cat([scores_mask.expand(batch, heads, queries, -1), sink_column], dim=-1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=additive, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: ContextShard,
    dropout: float,
    scale: float | None,
    window: int | None,
    flex: bool,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """Context parallel: this rank's queries against the whole row's keys and values, gathered over
    cp, under the causal, document and window mask of the global token indices (parallel/context.py)."""
    key, value = context.gather(key), context.gather(value)
    window = effective_window(window, key.shape[-2])
    gqa = query.shape[1] != key.shape[1]
    if flex:
        if dropout:
            raise ValueError(
                f"attention dropout {dropout}: flex attention (context parallel on CUDA) has none"
            )
        out = flex_attention_call(query, key, value, context.block_mask(window), scale, gqa, sinks)
    else:
        out = sdpa_attention(query, key, value, context.mask(window), dropout, scale, gqa, sinks)
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
    if position_ids is None or backend_for(module.config, position_ids.device) != "flex":
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[batch, heads, seq, head_dim] attention within documents, as sdpa with document_mask gives."""
    if block_mask is None:
        block_mask = document_block_mask(position_ids)
    return flex_attention_call(query, key, value, block_mask, scale, gqa, sinks)


def flex_attention_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: Any,
    scale: float | None,
    gqa: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compiled on CUDA (inside a compiled layer, dynamo compiles the call itself); elsewhere torch's
    eager reference implementation, forward and backward (the CPU tests compare it with sdpa; the
    planner runs CUDA's kernel on fake CPU tensors through it). With `sinks` ([heads]: HF's eager
    attention sinks) the output is rescaled by the share the scores keep next to the sink logit:
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), lse each query's logsumexp of its
    scores (its gradient flows through lse)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if torch.compiler.is_compiling():
        attend = flex_attention
    elif query.is_cuda:
        attend = _compiled_flex_attention()
    else:
        out, lse = _reference_flex_attention(query, key, value, block_mask, scale)
        return out if sinks is None else _sink_rescaled(out, lse, sinks)
    if sinks is None:
        return attend(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, aux = attend(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return _sink_rescaled(out, aux.lse, sinks)


def _sink_rescaled(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [batch, heads, seq, dim] · sigmoid(lse [batch, heads, seq] - the head's sink)."""
    share = torch.sigmoid(lse.float() - sinks.float()[None, :, None])
    return out * share[..., None].to(out.dtype)


def _no_score_mod(score: torch.Tensor, batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    return score


def _reference_flex_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scale: float | None
) -> torch.Tensor:
    """torch's flex attention operator called directly, as `flex_attention` calls it uncompiled, minus
    that function's refusal of a backward on CPU: the operator has one (its eager implementation; on
    fake tensors, the outputs and gradients CUDA's kernels allocate: no scores matrix). It takes
    grouped-query heads as they come. Returns the output and each query's logsumexp (natural log:
    the operator's is base 2, which `flex_attention` converts as here)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_operator

    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse, _ = flex_operator(query, key, value, _no_score_mod, block_mask.as_tuple(), scale, {})
    return out, lse * math.log(2.0)


# No mask function is registered for ATTENTION: HF then skips mask creation altogether (its path for
# custom attention), including the scan of position_ids for packed rows, which reads a device value
# on the host in every forward.
AttentionInterface.register(ATTENTION, causal_attention)
