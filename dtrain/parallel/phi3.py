"""Phi-3 / Phi-4 (`phi3`): the fused `qkv_proj` and `gate_up_proj` are split into Llama's
q/k/v_proj and gate/up_proj when the meta model is built (dtrain/parallel/fused.py), so Llama's
TP table shards each part by its own heads; HF's fused names are restored on load and export."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb, eager_attention_forward

from dtrain.parallel import llama
from dtrain.parallel.fused import FUSED_ATTR, split_linear

model_plan = llama.model_plan
layer_plan = llama.layer_plan


def split_fused_projections(model: nn.Module) -> None:
    """On the meta model: every layer's fused projections become separate Linears."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    parts: dict[str, tuple[str, int]] = {}
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        qkv = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        parts |= split_linear(layer.self_attn, "qkv_proj", qkv, prefix + "self_attn.")
        gate_up = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
        parts |= split_linear(layer.mlp, "gate_up_proj", gate_up, prefix + "mlp.")
        layer.self_attn.forward = types.MethodType(_attention_forward, layer.self_attn)
        layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)
    setattr(model, FUSED_ATTR, parts)


def _attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Phi3Attention.forward` with q, k and v from their own projections (no cache: training)."""
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    output, weights = attend(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=getattr(self.config, "sliding_window", None),
        **kwargs,
    )
    output = output.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return self.o_proj(output), weights


def _mlp_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """`Phi3MLP.forward` with gate and up from their own projections."""
    return self.down_proj(self.up_proj(hidden_states) * self.activation_fn(self.gate_proj(hidden_states)))
