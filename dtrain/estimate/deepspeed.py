"""DeepSpeed's layouts of the same model, analytic (nothing here runs or imports DeepSpeed).

Each layout is the list of buffers DeepSpeed 0.19 (read from 0.19.8's source) allocates per rank,
each named by the file and attribute it comes from, and when it appears:
- `init`: allocated by `deepspeed.initialize` (the optimizer wrapper's constructor);
- `backward`: gradients alive at the end of a backward, until the optimizer step;
- `first step`: Adam's `exp_avg` and `exp_avg_sq`, created by the wrapped optimizer's first
  `step()` (torch's AdamW and DeepSpeed's FusedAdam both create their state lazily) and kept;
- `step`: a temporary of the optimizer step (the fp32 gradient partition it hands Adam).

The optimizer wrapper is the one `DeepSpeedEngine._do_optimizer_sanity_check` (runtime/engine.py)
picks: with bf16, ZeRO stage 1 and `data_types.grad_accum_dtype=fp32` it is `BF16_Optimizer`
(runtime/bf16_optimizer.py), the class in the motivating run's log; otherwise stage 1 and 2 take
`DeepSpeedZeroOptimizer` (runtime/zero/stage_1_and_2.py) and stage 3 `DeepSpeedZeroOptimizer_Stage3`
(runtime/zero/stage3.py). With the default `grad_accum_dtype` (None: the model's dtype), bf16
ZeRO-1 also takes DeepSpeedZeroOptimizer; that layout is ZeRO-2's with unpartitioned gradients.

AutoTP (tensor parallel training with ZeRO) shards the attention and MLP linears over tp and leaves
the embedding, `lm_head` and the norms whole on every tp rank; ZeRO then partitions over dp =
world / tp only. Every rank computes the full-vocabulary logits, and transformers' loss
(`loss/loss_utils.py: ForCausalLMLoss`) upcasts them to fp32 before the cross-entropy, whose
log-softmax (fp32) is saved for backward. dtrain shards all of them over (dp, tp) and keeps the
logits sharded over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

BF16_OPT = "runtime/bf16_optimizer.py: BF16_Optimizer"
ZERO12 = "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer"
ZERO3 = "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3"
REDUCE_BUCKET_SIZE = 500_000_000  # runtime/zero/config.py: reduce_bucket_size's default, in elements
KEPT = ("init", "backward", "first step")  # what a rank holds at the end of a backward after step 1


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

    def local(self, tp: int) -> int:
        """Parameters on one rank under AutoTP at `tp` (tp = 1: all of them)."""
        return self.tp_sharded // tp + self.embedding_and_head + self.other_replicated


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
class Buffer:
    """One DeepSpeed buffer on one rank."""

    what: str
    source: str  # DeepSpeed (or transformers) file and attribute
    when: str  # init | backward | first step | step | loss
    bytes: int


@dataclass(frozen=True)
class Layout:
    """One DeepSpeed layout's per-rank buffers (model state) and full-vocabulary logits."""

    name: str
    tp: int
    dp: int
    local_params: int  # parameters on this rank before ZeRO partitions them over dp
    buffers: tuple[Buffer, ...]
    logits: tuple[Buffer, ...]  # lm_head's output and the loss's temporaries, one micro-batch
    head_share: float  # the embedding and lm_head's fraction of local_params

    def total(self, when: tuple[str, ...]) -> int:
        return sum(b.bytes for b in self.buffers if b.when in when)

    @property
    def before_first_step(self) -> int:
        """What deepspeed.initialize allocates: the model state until the first backward."""
        return self.total(("init",))

    @property
    def model_state(self) -> int:
        """After the first step, at the end of a backward: buffers, gradients and Adam's states."""
        return self.total(KEPT)

    @property
    def embedding_and_head(self) -> int:
        return round(self.model_state * self.head_share)  # every buffer is per parameter

    @property
    def logits_and_loss(self) -> int:
        return sum(b.bytes for b in self.logits)


