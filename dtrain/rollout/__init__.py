"""Rollout engines: where an online objective's completions come from (dtrain.grpo; dtrain.distill's
on-policy steps). One seam, `Engine`: it gets the policy's current weights (`sync`) and a rank's
prompts, and returns each prompt's completions, with the generator's log-probs where it has them.

- `hf` (hf.py): transformers' `generate` on a copy of the policy, on CPU and GPU;
- `vllm` (vllm.py): vLLM colocated with the trainer (GPU; the optional `dtrain[vllm]` extra);
- `file` (file.py): completions read from a JSONL, `{"prompt": ..., "completions": [...]}` per prompt
  in data order: replaying a run's own rollouts (every run writes them), completions sampled
  elsewhere, and the reference tests' fixed completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Prompt:
    """One prompt of a rank's share of a generation."""

    index: int  # its example's index in the dataset: names it in errors and seeds its sampling
    ids: list[int]  # its token ids, as the policy reads them
    record: Any  # the prompt as the data give it (a string, or chat messages): what a file is matched on


@dataclass
class Completion:
    """One sampled completion of a prompt."""

    ids: list[int]  # its token ids, the EOS included when it ended with one
    truncated: bool  # stopped at max_completion_length without an EOS
    logprobs: list[float] | None = None  # the generator's log-probability of each id, where it has them


class Engine(Protocol):
    """Where completions come from (the module's docstring lists the engines)."""

    def sync(self, model: torch.nn.Module) -> None:
        """The policy's current weights reach the generator: a collective, every rank calls it."""

    def generate(self, prompts: list[Prompt], generation: int) -> list[list[Completion]]:
        """Each of this rank's `prompts`' completions (num_generations each), sampled with the run's
        settings; `generation` counts the run's generations from 0 (with each prompt's index and the
        run's seed it seeds the sampling, so a completion does not depend on the mesh)."""
