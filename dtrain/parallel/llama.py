"""Tensor-parallel plan for Hugging Face `LlamaForCausalLM`, named by HF module paths.

With sequence parallel, activations between blocks are sharded over the sequence (Shard(1)):
norms run on their sequence shard, attention and MLP all-gather it, and their row-parallel
outputs reduce-scatter back. The embedding is sharded over the vocabulary and `lm_head` keeps its
logits sharded over the vocabulary (Shard(-1)) for the loss-parallel cross-entropy.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from dtrain.parallel.styles import ReplicateParallel


def model_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for the modules outside the decoder layers, relative to the `LlamaForCausalLM`."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks),
        "lm_head": ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    plan["model.norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    return plan


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one `LlamaDecoderLayer`."""
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
    }
    if not sequence_parallel:
        plan |= {
            "input_layernorm": ReplicateParallel(),
            "post_attention_layernorm": ReplicateParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        return plan
    # The attention block also gets position_embeddings (cos, sin) as a kwarg: left as is.
    gather_sequence = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
    )
    plan |= {
        "input_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(),
        "self_attn": gather_sequence,
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    return plan
