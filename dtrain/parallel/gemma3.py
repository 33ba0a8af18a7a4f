"""Tensor-parallel plan for Hugging Face `Gemma3ForCausalLM` (`gemma3_text`): Llama's table with
four norms per layer (each sequence-parallel: post-attention and post-feedforward norms act on the
row-parallel outputs, still sharded over the sequence, before the residual add) and Qwen3's
per-head q/k norms, which Gemma 3 applies after moving the heads to dim 1.

The scaled embedding (`embed_scale` times the rows) is vocab-sharded as the plain one: the scale
multiplies the embedding's partial sums, which the reduce-scatter then adds. The tied head and
the local sliding-window layers need nothing here: ties are restored after TP, and the window is
dtrain's attention function's (attention.py). Both rotary bases are buffers (model.reset_rotary_buffers).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dtrain.parallel import llama
from dtrain.parallel.styles import HeadShardedNorm, ReplicateParallel

model_plan = llama.model_plan


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one `Gemma3DecoderLayer`."""
    plan = llama.layer_plan(sequence_parallel) | {
        "self_attn.q_norm": HeadShardedNorm(heads_dim=-3),
        "self_attn.k_norm": HeadShardedNorm(heads_dim=-3),
    }
    if not sequence_parallel:
        return plan | {
            "pre_feedforward_layernorm": ReplicateParallel(),
            "post_feedforward_layernorm": ReplicateParallel(),
        }
    # The post-norms' outputs meet the residual stream, a plain tensor: hand them back local.
    return plan | {
        "pre_feedforward_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(use_local_output=True),
        "post_feedforward_layernorm": SequenceParallel(use_local_output=True),
    }
