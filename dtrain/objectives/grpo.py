"""GRPO's objective (dtrain.grpo): online RL with verifiable rewards, the GRPO family (GRPO, DAPO,
Dr. GRPO, GSPO) exact against TRL 1.16's GRPOTrainer; docs/grpo.md.

Each step that starts a generation (every grpo.steps_per_generation × grpo.num_iterations steps) reads
the next generation's prompts from the data stream, samples their completions with the rollout engine
(rollout.engine: dtrain/rollout/), scores them with the reward functions (dtrain/rewards.py), turns the
rewards into advantages over whole groups (dtrain.objectives.grpo_advantages), and computes the
per-token log-probs later passes need (old: the policy now; reference: the frozen starting policy, or
the adapters off for LoRA) — dtrain.objectives.grpo_generation. Every step then trains on its share of
the generation's completions, packed whole per micro-batch, with the loss of
dtrain.objectives.grpo_loss normalised over the whole step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import (
    Config,
    ConfigError,
    GRPORunConfig,
    MoeConfig,
    TrainConfig,
)
from dtrain.data.formats import PROMPT_FEATURES, load_tokenizer, pad_id
from dtrain.data.prompts import rollout_batch, token_place
from dtrain.distributed import Parallel
from dtrain.loss import LossSettings, loss_context
from dtrain.model import tokenizer_source
from dtrain.objectives import grpo_loss
from dtrain.objectives.base import Context, HostBatches, Objective, ObjectiveSpec, StepFigures
from dtrain.objectives.grpo_advantages import advantages, generation_metrics, reward_weights, weighted_rewards
from dtrain.objectives.grpo_generation import (
    Generation,
    RolloutsFile,
    importance_ratio,
    permutation,
    share,
    step_positions,
)
from dtrain.parallel import lora
from dtrain.parallel.parallelize import reshard
from dtrain.reliability import RankFailure, agreed_error
from dtrain.rewards import RewardFunction, Scored, load, score
from dtrain.rollout import Completion, Engine, Prompt
from dtrain.step import global_counts, local_micro_batch

log = logging.getLogger("dtrain")
ENGINES = ("hf", "vllm", "file")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")


class GRPO(Objective):
    """dtrain.grpo (the module's docstring). `engine`: where completions come from; `functions`: the
    reward functions; `reference`: the model whose log-probs the KL is to (None: β = 0), run with its
    adapters bypassed when it is the policy itself (LoRA)."""

    def __init__(
        self,
        model: torch.nn.Module,
        parallel: Parallel,
        loss: LossSettings,
        moe: MoeConfig,
        config: GRPORunConfig,
        engine: Engine,
        functions: list[RewardFunction],
        tokenizer: Any,
        reference: torch.nn.Module | None,
        run_dir: Path | None,
        start_step: int,
    ) -> None:
        super().__init__(model, parallel, loss, moe)
        self.settings, self.train, self.data = config.grpo, config.train, config.data
        self.engine, self.functions, self.tokenizer = engine, functions, tokenizer
        self.seed = config.train.seed
        self.reference = reference
        if reference is not None and reference is not model:
            self.frozen.append(reference)
        self.importance = (
            config.rollout.engine == "vllm" and self.settings.vllm_importance_sampling_correction
        )
        self.generation: Generation | None = None
        self.num_tokens = 0  # prompt and completion tokens of every generation so far (TRL's num_tokens)
        self.pending: list[dict[str, Any]] = []  # the metrics of each generation since the last logged step
        self.times = dict.fromkeys(("sync", "rollout", "reward", "logps"), 0.0) | {"generated": 0.0}
        self.steps_since_log, self.train_start = 0, time.perf_counter()
        self.rollouts = None
        if run_dir is not None and dist.get_rank() == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.rollouts = RolloutsFile(run_dir / "rollouts.jsonl", start_step)

    @property
    def passes(self) -> int:
        """Optimizer steps one generation feeds."""
        return self.settings.steps_per_generation * self.settings.num_iterations

    def next_batches(self, step: int, read: Callable[[], HostBatches]) -> list[dict[str, Any]]:
        if step % self.passes == 0:
            self.generate(step, read)
        elif self.generation is None or self.generation.step != step - step % self.passes:
            raise ConfigError(
                f"step {step + 1}: resumed in the middle of a generation without its completions (a "
                "checkpoint of another objective or version); checkpoint.resume=never starts over"
            )
        self.steps_since_log += 1
        k = step % self.settings.steps_per_generation
        batches = [local_micro_batch(mb, self.parallel) for mb in self.host_batches(k)]
        self.step_rollouts = [p for positions in self.positions(k, every_rank=True) for p in positions]
        self.train_start = time.perf_counter()
        return batches

    def positions(self, step: int, every_rank: bool = False) -> list[list[int]]:
        """The completion positions of step `step` of the generation: this rank's micro-batches, or
        (every_rank) every dp rank's."""
        ranks = range(self.parallel.dp_size) if every_rank else [self.parallel.dp_rank]
        return [
            positions
            for rank in ranks
            for positions in step_positions(
                self.generation,
                step,
                self.train.global_batch_size,
                self.train.micro_batch_size,
                rank,
                self.parallel.dp_size,
            )  # fmt: skip
        ]

    def host_batches(self, step: int, tokens: bool = True) -> HostBatches:
        """This rank's micro-batches of step `step` of the generation, on the host."""
        settings, generation = self.settings, self.generation
        if not tokens:  # the rows alone: the generation's own forwards, before the tokens exist
            generation = dataclasses.replace(generation, tokens={})
        return [
            rollout_batch(
                [
                    generation.rollout(p, settings.num_generations, settings.mask_truncated_completions)
                    for p in ps
                ],
                self.data.max_len,
                pad_id(self.tokenizer),
                self.data.packing,
            )
            for ps in self.positions(step)
        ]

    # --- a generation -------------------------------------------------------------------------------

    def generate(self, step: int, read: Callable[[], HostBatches]) -> None:
        """Sample, score and gather the next generation (the module's docstring); its log-probs."""
        settings = self.settings
        index = step // self.passes
        (prompts,) = read()
        rank, world = dist.get_rank(), dist.get_world_size()
        start, stop = share(len(prompts), rank, world)
        mine = prompts[start:stop]
        began = time.perf_counter()
        self.engine.sync(self.model)
        synced = time.perf_counter()
        local, error, sampled = None, None, synced
        try:
            completions = self.engine.generate(
                [Prompt(p["index"], p["ids"], p["record"]["prompt"]) for p in mine], index
            )
            sampled = time.perf_counter()
            local = (completions, self.score(mine, completions).tolist())
        except Exception as caught:  # bad input or a failing function on this rank: every rank stops
            error = f"{caught}" if isinstance(caught, ConfigError) else f"{type(caught).__name__}: {caught}"
        scored = time.perf_counter()
        message = agreed_error(error)
        if message is not None:
            raise RankFailure(f"step {step + 1}: {message}")
        every: list[Any] = [None] * world
        dist.all_gather_object(every, local)
        gathered = time.perf_counter()
        completions = [c for part in every for group in part[0] for c in group]
        per_func = torch.tensor([r for part in every for r in part[1]], dtype=torch.float32)
        per_func = per_func.reshape(len(completions), len(self.functions))
        advantage, zero_std = advantages(per_func, settings)
        size = len(completions)
        self.generation = Generation(
            index=index,
            step=step,
            prompts=prompts,
            ids=[c.ids for c in completions],
            truncated=[c.truncated for c in completions],
            rewards=per_func.tolist(),
            advantages=advantage.tolist(),
            order=permutation(size, self.seed, index, settings.steps_per_generation > 1),
            sampling_logps=[c.logprobs for c in completions] if self.importance else None,
        )
        self.add_logps()
        done = time.perf_counter()
        lengths = [len(c.ids) for c in completions]
        names = [f.name for f in self.functions]
        metrics = generation_metrics(per_func, names, settings, zero_std, lengths, self.generation.truncated)
        self.num_tokens += sum(lengths) + settings.num_generations * sum(len(p["ids"]) for p in prompts)
        self.pending.append(metrics)
        self.times["sync"] += synced - began
        self.times["rollout"] += (sampled - synced) + (gathered - scored)  # with the wait for every rank's
        self.times["reward"] += scored - sampled
        self.times["logps"] += done - gathered
        self.times["generated"] += sum(lengths)
        if self.rollouts is not None:
            texts = self.tokenizer.batch_decode([c.ids for c in completions], skip_special_tokens=True)
            rewards = weighted_rewards(per_func, reward_weights(settings, len(names))).tolist()
            self.rollouts.write(self.generation, texts, rewards, names)

    def score(self, prompts: list[dict[str, Any]], completions: list[list[Completion]]) -> torch.Tensor:
        """[completions, functions]: this rank's prompts' completions scored by every reward function."""
        group = self.settings.num_generations
        for prompt, found in zip(prompts, completions, strict=True):
            if len(found) != group:
                raise ValueError(
                    f"the engine returned {len(found)} completions for data example {prompt['index']}"
                )
        if not prompts:
            return torch.zeros(0, len(self.functions))
        ids = [c.ids for found in completions for c in found]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        records = [p["record"] for p in prompts for _ in range(group)]
        chat = [not isinstance(r["prompt"], str) for r in records]
        batch = Scored(
            prompts=[r["prompt"] for r in records],
            completions=[
                [{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat, strict=True)
            ],
            completion_ids=ids,
            columns={key: [r["columns"].get(key) for r in records] for key in records[0]["columns"]},
            examples=[p["index"] for p in prompts for _ in range(group)],
        )
        return score(self.functions, batch)

    def add_logps(self) -> None:
        """The generation's per-token log-probs its later steps need: old (the policy now) when it
        feeds more than one optimizer step or vLLM's correction needs them, reference when β ≠ 0,
        computed in the micro-batches the steps will train in (every rank its own, all-reduced)."""
        settings, generation = self.settings, self.generation
        if self.passes > 1 or self.importance:
            generation.tokens["old_logps"] = self.generation_logps(self.model, bypass=False)
        if settings.beta != 0.0:
            bypass = self.reference is self.model
            generation.tokens["ref_logps"] = self.generation_logps(self.reference, bypass=bypass)
        if self.importance:
            generation.tokens["is_ratio"] = importance_ratio(
                generation.tokens["old_logps"],
                generation.sampling_logps,
                settings.vllm_importance_sampling_mode,
                settings.vllm_importance_sampling_clip_min,
                settings.vllm_importance_sampling_clip_max,
            )

    @torch.no_grad()
    def generation_logps(self, model: torch.nn.Module, bypass: bool) -> list[list[float]]:
        """Every completion token's log-prob under `model` (logits / T), per completion."""
        generation, settings = self.generation, self.settings
        lengths = [len(ids) for ids in generation.ids]
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        flat = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=self.parallel.device)
        bypassed = lora.adapters_bypassed(model) if bypass else contextlib.nullcontext()
        with loss_context(self.loss.parallel), bypassed:
            for step in range(settings.steps_per_generation):
                for positions, host in zip(
                    self.positions(step), self.host_batches(step, tokens=False), strict=True
                ):
                    micro_batch = local_micro_batch(host, self.parallel)
                    logps, _ = grpo_loss.token_logps(
                        model, micro_batch, self.loss.impl, self.loss.chunk, settings.temperature
                    )
                    scored, sequence, place = token_place(micro_batch)
                    base = offsets[torch.tensor(positions, dtype=torch.long)].to(self.parallel.device)
                    target = base[sequence] + place - micro_batch["token_offset"][sequence]
                    flat.index_add_(0, target[scored], logps[scored])
        reshard(model)  # its root stays gathered after a forward without backward
        dist.all_reduce(flat, group=self.parallel.token_group)  # each token on one (dp, cp) rank
        values = flat.tolist()
        return [values[int(offsets[i]) : int(offsets[i + 1])] for i in range(len(lengths))]

    # --- a step --------------------------------------------------------------------------------------

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        self.tokens, self.filled, self.slots = global_counts(micro_batches, self.parallel)
        generation, settings = self.generation, self.settings
        trained = [
            len(generation.ids[p])
            for p in self.step_rollouts
            if not (settings.mask_truncated_completions and generation.truncated[p])
        ]
        self.counts = grpo_loss.StepCounts(tokens=float(sum(trained)), completions=len(self.step_rollouts))
        self.sums = torch.zeros(len(grpo_loss.FIGURES), dtype=torch.float64, device=self.parallel.device)

    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        loss = self.loss
        return grpo_loss.token_logps(
            self.model, micro_batch, loss.impl, loss.chunk, self.settings.temperature
        )[0]

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        self.sums += grpo_loss.micro_step(
            self.model,
            micro_batch,
            self.settings,
            self.counts,
            self.parallel["cp"],
            *self.loss,
            router=self.router,
        )

    def reduce(self) -> StepFigures:
        dist.all_reduce(self.sums, group=self.parallel.token_group)
        sums = dict(zip(grpo_loss.FIGURES, self.sums.tolist(), strict=True))
        tokens = max(self.counts.tokens, 1.0)
        extra: dict[str, Any] = {}
        if self.settings.beta != 0.0:
            extra["kl"] = sums["kl"] / tokens
        extra["entropy"] = sums["entropy"] / tokens
        per_clip = (
            self.counts.completions if self.settings.importance_sampling_level == "sequence" else tokens
        )
        for name in grpo_loss.FIGURES[3:]:
            extra[name] = sums[name] / per_clip
        extra |= self.logged_generations()
        return StepFigures(sums["loss"], int(self.counts.tokens), extra)

    def logged_generations(self) -> dict[str, Any]:
        """The generations' metrics since the last logged step (averaged over them, NaN skipped, as TRL's
        log()), the time split per step and the tokens generated per second; then started again."""
        figures: dict[str, Any] = {}
        for key in dict.fromkeys(k for metrics in self.pending for k in metrics):
            valid = [m[key] for m in self.pending if key in m and not math.isnan(m[key])]
            figures[key] = sum(valid) / len(valid) if valid else None
        if self.pending:
            figures["num_tokens"] = self.num_tokens
        steps = max(self.steps_since_log, 1)
        times = self.times
        figures |= {f"time/{name}_s": times[name] / steps for name in ("sync", "rollout", "reward", "logps")}
        figures["time/train_s"] = time.perf_counter() - self.train_start
        if self.pending:
            rollout = times["rollout"]
            figures["tokens_generated_per_s"] = times["generated"] / rollout if rollout > 0 else None
        self.pending, self.steps_since_log = [], 0
        self.times = dict.fromkeys(times, 0.0)
        return figures

    def state_dict(self) -> dict[str, Any]:
        return {
            "generation": None if self.generation is None else self.generation.state(),
            "num_tokens": self.num_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("generation") is not None:
            self.generation = Generation(**state["generation"])
        self.num_tokens = state.get("num_tokens", 0)

    def evaluate(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError("dtrain.grpo has no eval")


# --- the declaration -------------------------------------------------------------------------------


def build_engine(config: GRPORunConfig, context: Context, tokenizer: Any, prompts: int) -> Engine:
    """rollout.engine's engine for this rank (`prompts`: a generation's; each rank samples its share)."""
    settings, engine = config.grpo, config.rollout.engine
    if engine == "file":
        from dtrain.rollout.file import FileEngine

        start, _ = share(prompts, dist.get_rank(), dist.get_world_size())
        return FileEngine(
            Path(config.rollout.path),
            tokenizer,
            settings.num_generations,
            settings.max_completion_length,
            eos_token_ids(tokenizer, context.model.config),
            per_generation=prompts,
            first=start,
        )
    module = engine_module(engine)
    return module.build(config, context, tokenizer)


def engine_module(engine: str) -> Any:
    """dtrain.rollout.<engine> (hf, vllm): imported when chosen (vLLM is an optional extra)."""
    import importlib

    try:
        return importlib.import_module(f"dtrain.rollout.{engine}")
    except ModuleNotFoundError as error:
        raise ConfigError(f"rollout.engine={engine}: {error}") from None


def eos_token_ids(tokenizer: Any, model_config: Any) -> list[int]:
    """The ids that end a completion, TRL's: the model's eos_token_id (an id or a list) and the
    tokenizer's."""
    ids = getattr(model_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def prompts_per_generation(config: Config) -> int:
    settings = config.grpo
    return config.train.global_batch_size * settings.steps_per_generation // settings.num_generations


def stream(config: Config, dp_rank: int, dp_size: int) -> tuple[TrainConfig, int, int]:
    """Every rank reads each generation's prompts whole (it samples a share and gathers the rest)."""
    prompts = prompts_per_generation(config)
    return dataclasses.replace(config.train, global_batch_size=prompts, micro_batch_size=prompts), 0, 1


def build(context: Context) -> GRPO:
    """GRPO's objective: the prompts' room checked, the reward functions, the engine, the reference
    (β ≠ 0: the adapters off for LoRA from fresh adapters, else a frozen copy of the starting policy,
    a starting adapter included, as TRL's)."""
    config, model, parallel = context.config, context.model, context.parallel
    settings = config.grpo
    if context.data is not None:
        where = config.data.sources()[0].where if not config.data.mix else "data.mix"
        context.data.train.rows.check_room(config.data.max_len, settings.max_completion_length, where)
    tokenizer = load_tokenizer(tokenizer_source(config.model))
    reference = None
    if settings.beta != 0.0:
        if lora.enabled(config.lora) and not config.lora.adapter:
            reference = model
        elif context.frozen_copy is None:
            raise ValueError("grpo.beta != 0: the objective needs a frozen copy of the policy (frozen_copy)")
        else:
            reference = context.frozen_copy()
    engine = build_engine(config, context, tokenizer, prompts_per_generation(config))
    return GRPO(
        model,
        parallel,
        LossSettings.of(config.parallel),
        config.moe,
        config,
        engine,
        load(settings.reward_funcs),
        tokenizer,
        reference,
        context.run_dir,
        context.step,
    )


def check(config: Config) -> None:
    """grpo.* and rollout.*: values, the batch in whole groups, the reward functions importable."""
    settings, rollout, train = config.grpo, config.rollout, config.train
    group = settings.num_generations
    if group < 2:
        raise ConfigError(
            f"grpo.num_generations={group}: must be >= 2 (a group's advantages compare its completions)"
        )
    if train.global_batch_size % group:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} (completions) is not a multiple of "
            f"grpo.num_generations={group}: a step holds whole groups"
        )
    for key, value in (
        ("grpo.max_completion_length", settings.max_completion_length),
        ("grpo.num_iterations", settings.num_iterations),
        ("grpo.steps_per_generation", settings.steps_per_generation),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value}: must be >= 1")
    for key, value, allowed in (
        ("grpo.loss_type", settings.loss_type, grpo_loss.LOSS_TYPES),
        ("grpo.importance_sampling_level", settings.importance_sampling_level, LEVELS),
        ("grpo.scale_rewards", settings.scale_rewards, SCALES),
        ("grpo.multi_objective_aggregation", settings.multi_objective_aggregation, AGGREGATIONS),
        ("grpo.vllm_importance_sampling_mode", settings.vllm_importance_sampling_mode, IS_MODES),
        ("rollout.engine", rollout.engine, ENGINES),
    ):
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(allowed)}")
    if not settings.temperature > 0:
        raise ConfigError(f"grpo.temperature={settings.temperature}: must be > 0")
    if settings.beta < 0 or settings.epsilon < 0 or (settings.epsilon_high or 0) < 0:
        raise ConfigError("grpo.beta, grpo.epsilon and grpo.epsilon_high must be >= 0")
    if settings.delta is not None and not settings.delta > 1:
        raise ConfigError(f"grpo.delta={settings.delta}: must be > 1 (it caps the ratio above 1 + epsilon)")
    if not settings.reward_funcs:
        raise ConfigError("grpo.reward_funcs=[]: name at least one reward function")
    if settings.reward_weights is not None and len(settings.reward_weights) != len(settings.reward_funcs):
        raise ConfigError(
            f"grpo.reward_weights={list(settings.reward_weights)}: one weight per grpo.reward_funcs entry "
            f"({len(settings.reward_funcs)})"
        )
    load(settings.reward_funcs)  # a function that cannot be imported fails now, on every rank
    if config.data.max_len <= settings.max_completion_length:
        raise ConfigError(
            f"data.max_len={config.data.max_len} must exceed grpo.max_completion_length="
            f"{settings.max_completion_length}: a row holds a prompt and its whole completion"
        )
    if rollout.engine == "file" and not rollout.path:
        raise ConfigError(
            "rollout.engine=file: needs rollout.path (a JSONL of prompts and their completions)"
        )
    if rollout.engine == "vllm":
        checker = getattr(engine_module("vllm"), "check", None)
        if checker is not None:
            checker(rollout)
    if train.epochs is not None:
        raise ConfigError(
            f"train.epochs={train.epochs}: dtrain.grpo counts train.max_steps (unset train.epochs)"
        )
    if train.eval_every:
        raise ConfigError(f"train.eval_every={train.eval_every}: dtrain.grpo has no eval yet (set 0)")
    if config.parallel.loss_impl == "chunked":
        raise ConfigError("parallel.loss_impl=chunked: dtrain.grpo takes dense or fused (auto picks)")
    if config.moe.aux_scope != "global_batch":
        raise ConfigError(
            f"moe.aux_scope={config.moe.aux_scope}: dtrain.grpo defines the router's aux loss over the whole "
            "step (global_batch), so that the loss does not change with the accumulation"
        )


SPEC = ObjectiveSpec(
    name="grpo",
    schema=GRPORunConfig,
    config_name="config_grpo",
    embedded="+experiment=embedded_grpo",
    features=PROMPT_FEATURES,
    build=build,
    check=check,
    stream=stream,
)
