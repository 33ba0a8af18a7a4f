"""dtrain.distill's on-policy steps: the step's prompts, their completions from the rollout engine
(rollout.engine: dtrain/rollout/, the engines dtrain.grpo samples with), and the step's micro-batches
rebuilt from them.

A step's prompts are its examples in the stream's order (micro-step k, then dp rank r, then place:
dtrain/data/loader.py), gathered on every rank; each rank samples a contiguous share of them
(dtrain.objectives.grpo_generation.share, the same share every step), one completion each (TRL's
DistillationTrainer), and every rank gathers the rest, so the completions do not depend on the mesh:
the hf engine seeds a prompt's completion from (train.seed, the step, the example's index), and the
file engine's line n holds the n-th prompt of the run's stream (step s, place p: line s·G + p; with
data.shuffle=false and on every step sampled, the data's n-th record). A completion is its sampled
ids up to and including the first EOS id, or max_completion_length ids without one (the engines'
rule, TRL's); the micro-batch is the data stage's (dtrain/data/completions.py) with these
completions in place of the data's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import Config, ConfigError
from dtrain.data.completions import Completions
from dtrain.distributed import Parallel
from dtrain.objectives.base import Context, HostBatches
from dtrain.objectives.grpo_generation import share
from dtrain.parallel import lora
from dtrain.reliability import RankFailure, agreed_error
from dtrain.rollout import Completion, Engine, Prompt
from dtrain.rollout.sampling import eos_token_ids

ENGINES = ("hf", "vllm", "file")


class OnPolicy:
    """Replaces a step's completions by sampled ones (the module's docstring)."""

    def __init__(
        self, engine: Engine, model: torch.nn.Module, rows: Completions, parallel: Parallel, micro_batch: int
    ) -> None:
        self.engine, self.model, self.rows, self.parallel = engine, model, rows, parallel
        self.micro_batch = micro_batch  # examples a micro-batch, per dp rank

    def __call__(self, step: int, host: HostBatches) -> HostBatches:
        """This rank's micro-batches of step `step` (from 0) with sampled completions (a collective)."""
        mine = [micro_batch["example_index"].tolist() for micro_batch in host]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.parallel.dp_rank, mine))
        by_dp = dict(every)  # the tp and cp ranks of a dp rank hold its examples too
        dp, steps = self.parallel.dp_size, len(mine)
        order = [index for k in range(steps) for rank in range(dp) for index in by_dp[rank][k]]
        start, stop = share(len(order), dist.get_rank(), dist.get_world_size())
        self.engine.sync(self.model)
        completions, error = None, None
        try:
            prompts = [Prompt(index, *self.rows.prompt(index)) for index in order[start:stop]]
            completions = [
                one(found, index)
                for found, index in zip(self.engine.generate(prompts, step), order[start:stop], strict=True)
            ]
        except Exception as caught:  # bad input or a failing engine on this rank: every rank stops
            error = f"{caught}" if isinstance(caught, ConfigError) else f"{type(caught).__name__}: {caught}"
        message = agreed_error(error)
        if message is not None:
            raise RankFailure(f"step {step + 1}: {message}")
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, completions)
        sampled = [ids for part in parts for ids in part]
        first = self.parallel.dp_rank * self.micro_batch
        return [
            self.rows.batch(indices, sampled[k * dp * self.micro_batch + first :][: len(indices)])
            for k, indices in enumerate(mine)
        ]


def one(found: list[Completion], index: int) -> list[int]:
    """A prompt's one completion's ids."""
    if len(found) != 1:
        raise ValueError(f"the engine returned {len(found)} completions for data example {index}, not 1")
    return found[0].ids


def build_engine(config: Config, context: Context, tokenizer: Any, prompts: int) -> Engine:
    """rollout.engine's engine on this rank, sampling with distill.* (`prompts`: a step's)."""
    settings, rollout = config.distill, config.rollout
    model = context.model
    eos = eos_token_ids(tokenizer.eos_token_id, model.config, config.model.name_or_path)
    if rollout.engine == "file":
        from dtrain.rollout.file import FileEngine

        start, _ = share(prompts, dist.get_rank(), dist.get_world_size())
        return FileEngine(
            Path(rollout.path),
            tokenizer,
            1,
            settings.max_completion_length,
            eos,
            per_generation=prompts,
            first=start,
        )
    dtype = lora.DTYPES[config.train.precision]
    if rollout.engine == "hf":
        from dtrain.rollout.hf import HFEngine

        return HFEngine(
            model.config,
            settings,
            config.train.seed,
            eos,
            tokenizer.pad_token_id,
            dtype,
            context.parallel.device,
        )
    from dtrain.rollout.vllm import VLLMEngine

    folder = (context.run_dir or Path(".")) / "vllm_model"
    return VLLMEngine(
        rollout, settings, config.train.seed, model.config, eos, dtype, config.data.max_len, folder
    )


def check(config: Config, world_size: int | None = None) -> None:
    """rollout.*: an engine it has, a file for the file engine, vLLM where it runs."""
    rollout = config.rollout
    if rollout.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={rollout.engine!r}: must be one of {', '.join(ENGINES)}")
    if rollout.engine == "file" and not rollout.path:
        raise ConfigError(
            "rollout.engine=file: needs rollout.path (a JSONL of prompts and their completions)"
        )
    if rollout.engine == "vllm":
        from dtrain.rollout import vllm

        vllm.check(rollout, world_size)
