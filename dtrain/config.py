"""The config schema: one dataclass per Hydra group. Hydra rejects unknown keys and wrong types
against these dataclasses; dtrain/checks.py adds the cross-checks that need the world size and the
model's architecture, before any process group exists.

A field's docstring (the string on the line after it) is its documentation: `python
tools/config_docs.py` writes docs/config.md from them (tests/test_config_docs.py checks it is current).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


# What makes two configs the same run (its folder's name, dtrain.hydra_glue.run_name, and the check
# that a folder holds this run, dtrain.checkpoint.other_run_in): resuming may change the mesh, the
# step count, logging and checkpointing. LoRA is part of it: an adapter run is not a full fine-tune;
# so are DPO's, GRPO's and distillation's losses, and where GRPO's completions come from (rollout.engine,
# rollout.path).
RUN_IDENTITY = ("model", "data", "optim", "lora", "dpo", "grpo", "distill", "rollout.engine", "rollout.path")
RUN_IDENTITY += ("train.seed", "train.global_batch_size")


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Hub id or local Hugging Face folder (config.json, tokenizer, safetensors): the architecture, the
    tokenizer and the weights."""
    config: dict[str, Any] = field(default_factory=dict)
    """Overrides on top of name_or_path's config.json, added as `+model.config.KEY=VALUE` (without
    name_or_path: the whole architecture of a from-scratch model)."""
    init: str = "auto"
    """`auto`: `pretrained` when name_or_path has safetensors weights, else `random`; `pretrained`: load
    name_or_path's weights; `random`: a seeded init, identical on every mesh."""
    tokenizer: str | None = None
    """A tokenizer folder or hub id other than name_or_path's (unset: name_or_path's); it needs a chat
    template."""


@dataclass
class SourceConfig:
    """One dataset: where it is, which of its examples, and how its records read (the format and
    the columns it reads). data.* holds one (data.path ...); each data.mix entry is another."""

    path: str = "???"
    """Hub dataset id, or a local json/jsonl/parquet/csv/arrow file, or a folder of them (or
    `save_to_disk`'s)."""
    split: str = "train"
    """The split to train on; slicing works (`train[:1000]`)."""
    max_samples: int | None = None
    """The first N examples of the split."""
    format: str = "prompt_response"
    """How a record reads: `prompt_response` (one user turn, one assistant turn, optional system),
    `messages` (a list of {role, content}; loss on every assistant turn), `text` (loss on every
    token), `preference` (dtrain.dpo: a prompt, a chosen and a rejected completion, TRL's formats), or
    `prompt` (dtrain.grpo: a prompt alone, TRL's prompt-only format), or `prompt_completion`
    (dtrain.distill: a prompt and its completion, or a conversation whose last message is the
    completion): the names in `FORMATS`, dtrain/data/formats.py."""
    input_key: str = "prompt"
    """`prompt_response`, `preference`, `prompt` and `prompt_completion`: the record key of the prompt."""
    output_key: str = "response"
    """`prompt_response` and `prompt_completion`: the record key of the response (the completion)."""
    system_key: str | None = None
    """`prompt_response`: the record key of an optional system prompt."""
    messages_key: str = "messages"
    """`messages` (and `prompt_completion`, whose records may hold a conversation under it): the record
    key of the list of {role, content}."""
    text_key: str = "text"
    """`text`: the record key of the text."""
    chosen_key: str = "chosen"
    """`preference` (dtrain.dpo): the record key of the chosen completion (a string, or a list of
    {role, content}); its prompt is `input_key`'s, or with no such column the prefix chosen and
    rejected share (TRL's implicit prompt)."""
    rejected_key: str = "rejected"
    """`preference`: the record key of the rejected completion."""


@dataclass
class MixSource(SourceConfig):
    """A data.mix entry: a dataset and its share of the training stream. Each entry names its own
    path; the fields it leaves out take data.*'s values (an explicit `null` means null). An unknown
    key or a wrong type fails before launch, naming `data.mix[i].KEY`."""

    weight: float = 1.0
    """Share of the training stream: weight / sum of the weights."""


