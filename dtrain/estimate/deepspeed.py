"""DeepSpeed's layouts of the same model, analytic (nothing here runs DeepSpeed).

Model state from the ZeRO paper (Rajbhandari et al. 2020, section 5): Ψ parameters in mixed
precision keep 2Ψ bytes of 16-bit weights, 2Ψ of 16-bit gradients and KΨ of optimizer state
(K = 12 for Adam: fp32 master weights, momentum, variance); in fp32, 4Ψ + 4Ψ + 8Ψ. Over Nd
data-parallel ranks ZeRO-1 partitions the optimizer state, ZeRO-2 also the gradients, ZeRO-3
everything.

AutoTP (tensor parallel training with ZeRO-1/2) shards the attention and MLP linears over tp and
leaves the embedding, `lm_head` and the norms whole on every tp rank; ZeRO then partitions over dp =
world / tp only, and every rank computes the full-vocabulary logits. dtrain shards all of them over
(dp, tp) and keeps the logits sharded over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParamCensus:
    """Unsharded parameter counts, by how AutoTP treats them."""

    total: int
    embedding_and_head: int  # embed_tokens + lm_head (once if tied): replicated over tp by AutoTP
    other_replicated: int  # norms (1-D): replicated over tp by AutoTP
    vocab_size: int

    @property
    def tp_sharded(self) -> int:
        return self.total - self.embedding_and_head - self.other_replicated


def census(model: nn.Module) -> ParamCensus:
    """Count an unsharded (meta) HF causal LM's parameters; tied weights once."""
    head = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    total = embedding = replicated = 0
    for param in model.parameters():  # parameters() yields a tied weight once
        total += param.numel()
        if id(param) in head:
            embedding += param.numel()
        elif param.ndim < 2:
            replicated += param.numel()
    return ParamCensus(total, embedding, replicated, model.config.vocab_size)


@dataclass(frozen=True)
class Layout:
    """One DeepSpeed layout's per-rank bytes."""

    name: str
    tp: int
    dp: int
    model_state: int  # params + grads + optimizer state
    embedding_and_head: int  # their share of model_state
    logits: int  # lm_head's output on one rank


def _zero_state(params: float, stage: int, dp: int, bf16: bool) -> float:
    weight = grad = 2 if bf16 else 4
    k = 12 if bf16 else 8
    if stage == 1:
        return (weight + grad) * params + k * params / dp
    if stage == 2:
        return weight * params + (grad + k) * params / dp
    return (weight + grad + k) * params / dp


def layouts(
    census: ParamCensus, world_size: int, tp: int, micro_batch_size: int, max_len: int, precision: str
) -> list[Layout]:
    """ZeRO-1/2/3 over all ranks, and ZeRO-1/2 + AutoTP at the experiment's tp (when tp > 1)."""
    bf16 = precision == "bf16"
    logits_per_vocab = micro_batch_size * max_len * (2 if bf16 else 4)
    full_logits = logits_per_vocab * census.vocab_size  # lm_head whole on every rank
    out = [
        Layout(
            f"ZeRO-{stage}",
            1,
            world_size,
            round(_zero_state(census.total, stage, world_size, bf16)),
            round(_zero_state(census.embedding_and_head, stage, world_size, bf16)),
            full_logits,
        )
        for stage in (1, 2, 3)
    ]
    if tp > 1:
        dp = world_size // tp
        per_rank = census.tp_sharded / tp + census.embedding_and_head + census.other_replicated
        for stage in (1, 2):
            out.append(
                Layout(
                    f"ZeRO-{stage} + AutoTP",
                    tp,
                    dp,
                    round(_zero_state(per_rank, stage, dp, bf16)),
                    round(_zero_state(census.embedding_and_head, stage, dp, bf16)),
                    full_logits,
                )
            )
    return out