def _buffers(stage: int, n: int, dp: int, bf16: bool) -> list[Buffer]:
    """Per-rank buffers of ZeRO `stage` for `n` local parameters partitioned over `dp` ranks."""
    weight = 2 if bf16 else 4  # the model's dtype
    part = -(-n // dp)  # ZeRO pads the flat buffer to a multiple of dp
    bucket = weight * REDUCE_BUCKET_SIZE
    adam = Buffer(
        "Adam exp_avg + exp_avg_sq (fp32)", "optimizer.state[fp32 partition]", "first step", 8 * part
    )
    if stage == 1 and bf16:
        return [
            Buffer("bf16 weights, flat", f"{BF16_OPT}.bf16_groups_flat", "init", 2 * n),
            Buffer("fp32 master, dp partition", f"{BF16_OPT}.fp32_groups_flat_partition", "init", 4 * part),
            Buffer("fp32 gradients, all local", f"{BF16_OPT}.fp32_groups_gradients_flat", "init", 4 * n),
            Buffer("bf16 gradients", "param.grad (immediate_grad_update: one at a time)", "backward", 2 * n),
            adam,
        ]
    if stage in (1, 2):
        # fp32: the master is a copy all the same (.clone() of the partition), and the step's
        # .to(fp32) of an fp32 gradient partition is the tensor itself.
        grads = Buffer("gradients", "param.grad", "backward", weight * n)
        if stage == 2:  # partition_grads
            grads = Buffer("gradient partition", f"{ZERO12}.grads_in_partition", "backward", weight * part)
        step = Buffer(
            "fp32 gradient partition", f"{ZERO12}.single_partition_of_fp32_groups[i].grad", "step", 4 * part
        )
        return [
            Buffer("weights, flat", f"{ZERO12}.bit16_groups_flat", "init", weight * n),
            Buffer(
                "fp32 master, dp partition", f"{ZERO12}.single_partition_of_fp32_groups", "init", 4 * part
            ),
            Buffer("reduce bucket", f"{ZERO12}.ipg_buckets[dtype].buffer", "backward", bucket),
            grads,
            adam,
            *([step] if bf16 else []),
        ]
    # fp32: the weights' partition is already the master's dtype; stage3.py keeps no second copy
    master = Buffer("fp32 master, dp partition", f"{ZERO3}.fp32_partitioned_groups_flat", "init", 4 * part)
    step = Buffer(
        "fp32 gradient partition", f"{ZERO3}.fp32_partitioned_groups_flat[i].grad", "step", 4 * part
    )
    return [
        Buffer("weights, dp partition", f"{ZERO3}.fp16_partitioned_groups_flat", "init", weight * part),
        *([master] if bf16 else []),
        Buffer("reduce bucket", f"{ZERO3}.ipg_buckets[dtype].buffer", "init", bucket),
        Buffer("gradient partition", f"{ZERO3}.grad_partitions_flat_buffer", "init", weight * part),
        adam,
        *([step] if bf16 else []),
    ]


def _logits(rows: int, vocab: int, bf16: bool) -> tuple[Buffer, ...]:
    """Full-vocabulary logits of one micro-batch of `rows` tokens, and the loss's fp32 temporaries."""
    elements = rows * vocab
    head = "transformers modeling_llama.py: LlamaForCausalLM.forward lm_head(hidden_states)"
    upcast = "transformers loss/loss_utils.py: ForCausalLMLoss logits.float()"
    out = [Buffer("logits", head, "loss", (2 if bf16 else 4) * elements)]
    if bf16:  # .float() of an fp32 tensor is the tensor itself
        out.append(Buffer("fp32 logits", upcast, "loss", 4 * elements))
    out.append(Buffer("log-softmax (fp32, saved for backward)", "torch cross_entropy", "loss", 4 * elements))
    return tuple(out)


def layout(
    name: str, stage: int, census: ParamCensus, tp: int, dp: int, rows: int, bf16: bool, sharded: bool = True
) -> Layout:
    """ZeRO `stage` over `dp` ranks of the parameters AutoTP leaves on one rank at `tp` (all of
    them when AutoTP did not shard: `sharded` false)."""
    local = census.local(tp if sharded else 1)
    return Layout(
        name,
        tp,
        dp,
        local,
        tuple(_buffers(stage, local, dp, bf16)),
        _logits(rows, census.vocab_size, bf16),
        census.embedding_and_head / local,
    )


def layouts(
    census: ParamCensus, world_size: int, tp: int, micro_batch_size: int, max_len: int, precision: str
) -> list[Layout]:
    """ZeRO-1/2/3 over all ranks; with tp > 1 also ZeRO-1/2/3 + AutoTP at the experiment's tp, and
    ZeRO-1 with a tp group of that size whose AutoTP sharded nothing (every rank the whole model,
    dp = world / tp): the layout the motivating run's log matches (docs/estimate.md)."""
    bf16, rows = precision == "bf16", micro_batch_size * max_len
    out = [layout(f"ZeRO-{stage}", stage, census, 1, world_size, rows, bf16) for stage in (1, 2, 3)]
    if tp > 1:
        dp = world_size // tp
        out += [layout(f"ZeRO-{stage} + AutoTP", stage, census, tp, dp, rows, bf16) for stage in (1, 2, 3)]
        out.append(layout("ZeRO-1, AutoTP unsharded", 1, census, tp, dp, rows, bf16, sharded=False))
    return out
