"""The config schema (one dataclass per Hydra group) and the checks that run before any process group.

Hydra rejects unknown keys and wrong types against these dataclasses; `check_config` adds the
cross-checks that need the world size and the model's architecture. Both run on every rank before
`init_process_group`, so a bad config fails everywhere at once instead of hanging a collective.

A field's docstring (the string on the line after it) is its documentation: `python
tools/config_docs.py` writes docs/config.md from them (tests/test_config_docs.py checks it is current).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

SWEEP_ON_FAILURE = ("continue", "stop")
PRECISIONS = ("bf16", "fp32")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
RESHARD_AFTER_FORWARD = ("auto", "always", "never")
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
WANDB_MODES = ("online", "offline", "disabled")
ESTIMATE_FORMATS = ("table", "json")
EXPORT_DTYPES = ("bf16", "fp32")
OVERLONG = ("truncate", "drop")
LOSS_IMPLS = ("dense", "chunked", "fused")
MODEL_INITS = ("auto", "pretrained", "random")
# What marks data.path as meant to be local (so a typo is "no such file", not a failed hub lookup).
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


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
    `messages` (a list of {role, content}; loss on every assistant turn) or `text` (loss on every
    token): the names in `FORMATS`, dtrain/data/formats.py."""
    input_key: str = "prompt"
    """`prompt_response`: the record key of the prompt."""
    output_key: str = "response"
    """`prompt_response`: the record key of the response."""
    system_key: str | None = None
    """`prompt_response`: the record key of an optional system prompt."""
    messages_key: str = "messages"
    """`messages`: the record key of the list of {role, content}."""
    text_key: str = "text"
    """`text`: the record key of the text."""


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
    sequence_parallel: bool = True
    """Activations between blocks sharded over the sequence (over tp)."""
    loss_parallel: bool = True
    """Vocabulary-sharded logits into the cross-entropy."""
    loss_impl: str = "dense"
    """`dense`: the model's whole (vocabulary-sharded) logits, then loss parallel's cross-entropy;
    `chunked`: `lm_head` + loss per chunk, each checkpointed (recomputed in backward); `fused`: head,
    loss and both gradients in one pass per chunk (`dtrain/fused_loss.py`), nothing recomputed, one
    chunk of logits alive. `chunked` and `fused` compute `lm_head(hidden)` themselves, so they take the
    families with a TP plan only, and not Granite's scaled logits; why `dense` stays the default:
    docs/benchmark.md."""
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
    """Optimizer steps of the run."""
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
    """Save every N steps; 0: no periodic checkpoints (only the final save)."""
    dir: str | None = None
    """Where the `step-XXXXXXXX/` folders go (unset: `<run dir>/checkpoints`)."""
    resume: str = "auto"
    """`auto`: the newest complete checkpoint in `dir`, if any; `none`; or a checkpoint path."""
    keep: int = 2
    """Complete checkpoints kept (the oldest are removed)."""
    save_final: bool = True
    """Also save after the last step."""
    async_save: bool = False
    """Write with `dcp.async_save` (stage to CPU, write while the next steps run). The issue's
    `checkpoint.async`: `async` is a Python keyword and cannot name a dataclass field."""
    overwrite: bool = False
    """Reuse a run folder or checkpoint dir that holds a different run (its metrics and checkpoints
    are removed); without it such a folder is refused before launch."""
    export_hf: bool = False
    """Write a Hugging Face folder to `<run dir>/hf` at the end."""
    export_dtype: str = "bf16"
    """`bf16` or `fp32`: the dtype of export_hf's safetensors."""


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
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where logged steps go besides metrics.jsonl and the console."""


@dataclass
class EstimateConfig:
    """`python -m dtrain.estimate` only (dtrain.sft rejects these keys)."""

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
class PlanConfig(Config):
    """The estimator's schema: a training config plus the `estimate` group."""

    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    """The planner's own settings (docs/estimate.md)."""


@dataclass(frozen=True)
class MeshShape:
    """The degree of each mesh axis, outermost first (MESH_AXES): the world size is their product."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many different rows one step reads at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")


def to_config(cfg: DictConfig) -> Config:
    """Hydra's DictConfig (already typed by the schema) as plain dataclasses."""
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config), type(config)
    return config


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(allowed)}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}={value}: must be >= 1")


