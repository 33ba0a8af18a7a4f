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

from dtrain.config import Config, ConfigError, GRPORunConfig, MoeConfig, TrainConfig
from dtrain.data.formats import PROMPT_FEATURES, load_tokenizer, pad_id
from dtrain.data.prompts import rollout_batch, token_place
from dtrain.distributed import Parallel
from dtrain.loss import LossSettings, loss_context
from dtrain.model import tokenizer_source
from dtrain.objectives import grpo_loss
from dtrain.objectives.base import Context, HostBatches, Objective, ObjectiveSpec, StepFigures
from dtrain.objectives.grpo_advantages import advantages, generation_metrics, reward_weights, weighted_rewards
from dtrain.objectives.grpo_checks import check
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
from dtrain.rewards import RewardError, RewardFunction, load, score_completions
from dtrain.rollout import Engine, Prompt
from dtrain.step import global_counts, local_micro_batch

log = logging.getLogger("dtrain")


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
        self.train_start = time.perf_counter()
        return batches

    def positions(self, step: int) -> list[list[int]]:
        """This dp rank's micro-batches of step `step` of the generation: each a list of its completions'
        positions."""
        train, parallel = self.train, self.parallel
        return step_positions(
            self.generation,
            step,
            train.global_batch_size,
            train.micro_batch_size,
            parallel.dp_rank,
            parallel.dp_size,
        )

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
            rewards = score_completions(self.functions, self.tokenizer, mine, completions, settings)
            local = (completions, rewards.tolist())
        except Exception as caught:  # bad input or a failing function on this rank: every rank stops
            bad_input = isinstance(caught, (ConfigError, RewardError))
            error = f"{caught}" if bad_input else f"{type(caught).__name__}: {caught}"
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
        """The step's counts: its trained completion tokens over every dp and cp rank (every target:
        the labels hold nothing else), and its completions (the global batch, masked ones included)."""
        self.tokens, self.filled, self.slots = global_counts(micro_batches, self.parallel)
        self.counts = grpo_loss.StepCounts(tokens=self.tokens, completions=self.train.global_batch_size)
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
        tokens = max(self.counts.tokens.item(), 1.0)
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
        return StepFigures(sums["loss"], int(self.counts.tokens.item()), extra)

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
    from dtrain.rollout.sampling import eos_token_ids

    settings, rollout, model_config = config.grpo, config.rollout, context.model.config
    eos = eos_token_ids(tokenizer.eos_token_id, model_config, config.model.name_or_path)
    dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
    if rollout.engine == "file":
        from dtrain.rollout.file import FileEngine

        start, _ = share(prompts, dist.get_rank(), dist.get_world_size())
        path = Path(rollout.path)
        return FileEngine(
            path, tokenizer, settings.num_generations, settings.max_completion_length, eos, prompts, start
        )
    if rollout.engine == "hf":
        from dtrain.rollout.hf import HFEngine

        device = context.parallel.device
        return HFEngine(model_config, settings, config.train.seed, eos, tokenizer.pad_token_id, dtype, device)
    from dtrain.rollout.vllm import VLLMEngine

    folder = (context.run_dir or Path(".")) / "vllm"
    seed = config.train.seed
    return VLLMEngine(rollout, settings, seed, model_config, eos, dtype, config.data.max_len, folder)


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
    planning = context.data is None  # dtrain.estimate: the step alone, no engine, no rewards
    if not planning:
        where = config.data.sources()[0].where if not config.data.mix else "data.mix"
        context.data.train.rows.check_room(config.data.max_len, settings.max_completion_length, where)
    tokenizer = None if planning else load_tokenizer(tokenizer_source(config.model))
    reference = None
    if settings.beta != 0.0:
        if lora.enabled(config.lora) and not config.lora.adapter:
            reference = model
        elif context.frozen is None:
            raise ValueError("grpo.beta != 0: the objective needs a frozen model builder (Context.frozen)")
        else:
            reference = context.frozen(None)
    engine = None if planning else build_engine(config, context, tokenizer, prompts_per_generation(config))
    return GRPO(
        model,
        parallel,
        LossSettings.of(config.parallel),
        config.moe,
        config,
        engine,
        [] if planning else load(settings.reward_funcs),
        tokenizer,
        reference,
        context.run_dir,
        context.step,
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
