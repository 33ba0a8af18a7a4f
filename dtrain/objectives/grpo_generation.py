"""One generation of dtrain.grpo, whole on every rank: its prompts, completions, rewards and advantages,
and the per-token log-probs later steps need; how its optimizer steps and micro-batches are cut from
it; and the run folder's rollouts.jsonl.

A generation is train.global_batch_size × grpo.steps_per_generation completions: B prompts of the
data stream, G completions each, prompt-major (completion j of prompt b at b·G + j). Each rank samples
and scores a contiguous share of the prompts (`share`), then every rank gathers all of it, so a
group's advantages see the whole group on any mesh. Its completions are permuted once, seeded by
(train.seed, generation), when a generation feeds several optimizer steps (TRL shuffles its generation
batch too, with its process's RNG), then cut in order: step k takes positions [k·S, (k+1)·S) of that
order (S = train.global_batch_size), micro-step j of it [j·M, (j+1)·M) (M = micro batch × dp) and dp
rank r of that its micro-batch's completions: which completions a step trains on does not depend on
the mesh. The generation is Python values, saved with each checkpoint (`state`): a run resumed in the
middle of a generation, on any mesh, trains on the same completions, advantages and old log-probs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtrain.data.prompts import Rollout

TOKEN_SEED = 1_000_003  # the generation permutation's seed: train.seed · TOKEN_SEED + generation


@dataclass
class Generation:
    """A generation (the module's docstring); each list runs over its completions, prompt-major."""

    index: int  # the run's generations count from 0
    step: int  # its first optimizer step (from 0)
    prompts: list[dict[str, Any]]  # B: ids, record ({"prompt", "columns"}), index (the data example)
    ids: list[list[int]]
    truncated: list[bool]
    rewards: list[list[float]]  # [completion][function], NaN: skipped
    advantages: list[float]
    order: list[int]  # the permutation of the positions before the steps are cut
    sampling_logps: list[list[float]] | None = None  # the generator's, where it has them (vLLM)
    tokens: dict[str, list[list[float]]] = field(default_factory=dict)  # old_logps, ref_logps, is_ratio

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def rollout(self, position: int, num_generations: int, mask_truncated: bool) -> Rollout:
        """Completion `position` as the loss takes it."""
        return Rollout(
            prompt_ids=self.prompts[position // num_generations]["ids"],
            ids=self.ids[position],
            advantage=self.advantages[position],
            trained=not (mask_truncated and self.truncated[position]),
            tokens={key: values[position] for key, values in self.tokens.items()} or None,
        )


def share(count: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [start, stop) of `count` prompts, the shares as even as can be."""
    return count * rank // world, count * (rank + 1) // world


def permutation(size: int, seed: int, generation: int, shuffled: bool) -> list[int]:
    """The order a generation's completions are cut into steps: seeded by (seed, generation), or the
    identity when one step takes the whole generation (the order of one step's rows is immaterial)."""
    if not shuffled:
        return list(range(size))
    generator = torch.Generator().manual_seed(seed * TOKEN_SEED + generation)
    return torch.randperm(size, generator=generator).tolist()


def step_positions(
    generation: Generation, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """This dp rank's micro-batches of the generation's step `step` (from 0 within it): each a list of
    completion positions."""
    order = generation.order[step * global_batch : (step + 1) * global_batch]
    per_micro_step = micro_batch * dp_size
    return [
        order[start + dp_rank * micro_batch : start + (dp_rank + 1) * micro_batch]
        for start in range(0, global_batch, per_micro_step)
    ]


def importance_ratio(
    old: list[list[float]], sampling: list[list[float]], mode: str, low: float | None, high: float | None
) -> list[list[float]]:
    """TRL's vLLM importance-sampling correction, per completion token: exp(old − sampling) per token
    (`token_*`) or exp(Σ_t (old − sampling)) per completion (`sequence_*`, every token the same);
    outside [low, high] set to 0 (`*_mask`) or clamped (`*_truncate`). A sampling log-prob that is NaN
    adds 0."""
    ratios = []
    for old_logps, sampled in zip(old, sampling, strict=True):
        gap = torch.nan_to_num(torch.tensor(old_logps) - torch.tensor(sampled[: len(old_logps)]), nan=0.0)
        ratio = torch.exp(gap.sum()).expand_as(gap) if mode.startswith("sequence") else torch.exp(gap)
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=low, max=high)
        else:
            outside = (ratio < (-math.inf if low is None else low)) | (
                ratio > (math.inf if high is None else high)
            )
            ratio = ratio.masked_fill(outside, 0.0)
        ratios.append(ratio.tolist())
    return ratios


class RolloutsFile:
    """<run dir>/rollouts.jsonl (rank 0): a line per prompt of each generation, in the file engine's
    format (`prompt`, `completions` as token ids: replayed exactly by rollout.engine=file) with what
    the run made of them: decoded texts, rewards (weighted, and per function), advantages, the
    generation and its first step (from 1). A run resumed at step s keeps the lines of the generations
    that started by then and drops the rest (generated again)."""

    def __init__(self, path: Path, start_step: int) -> None:
        kept = []
        if path.is_file() and start_step > 0:
            for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
                try:
                    if json.loads(line)["step"] <= start_step and line.endswith("\n"):
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text("".join(kept), encoding="utf-8")
        os.replace(partial, path)
        self.file = path.open("a", encoding="utf-8")

    def write(self, generation: Generation, texts: list[str], rewards: list[float], names: list[str]) -> None:
        group = len(generation.ids) // len(generation.prompts)
        for b, prompt in enumerate(generation.prompts):
            rows = range(b * group, (b + 1) * group)
            line = {
                "prompt": prompt["record"]["prompt"],
                "completions": [generation.ids[i] for i in rows],
                "texts": [texts[i] for i in rows],
                "rewards": [finite(rewards[i]) for i in rows],
                "rewards_per_func": {
                    name: [finite(generation.rewards[i][k]) for i in rows] for k, name in enumerate(names)
                },
                "advantages": [generation.advantages[i] for i in rows],
                "truncated": [generation.truncated[i] for i in rows],
                "example": prompt["index"],
                "generation": generation.index,
                "step": generation.step + 1,
            }
            self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def finite(value: float) -> float | None:
    """JSON has no NaN: a skipped reward is null."""
    return None if math.isnan(value) else value