def mesh_shape(parallel: ParallelConfig, world_size: int) -> MeshShape:
    """Resolve dp_shard=-1 and check that the product of the degrees is the world size."""
    fixed = {"tp": parallel.tp, "cp": parallel.cp, "dp_replicate": parallel.dp_replicate}
    for axis, degree in fixed.items():
        _positive(f"parallel.{axis}", degree)
    others = math.prod(fixed.values())
    named = " × ".join(f"parallel.{axis}={degree}" for axis, degree in fixed.items() if degree > 1)
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(f"{named} does not divide the world size {world_size}")
        dp_shard = world_size // others
    _positive("parallel.dp_shard", dp_shard)
    if others * dp_shard != world_size:
        product = " × ".join(filter(None, [named, f"parallel.dp_shard={dp_shard}"]))
        raise ConfigError(f"{product} = {others * dp_shard}, but the world size is {world_size}")
    return MeshShape(parallel.dp_replicate, dp_shard, parallel.cp, parallel.tp)


def _check_source_path(key: str, path: str) -> None:
    """Local paths must exist; anything else is taken for a hub id and resolved when loading."""
    looks_local = path.startswith(("/", "./", "../", "~")) or path.endswith(LOCAL_SUFFIXES)
    if looks_local and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{key}={path!r}: no such file or folder")


def check_data(data: DataConfig, train: TrainConfig, *, files: bool = True) -> None:
    _one_of("data.overlong", data.overlong, OVERLONG)
    _positive("data.num_proc", data.num_proc)
    if data.num_workers < 0:
        raise ConfigError(f"data.num_workers={data.num_workers}: must be >= 0")
    check_format("data.format", data.format)
    if data.max_samples is not None:
        _positive("data.max_samples", data.max_samples)
    if data.mix:
        for source in data.sources():
            if files:
                _check_source_path(source.key("path"), source.path)
            if not source.weight > 0:
                raise ConfigError(f"{source.key('weight')}={source.weight}: must be > 0")
            check_format(source.key("format"), source.format)
            if source.max_samples is not None:
                _positive(source.key("max_samples"), source.max_samples)
    elif files:
        _check_source_path("data.path", data.path)
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction}: must be in [0, 1)")
    if data.eval_split is not None and data.eval_fraction > 0:
        raise ConfigError("data.eval_split and data.eval_fraction: set one of them, not both")
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every={train.eval_every}: must be >= 0")
    if train.eval_every and data.eval_split is None and data.eval_fraction == 0:
        raise ConfigError(
            f"train.eval_every={train.eval_every} needs an eval set: "
            "set data.eval_split or data.eval_fraction"
        )


def check_config(config: Config, world_size: int, model_config: Any, *, files: bool = True) -> MeshShape:
    """Every cross-check that can fail before launch. Returns the resolved mesh shape.
    files=False skips what only a training run reads from disk (data.path): the planner needs none."""
    shape = mesh_shape(config.parallel, world_size)
    train, data, parallel = config.train, config.data, config.parallel

    _one_of("train.precision", train.precision, PRECISIONS)
    _one_of("train.nonfinite", train.nonfinite, ("skip", "abort"))
    _one_of("train.sweep_on_failure", train.sweep_on_failure, SWEEP_ON_FAILURE)
    _one_of("parallel.activation_checkpointing", parallel.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _one_of("optim.schedule", config.optim.schedule, SCHEDULES)
    _one_of("parallel.loss_impl", parallel.loss_impl, LOSS_IMPLS)
    if parallel.loss_impl != "dense" and parallel.loss_chunk < 1:
        raise ConfigError(
            f"parallel.loss_chunk={parallel.loss_chunk}: must be >= 1 "
            f"with parallel.loss_impl={parallel.loss_impl}"
        )
    _one_of("parallel.reshard_after_forward", parallel.reshard_after_forward, RESHARD_AFTER_FORWARD)
    if parallel.fsdp_prefetch < 0:
        raise ConfigError(
            f"parallel.fsdp_prefetch={parallel.fsdp_prefetch}: must be >= 0 (0: FSDP's own prefetching)"
        )
    _one_of("logging.wandb.mode", config.logging.wandb.mode, WANDB_MODES)
    _one_of("model.init", config.model.init, MODEL_INITS)
    for key, value in (
        ("train.max_steps", train.max_steps),
        ("train.global_batch_size", train.global_batch_size),
        ("train.micro_batch_size", train.micro_batch_size),
        ("train.log_every", train.log_every),
        ("data.max_len", data.max_len),
        ("parallel.timeout_s", parallel.timeout_s),
    ):
        _positive(key, value)
    if train.max_skips < 0:
        raise ConfigError(f"train.max_skips={train.max_skips}: must be >= 0")
    if config.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={config.optim.warmup_steps}: must be >= 0")

    per_step = train.micro_batch_size * shape.dp
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={train.micro_batch_size} × dp={shape.dp} (= {per_step})"
        )
    check_data(data, train, files=files)
    check_sequence_split(data.max_len, shape, parallel.sequence_parallel)
    if config.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={config.checkpoint.every}: must be >= 0 (0: final save only)")
    _positive("checkpoint.keep", config.checkpoint.keep)
    _one_of("checkpoint.export_dtype", config.checkpoint.export_dtype, EXPORT_DTYPES)
    if not (config.model.tokenizer or config.model.name_or_path):
        raise ConfigError("model.tokenizer: needed when model.name_or_path is not set")

    check_tp_support(model_config.model_type, shape.tp)
    check_loss_support(model_config, parallel.loss_impl)
    # vocab_size need not divide: the embedding and lm_head are padded (dtrain.parallel.vocab).
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model_config, key, None)
        if value is not None and value % shape.tp:
            raise ConfigError(f"model {key}={value} is not divisible by parallel.tp={shape.tp}")
    return shape