@dataclass
class Source(MixSource):
    """One dataset as the pipeline reads it, every field resolved (`DataConfig.sources()`)."""

    config_key: str = "data"  # where it is configured, for errors: data or data.mix[i]

    def key(self, name: str) -> str:
        """The config key of one of its fields: data.NAME or data.mix[i].NAME."""
        return f"{self.config_key}.{name}"

    @property
    def where(self) -> str:
        """How errors name it: `data.path='...'` or `data.mix[i].path='...'`."""
        return f"{self.key('path')}={self.path!r}"


@dataclass
class DataConfig(SourceConfig):
    mix: list[dict[str, Any]] = field(default_factory=list, metadata={"entries": MixSource})
    """Datasets mixed by weight, replacing data.path: `[{path: a.jsonl, weight: 3}, {path: org/b,
    split: train, input_key: q}]`; each entry's fields are MixSource's (below)."""
    max_len: int = 128
    """Token slots per row."""
    overlong: str = "truncate"
    """Examples over max_len tokens: `truncate` | `drop`."""
    packing: bool = False
    """Pack several examples per row (no attention across them)."""
    shuffle: bool = True
    """A seeded permutation of the rows every epoch."""
    num_proc: int = 1
    """Processes for tokenization (`datasets.map`)."""
    num_workers: int = 0
    """DataLoader worker processes building rows."""
    eval_split: str | None = None
    """A split of the same source(s) for `eval_loss` ..."""
    eval_fraction: float = 0.0
    """... or this fraction of each source held out (seeded)."""

    @property
    def preference(self) -> bool:
        """Whether the data are preference pairs (data.format=preference, dtrain.dpo's; never mixed
        with other formats: dtrain/checks.py)."""
        return all(source.format == "preference" for source in self.sources())

    @property
    def completions(self) -> bool:
        """Whether the data are prompts with completions (data.format=prompt_completion, dtrain.distill's)."""
        return all(source.format == "prompt_completion" for source in self.sources())

    def sources(self) -> list[Source]:
        """The datasets to read: data.*'s own source, or each data.mix entry merged onto data.*'s
        source fields (an unknown key or a wrong type raises a ConfigError naming data.mix[i].KEY)."""
        own = {f.name: getattr(self, f.name) for f in fields(SourceConfig)}
        if not self.mix:
            return [Source(**own)]
        resolved = []
        for i, entry in enumerate(self.mix):
            where = f"data.mix[{i}]"
            schema = OmegaConf.structured(MixSource(**{**own, "path": MISSING}))
            try:
                source = OmegaConf.to_object(OmegaConf.merge(schema, entry))
            except ConfigKeyError as error:
                raise ConfigError(
                    f"{where}.{error.key}: unknown key; an entry takes "
                    f"{', '.join(f.name for f in fields(MixSource))}"
                ) from None
            except MissingMandatoryValue as error:
                raise ConfigError(
                    f"{where}.{error.full_key}: missing (an entry names its own path, not data.path)"
                ) from None
            except OmegaConfBaseException as error:  # a wrong type, e.g. weight=abc
                raise ConfigError(f"{where}.{error.full_key}: {str(error).splitlines()[0]}") from None
            resolved.append(Source(**vars(source), config_key=where))
        return resolved


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree."""
    dp_shard: int = -1
    """FSDP degree; -1: the rest of the world, world / (tp × cp × dp_replicate)."""
    dp_replicate: int = 1
    """HSDP replicas: > 1 builds the mesh `(dp_replicate, dp_shard, tp)`; FSDP shards over `dp_shard`
    within each replica and all-reduces gradients across replicas; data and the loss split over all
    `dp_replicate × dp_shard` ranks."""
    cp: int = 1
    """Context parallel: each row's sequence split over `cp` ranks, K and V gathered in attention (mesh
    `(dp_replicate, dp_shard, cp, tp)`); FSDP shards over `dp_shard × cp`, the data over
    `dp_replicate × dp_shard`; `data.max_len` must divide by `2·cp` (× `tp` with sequence parallel)."""
    ep: int = 1
    """Expert parallel (mixture-of-experts families with stacked experts): each layer's experts split
    over `ep` ranks taken from the ranks FSDP shards over (`dp_shard × cp`, which `ep` must divide);
    tokens travel to their experts' ranks and back (all-to-all); expert weights are FSDP-sharded over
    the remaining `dp_shard × cp / ep` ranks (docs/moe.md)."""
    sequence_parallel: bool = True
    """Activations between blocks sharded over the sequence (over tp)."""
    loss_parallel: bool = True
    """Vocabulary-sharded logits into the cross-entropy."""
    loss_impl: str = "auto"
    """`auto`: `fused` where it is exact (a family with a TP plan, logits neither scaled nor
    softcapped), else `dense`, resolved before launch (config.yaml and the start line say which);
    `dense`: the model's whole (vocabulary-sharded) logits, then loss parallel's cross-entropy;
    `chunked`: `lm_head` + loss per chunk, each checkpointed (recomputed in backward); `fused`: head,
    loss and both gradients in one pass per chunk (`dtrain/fused_loss.py`), nothing recomputed, one
    chunk of logits alive. `chunked` and `fused` compute `lm_head(hidden)` themselves, so they take the
    families with a TP plan only, and not Granite's scaled logits."""
    loss_chunk: int = 256
    """`chunked` / `fused`: local sequence positions per chunk (≥ 1)."""
    activation_checkpointing: str = "none"
    """`none`; `full` (every decoder layer recomputed in backward); `selective` (op-level: matmul,
    attention and TP reduce-scatter outputs kept, the cheap ops recomputed)."""
    compile: bool = False
    """`torch.compile` each decoder layer (after activation checkpointing, before `fully_shard`)."""
    reshard_after_forward: str = "auto"
    """Free each layer's gathered parameters after forward: `auto` (every layer but the last, whose
    backward comes next), `always`, `never` (more memory, fewer all-gathers)."""
    fsdp_prefetch: int = 0
    """> 0: FSDP all-gathers this many layers ahead in forward and backward; 0: FSDP2's own
    prefetching."""
    timeout_s: int = 600
    """Collectives give up after this many seconds, so a dead rank cannot hang the others."""


