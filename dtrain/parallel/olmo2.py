"""Tensor-parallel plan for Hugging Face `Olmo2ForCausalLM` and `Olmo3ForCausalLM`: Llama's table
with the norms after attention and MLP instead of before (no input_layernorm; the post-norms
act on the row-parallel outputs, still sharded over the sequence, before the residual add), and
q/k norms over the whole projected width, whose statistics are all-reduced over tp
(WidthShardedNorm). OLMo 3's sliding-window layers are dtrain's attention function's."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dtrain.parallel import llama
from dtrain.parallel.styles import ReplicateParallel, WidthShardedNorm

model_plan = llama.model_plan


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one `Olmo2DecoderLayer` (or `Olmo3DecoderLayer`)."""
    plan = llama.layer_plan(sequence_parallel)
    del plan["input_layernorm"]
    plan |= {"self_attn.q_norm": WidthShardedNorm(), "self_attn.k_norm": WidthShardedNorm()}
    if not sequence_parallel:
        return plan | {
            "post_attention_layernorm": ReplicateParallel(),
            "post_feedforward_layernorm": ReplicateParallel(),
        }
    # The post-norms' outputs meet the residual stream, a plain tensor: hand them back local.
    return plan | {
        "post_attention_layernorm": SequenceParallel(use_local_output=True),
        "post_feedforward_layernorm": SequenceParallel(use_local_output=True),
    }