def check_sequence_split(max_len: int, shape: MeshShape, sequence_parallel: bool) -> None:
    """Context parallel cuts each row into 2·cp equal chunks (rank i keeps chunks i and 2·cp-1-i, so
    causal work is even); sequence parallel then splits a rank's part over tp."""
    chunks = 2 * shape.cp if shape.cp > 1 else 1
    split = chunks * (shape.tp if sequence_parallel else 1)
    if max_len % split == 0:
        return
    parts = []
    if shape.cp > 1:
        parts.append(f"2 × parallel.cp={shape.cp} (context parallel's chunks)")
    if sequence_parallel and shape.tp > 1:
        parts.append(f"parallel.tp={shape.tp} (sequence parallel; or set parallel.sequence_parallel=false)")
    total = f" = {split}" if len(parts) > 1 else ""
    raise ConfigError(f"data.max_len={max_len} is not divisible by {' × '.join(parts)}{total}")


def check_format(key: str, name: str) -> None:
    from dtrain.data.formats import FORMATS  # imported here: the data package imports this module

    _one_of(key, name, tuple(FORMATS))


def check_tp_support(model_type: str, tp: int) -> None:
    """A family without a TP plan trains FSDP-only (tp=1); at tp > 1 it is refused before launch."""
    from dtrain.parallel.parallelize import TP_PLANS  # imported here: parallelize imports this module

    if tp > 1 and model_type not in TP_PLANS:
        raise ConfigError(
            f"model type {model_type!r} has no TP plan, so it trains with parallel.tp=1 only (FSDP); "
            f"parallel.tp={tp} needs one of: {', '.join(TP_PLANS)}"
        )


def check_loss_support(model_config: Any, loss_impl: str) -> None:
    """chunked and fused compute the logits as lm_head(hidden) themselves, in place of the model's
    own head forward: right for the families with a TP plan (a bias-free lm_head and nothing after
    it), not for a head of another name (gpt_neox's embed_out) or logits post-processed (Granite's
    logits_scaling, a final softcap). Those train with the dense loss, the model's own logits."""
    from dtrain.parallel.parallelize import TP_PLANS  # imported here: parallelize imports this module

    if loss_impl == "dense":
        return
    model_type = model_config.model_type
    if model_type not in TP_PLANS:
        raise ConfigError(
            f"parallel.loss_impl={loss_impl}: computes lm_head's logits itself, checked for "
            f"{', '.join(TP_PLANS)} only; model type {model_type!r} trains with parallel.loss_impl=dense"
        )
    for key, plain in (("logits_scaling", 1.0), ("final_logit_softcapping", None)):
        value = getattr(model_config, key, plain)
        if value != plain:
            raise ConfigError(
                f"parallel.loss_impl={loss_impl}: the model's {key}={value} post-processes the logits, "
                "which the chunked and fused losses skip; use parallel.loss_impl=dense"
            )


def check_estimate(settings: EstimateConfig) -> None:
    """The `estimate` group's own checks (the rest of the config goes through check_config)."""
    _positive("estimate.world_size", settings.world_size)
    _positive("estimate.top_modules", settings.top_modules)
    _one_of("estimate.format", settings.format, ESTIMATE_FORMATS)
    if settings.gpu_memory_gib <= 0:
        raise ConfigError(f"estimate.gpu_memory_gib={settings.gpu_memory_gib}: must be > 0")