@dataclass
class OptimConfig:
    """Fused AdamW over the DTensor parameters, with no weight decay on 1-D parameters (norms,
    biases)."""

    lr: float = 2e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (2-D parameters only)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's betas."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (over every mesh axis) to this; ≤ 0 logs the norm without
    clipping."""
    schedule: str = "cosine"
    """`constant`, `constant_with_warmup`, `linear` or `cosine` (transformers' schedules, over
    `train.max_steps`)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr` (the `constant` schedule has none)."""


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps of the run (unless `epochs` is set)."""
    epochs: float | None = None
    """Passes over the training rows (after packing), replacing `max_steps`: ceil(epochs × rows /
    global_batch_size) steps, known once the rows are built, before the first step; the schedule and
    the progress bar use them."""
    global_batch_size: int = 32
    """Sequences (rows) per optimizer step, over all dp ranks; accumulation = global / (micro × dp)."""
    micro_batch_size: int = 4
    """Sequences (rows) per forward and backward on one dp rank."""
    seed: int = 0
    """Seeds the init, the data order, the eval hold-out and the mix: the same on every mesh."""
    log_every: int = 1
    """Steps between logged lines (metrics.jsonl, console, W&B); the last step is always logged."""
    precision: str = "bf16"
    """`bf16`: bf16 compute, fp32 master weights and gradient reduction; `fp32`. conf/config.yaml makes
    the default bf16 on CUDA and fp32 on CPU, where bf16 is slow and inexact."""
    nonfinite: str = "skip"
    """A step with non-finite gradients: `skip` it (no optimizer or schedule step) or `abort` the run."""
    max_skips: int = 5
    """Abort when more than this many steps in a row were skipped."""
    eval_every: int = 0
    """Steps between `eval_loss` lines in metrics.jsonl; 0: no eval. Needs `data.eval_split` or
    `data.eval_fraction`."""
    sweep_on_failure: str = "continue"
    """`--multirun`: a job failed alike on every rank is recorded and the sweep goes on (`continue`),
    or the sweep stops there (`stop`)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N steps; 0: none by step count (see every_minutes)."""
    every_minutes: float = 30.0
    """Also save when this many minutes passed since the last save (rank 0's clock, agreed by all
    ranks at the step boundary); 0: none by time. With `every` = 0 this is the default periodic save."""
    dir: str | None = None
    """Where the `step-XXXXXXXX/` folders go (unset: `<run dir>/checkpoints`)."""
    resume: str = "auto"
    """`auto`: the newest complete checkpoint in `dir`, if any (rerunning a command resumes it);
    `never`: start over, removing the run folder's checkpoints, metrics.jsonl and W&B id (also the
    way to reuse a folder that holds a different run); or a checkpoint path."""
    keep: int = 2
    """Complete checkpoints kept (the oldest are removed)."""
    save_final: bool = True
    """Also save after the last step."""
    async_save: bool = False
    """Write with `dcp.async_save` (stage to CPU, write while the next steps run)."""
    export_hf: bool = False
    """Write a Hugging Face folder to `<run dir>/hf` at the end."""
    export_dtype: str = "bf16"
    """`bf16` or `fp32`: the dtype of export_hf's safetensors."""
    export_merged: bool = False
    """With LoRA: also write the base with the adapters merged in, a Hugging Face model folder at
    `<run dir>/hf-merged` (export_hf writes the PEFT adapter folder)."""


@dataclass
class LoraConfig:
    r: int = 0
    """Rank of the LoRA adapters; 0: LoRA off, every parameter trains (docs/lora.md)."""
    alpha: float = 8.0
    """PEFT's `lora_alpha`: the adapter's output is scaled by alpha / r (alpha / sqrt(r) with
    use_rslora)."""
    dropout: float = 0.0
    """PEFT's `lora_dropout`: dropout on the adapter's input (the tp ranks of a group drop alike)."""
    target_modules: list[str] = field(default_factory=list)
    """Names of the Linears of the decoder layers that get adapters (PEFT's rule: the module's name
    ends with one); empty: every linear projection of the decoder layers."""
    init: str = "default"
    """`default`: PEFT's init, A Kaiming-uniform and B zero; `gaussian`: A normal(0, 1/r), B zero."""
    use_rslora: bool = False
    """rsLoRA: scale by alpha / sqrt(r)."""
    base_dtype: str = "auto"
    """dtype of the frozen base's weights: `auto` (train.precision's), `bf16` (2 bytes a parameter,
    needs train.precision=bf16), `fp32`, or `nf4` (QLoRA: every adapted weight in bitsandbytes' NF4,
    about 0.52 bytes a parameter, dequantized for compute; the rest as `auto`; docs/lora.md). The
    adapters are fp32 always."""
    adapter: str | None = None
    """A PEFT adapter folder to continue from: r, alpha, dropout, target modules and rsLoRA come
    from its adapter_config.json (the keys above are ignored), its weights start the adapters."""


@dataclass
class MoeConfig:
    """Mixture-of-experts models whose config asks for the router's load-balancing loss
    (`output_router_logits: true`): which tokens HF's `aux_loss` is computed over (docs/moe.md)."""

    aux_scope: str = "micro_step"
    """`micro_step`: HF's aux loss over each micro-step's rows (stream rows [s·G + k·M, s·G + (k+1)·M)
    of step s, M = train.micro_batch_size × dp: the same rows on any mesh with the same M), its
    expert counts summed over every rank inside the step, no extra forward; the step's aux loss is
    the mean over its micro-steps. `global_batch`: HF's aux loss over the whole global batch in one
    forward, whose counts take a forward without gradients over the step first (about a third more
    compute)."""
    aux_mask_padding: bool = True
    """Leave the padding slots out of the aux loss and expert_load, as HF's `load_balancing_loss_func`
    does with the padding collator's attention mask; false: every slot counts (HF's model called
    without an attention mask)."""


@dataclass
class DPOConfig:
    """dtrain.dpo's loss and reference, named and defaulted after TRL 1.16's DPOConfig (docs/dpo.md
    maps every DPOConfig key)."""

    beta: float = 0.1
    """β: the reward of a completion is β · (its log-probability under the policy − under the
    reference); for `ipo` the regularization τ."""
    loss_type: Any = "sigmoid"
    """One of TRL's loss types, or a list of them added with loss_weights: `sigmoid` (DPO), `hinge`,
    `ipo`, `exo_pair`, `nca_pair`, `robust`, `bco_pair`, `sppo_hard`, `aot`, `aot_unpaired`,
    `apo_zero`, `apo_down`, `discopop`, `sft` (the NLL of the chosen completions: `[sigmoid, sft]` is
    RPO), `sigmoid_norm` (docs/dpo.md has each formula)."""
    loss_weights: list[float] | None = None
    """One weight per loss_type entry (unset: 1 each)."""
    label_smoothing: float = 0.0
    """ε of `robust` (the probability that a pair's labels are flipped, in [0, 0.5)), `exo_pair` (> 0;
    the paper suggests 1e-3), `aot` and `aot_unpaired`; the other losses do not use it (TRL 1.16's
    `sigmoid` ignores it), so it is refused without one of these."""
    ld_alpha: float | None = None
    """LD-DPO: a completion's tokens past the length of the pair's shorter completion count this much
    in its log-probability (policy and reference alike), in [0, 1]; unset: all count 1."""
    f_divergence_type: str = "reverse_kl"
    """f-DPO's divergence: `reverse_kl` (DPO's), `forward_kl`, `js_divergence`, `alpha_divergence`;
    another than reverse_kl only with `sigmoid`, `sigmoid_norm`, `hinge`, `ipo`, `exo_pair`,
    `robust`, `discopop` and `sft`."""
    f_alpha_divergence_coef: float = 0.5
    """α of `alpha_divergence` (refused with another f_divergence_type)."""
    use_weighting: bool = False
    """WPO: each pair's loss weighted by exp of its chosen and its rejected completion's mean over
    tokens of log p(token) − log Σ_v p(v)² under the policy (no gradient through the weight)."""
    discopop_tau: float = 0.05
    """τ of `discopop` (refused with another loss type)."""
    reference: str = "auto"
    """Where the reference log-probabilities come from: `precompute` (computed before the first step
    over every pair once and kept in the run folder: no reference model in memory while training);
    `live` (a frozen reference model, sharded like the policy, run beside it each step); `adapters_off`
    (LoRA: the policy with its adapters bypassed); `auto`: live with sync_ref_model, adapters_off for
    LoRA from fresh adapters without ref_model, else precompute."""
    ref_model: str | None = None
    """TRL's `ref_model`: the reference is this Hugging Face model folder (or hub id), e.g. an SFT
    checkpoint while the policy starts elsewhere, built frozen and sharded like the policy (the same
    vocabulary); unset: the starting policy."""
    sync_ref_model: bool = False
    """TR-DPO: every ref_model_sync_steps steps the reference becomes ref_model_mixup_alpha × policy +
    (1 − ref_model_mixup_alpha) × reference (dpo.reference=live; not with LoRA); saved in checkpoints."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's α, in [0, 1] (with sync_ref_model only)."""
    ref_model_sync_steps: int = 512
    """TR-DPO's τ: optimizer steps between syncs (with sync_ref_model only)."""


@dataclass
class SamplingConfig:
    """How an online objective samples its completions: the fields of dtrain.grpo's `grpo` group (and
    dtrain.distill's on-policy ones), named and defaulted as TRL 1.16's GRPOConfig; the rollout engine
    (dtrain/rollout/) samples with them."""

    num_generations: int = 8
    """G: completions sampled per prompt."""
    max_completion_length: int = 512
    """Tokens a completion may have; one stopped there without its EOS is truncated."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities trained on are computed from the logits divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities sum to at least this."""
    top_k: int = 0
    """Sample among the k most probable tokens; 0: all."""
    min_p: float | None = None
    """Drop tokens whose probability is below this times the most probable one's; unset: none."""
    repetition_penalty: float = 1.0
    """transformers' (and vLLM's) repetition penalty; 1: none."""


@dataclass
class DistillConfig(SamplingConfig):
    """dtrain.distill's loss and its on-policy sampling, named after TRL 1.16's DistillationTrainer and
    GKDTrainer (docs/distill.md); the sampling keys are dtrain.grpo's (SamplingConfig)."""

    teacher: str | None = None
    """The teacher: a Hugging Face folder or hub id of the same vocabulary (config.json's vocab_size)
    and tokenizer as the student; required. Built like the student (its TP plan, the compute dtype,
    FSDP-sharded), frozen."""
    beta: float = 0.5
    """TRL's `beta`: 0 the forward KL(teacher ‖ student), 1 the reverse KL(student ‖ teacher), in
    between the generalized JSD β·KL(t ‖ m) + (1 − β)·KL(s ‖ m), m = (1 − β)·p_s + β·p_t."""
    temperature: float = 1.0
    """Both models' logits are divided by it in the divergence (after a family's logit scale and
    softcap), and on-policy completions are sampled at it (TRL's DistillationTrainer); no T²."""
    sft_weight: float = 0.0
    """loss = divergence + sft_weight × the student's NLL of the data's completions (at T = 1), a mean
    over the step's scored tokens; on-policy steps (no data completions) add nothing; 0: none."""
    on_policy: float = 0.0
    """The fraction of optimizer steps whose completions the student samples (GKD's `lmbda`), drawn
    per step from train.seed (the same on every mesh): 0 = offline on the data's completions (TRL's
    GKDTrainer at lmbda=0), 1 = every step (TRL's DistillationTrainer)."""
    num_generations: int = 1
    """Completions sampled per prompt on an on-policy step: 1 (TRL's DistillationTrainer)."""


@dataclass
class RolloutConfig:
    """Where an online objective's completions come from (dtrain/rollout/)."""

    engine: str = "hf"
    """`hf`: transformers' generate on a copy of the policy (CPU and GPU); `vllm`: vLLM colocated with
    the trainer (GPU, the dtrain[vllm] extra); `file`: completions read from `rollout.path`."""
    path: str | None = None
    """`file`: a JSONL of `{"prompt": ..., "completions": [...]}` per prompt, in data order (a run's
    own `rollouts.jsonl` replays it)."""
    vllm_gpu_memory_utilization: float = 0.3
    """`vllm`: the fraction of each GPU's memory vLLM takes for its copy of the weights and its KV
    cache, beside the trainer (TRL's `vllm_gpu_memory_utilization`, colocate mode)."""
    vllm_enable_sleep_mode: bool = False
    """`vllm`: put vLLM to sleep between rollouts (its weights and KV cache freed while the trainer
    steps, the weights pushed again before each rollout), as TRL's `vllm_enable_sleep_mode`."""
    vllm_tensor_parallel_size: int = 1
    """`vllm`: GPUs each vLLM copy spans (consecutive ranks; it must divide the world size), as TRL's
    `vllm_tensor_parallel_size`; each group's ranks sample all of its prompts and keep their own."""


@dataclass
class GRPOConfig(SamplingConfig):
    """dtrain.grpo's loss and rewards, named and defaulted after TRL 1.16's GRPOConfig (docs/grpo.md):
    SamplingConfig's keys, then these."""

    beta: float = 0.0
    """β: the weight of the k3 KL to the reference policy, added per token; 0: no reference model."""
    num_iterations: int = 1
    """μ: optimizer passes over each generation's completions."""
    steps_per_generation: int = 1
    """Optimizer steps one generation feeds (TRL counts micro-batches: its default, the accumulation
    steps, is one optimizer step): a generation is train.global_batch_size × this many completions."""
    epsilon: float = 0.2
    """The surrogate's clip below: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """The clip above (DAPO's clip-higher); unset: epsilon."""
    delta: float | None = None
    """Two-sided clipping: the unclipped ratio is also capped at delta; unset: none."""
    importance_sampling_level: str = "token"
    """`token`: a ratio per token; `sequence`: GSPO, one ratio per completion, the exp of its mean
    token log-ratio."""
    scale_rewards: str = "group"
    """Advantages: (reward − group mean) divided by the group's std (`group`), by the whole generation's
    (`batch`), or not at all (`none`: Dr. GRPO)."""
    loss_type: str = "dapo"
    """The normaliser of the summed token losses over the whole optimizer step: `dapo` and `bnpo` (its
    tokens), `grpo` (each completion's own tokens, then its completions), `dr_grpo` (its completions ×
    max_completion_length); docs/grpo.md writes them out."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length out of the loss (they still count in the rewards'
    statistics)."""
    use_bias_correction_kl: bool = True
    """Multiply the k3 KL by the importance ratio (TRL 1.16's default: 1 in value at the first pass over
    a generation, but it adds the KL times the log-prob's gradient)."""
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy"])
    """Reward functions: `module:function` (imported as Python imports, from the working directory and
    PYTHONPATH) with TRL's signature, or a built-in: `accuracy` (math-verify against a `solution`
    column), `format` (`<think>...</think>` then the answer), `match` (the embedded default's)."""
    reward_weights: list[float] | None = None
    """One weight per reward function (unset: 1 each)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """`sum_then_normalize`: the weighted sum of the functions' rewards, then the advantages;
    `normalize_then_sum`: each function normalised per group, weighted, summed, normalised again."""
    vllm_importance_sampling_correction: bool = True
    """rollout.engine=vllm: weight each completion's policy term by old / sampling probabilities (the
    generator's log-probs), as TRL."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """`sequence_mask` | `sequence_truncate` | `token_mask` | `token_truncate`: per completion or per
    token; ratios outside [clip_min, clip_max] set to 0 (`*_mask`) or clamped (`*_truncate`)."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """The correction's upper bound (unset: none)."""
    vllm_importance_sampling_clip_min: float | None = None
    """The correction's lower bound (unset: none)."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """`online`, `offline` (writes under the run folder) or `disabled`. Online without credentials logs
    offline and says so."""
    project: str = "dtrain"
    """Passed to `wandb.init`."""
    entity: str | None = None
    """Passed to `wandb.init`."""
    name: str | None = None
    """Passed to `wandb.init`."""
    group: str | None = None
    """Passed to `wandb.init` (unset in a sweep: the sweep's name, so its jobs group together)."""
    tags: list[str] = field(default_factory=list)
    """Passed to `wandb.init`."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases, one run from rank 0 (metrics.jsonl is written whatever this says)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model: one Hugging Face folder or hub id, and overrides (`dtrain/conf/model/`)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training (and eval) data: sources, format, rows (`dtrain/conf/data/`, docs/data.md)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The mesh and how the model is sharded on it (docs/architecture.md)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and the learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop: steps, batch sizes, precision, what happens to a bad step."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints, resume and Hugging Face export (docs/checkpoints.md)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on a frozen base (docs/lora.md); off by default."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts models: the router's aux loss (docs/moe.md)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where logged steps go besides metrics.jsonl and the console."""


@dataclass
class PreferenceConfig(Config):
    """dtrain.dpo's schema: a training config plus the `dpo` group."""

    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The preference loss and its reference (docs/dpo.md)."""


@dataclass
class GRPORunConfig(Config):
    """dtrain.grpo's schema: a training config plus the `grpo` and `rollout` groups (batch sizes count
    completions)."""

    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The GRPO family's loss, sampling and rewards (docs/grpo.md)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Where the completions come from (docs/grpo.md, Engines)."""


@dataclass
class DistillationConfig(Config):
    """dtrain.distill's schema: a training config plus the `distill` group and the rollout engine of its
    on-policy steps."""

    distill: DistillConfig = field(default_factory=DistillConfig)
    """The teacher and the divergence (docs/distill.md)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Where on-policy completions come from (dtrain/rollout/)."""


@dataclass
class EstimateConfig:
    """`python -m dtrain.estimate` only (dtrain.sft and dtrain.dpo reject these keys)."""

    world_size: int = MISSING
    """The ranks (GPUs) to plan for; required, nothing sensible to guess. `parallel.dp_shard=-1` takes
    the rest as usual."""
    gpu_memory_gib: float = 80.0
    """Memory per GPU that the verdict and the suggestions compare the peak with."""
    format: str = "table"
    """`table`, or `json`: one object on stdout, every figure in bytes."""
    suggestions: bool = True
    """When it does not fit: estimate more tp, checkpointing, smaller micro batches."""
    top_modules: int = 5
    """Modules listed in the report."""


@dataclass
class PlanConfig(PreferenceConfig):
    """The estimator's schema: a training config (dtrain.sft's, dtrain.dpo's, dtrain.grpo's or
    dtrain.distill's: preference data plans a DPO step, prompts a GRPO step, prompt_completion data a
    distillation step with its teacher) plus the `estimate` group."""

    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """dtrain.grpo's group (data.format=prompt plans a GRPO step)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """dtrain.grpo's rollout engine (what the planner counts for the generator)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """dtrain.distill's group, planned with prompt_completion data (docs/distill.md)."""
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    """The planner's own settings (docs/estimate.md)."""


@dataclass(frozen=True)
class MeshShape:
    """The degree of each mesh axis, outermost first (MESH_AXES): the world size is their product."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1  # taken from dp_shard × cp, not a factor of the world size of its own

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many different rows one step reads at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    def degrees(self) -> dict[str, int]:
        """The world's axes (ep is not one: it splits dp_shard × cp)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}


MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")


# Free-form dict fields: any key goes (model.config's overrides of config.json).
OPEN_KEYS = ("model.config",)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys of `node` that its schema (a dataclass) has no field for: Hydra refuses `key=value` for
    them, but `+key=value` adds them to the config, where they would be ignored."""
    schema = OmegaConf.get_type(node)
    if schema is None or not hasattr(schema, "__dataclass_fields__"):
        return []
    names = {f.name for f in fields(schema)}
    found = []
    for key in node:
        where = f"{prefix}{key}"
        if key not in names:
            found.append(where)
        elif where not in OPEN_KEYS and isinstance(node._get_node(key), DictConfig):
            found += unknown_keys(node._get_node(key), f"{where}.")
    return found


def to_config(cfg: DictConfig) -> Config:
    """Hydra's DictConfig (already typed by the schema) as plain dataclasses; a key the schema
    does not know (added with `+`) is an error naming it."""
    if unknown := unknown_keys(cfg):
        raise ConfigError(f"{unknown[0]}: unknown key (a `+` adds keys only under model.config)")
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config), type(config)
    return config
