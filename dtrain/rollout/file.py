"""The `file` rollout engine (rollout.engine=file, rollout.path=FILE): completions read from a JSONL of
`{"prompt": ..., "completions": [G completions]}` a line, instead of sampled.

Line n holds the completions of the n-th prompt the run draws (its prompt stream: data.shuffle's seeded
order, one epoch after another), the file read again from its start when the run needs more lines:
with data.shuffle=false and a line per example, that is the data's own order, every epoch. A run's own
rollouts.jsonl (dtrain.objectives.grpo writes one) is in this format, in its order: replayed with the
same data and seed, it gives the same completions at every step.

A completion is a text or a list of token ids. A text is what a generator emits for it, TRL's rule:
its tokens (`add_special_tokens=False`), then EOS, cut to grpo.max_completion_length (a text that
fills them ends without EOS: truncated). Ids are taken as they are: 1 to max_completion_length of
them, no EOS before the last. A completion is truncated when its last id is neither an EOS id nor the
pad id (TRL's rule). A line whose prompt is not the run's prompt, or that does not hold
grpo.num_generations completions, fails naming FILE:LINE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from dtrain.config import ConfigError
from dtrain.rollout import Completion, Prompt


def comparable(prompt: Any) -> Any:
    """A prompt as two sources of it compare: a string, or its messages' roles and contents (a
    dataset's loader adds the keys other records have, as None)."""
    if isinstance(prompt, list):
        return [(m.get("role"), m.get("content")) if isinstance(m, dict) else m for m in prompt]
    return prompt


class FileEngine:
    """rollout.engine=file (the module's docstring). `per_generation`: prompts a generation;
    `first`: where this rank's share of each generation's prompts starts in it (the share is
    contiguous: the objective gives each rank the same one every generation)."""

    def __init__(
        self,
        path: Path,
        tokenizer: PreTrainedTokenizerBase,
        num_generations: int,
        max_completion_length: int,
        eos_token_ids: list[int],
        per_generation: int,
        first: int,
    ) -> None:
        self.path, self.tokenizer = path, tokenizer
        self.num_generations, self.max_length = num_generations, max_completion_length
        self.eos = set(eos_token_ids)
        self.ends = self.eos | ({tokenizer.pad_token_id} if tokenizer.pad_token_id is not None else set())
        self.per_generation, self.first = per_generation, first
        self.lines = read_lines(path, num_generations)

    def sync(self, model: torch.nn.Module) -> None:
        """Nothing to send: the completions are in the file."""

    def generate(self, prompts: list[Prompt], generation: int) -> list[list[Completion]]:
        out = []
        for place, prompt in enumerate(prompts):
            drawn = generation * self.per_generation + self.first + place
            number, line = self.lines[drawn % len(self.lines)]
            where = f"{self.path}:{number}"
            if comparable(line["prompt"]) != comparable(prompt.record):
                raise ConfigError(
                    f"{where}: its prompt {clip(line['prompt'])} is not the run's prompt {drawn} (data "
                    f"example {prompt.index}: {clip(prompt.record)}); line n holds the n-th prompt the run "
                    "draws (data.shuffle=false: the data's order)"
                )
            out.append(
                [self.completion(c, f"{where}, completion {i}") for i, c in enumerate(line["completions"])]
            )
        return out

    def completion(self, given: Any, where: str) -> Completion:
        """One completion as a generator would have returned it (the module's docstring)."""
        if isinstance(given, str):
            ids = list(self.tokenizer(given, add_special_tokens=False)["input_ids"])
            ids = (ids + [self.tokenizer.eos_token_id])[: self.max_length]
        else:
            ids = list(given)
            if not 0 < len(ids) <= self.max_length:
                raise ConfigError(
                    f"{where}: {len(ids)} token ids; a completion has 1 to "
                    f"grpo.max_completion_length={self.max_length}"
                )
        vocab = len(self.tokenizer)
        if any(not 0 <= token < vocab for token in ids):
            raise ConfigError(f"{where}: a token id outside the tokenizer's {vocab}")
        if any(token in self.eos for token in ids[:-1]):
            raise ConfigError(f"{where}: an EOS token before its last token (a generator stops at the first)")
        return Completion(ids=ids, truncated=ids[-1] not in self.ends)


def read_lines(path: Path, num_generations: int) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-empty line, each checked: a prompt, and G completions that
    are texts or lists of ints."""
    if not path.is_file():
        raise ConfigError(f"rollout.path={str(path)!r}: no such file")
    lines = []
    with path.open(encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(text)
            except ValueError as error:
                raise ConfigError(f"{where}: not JSON ({error})") from None
            if not isinstance(record, dict) or "prompt" not in record or "completions" not in record:
                raise ConfigError(
                    f'{where}: needs "prompt" and "completions" ({{"prompt": ..., "completions": [...]}})'
                )
            completions = record["completions"]
            if not isinstance(completions, list) or len(completions) != num_generations:
                count = len(completions) if isinstance(completions, list) else "no list of"
                raise ConfigError(
                    f"{where}: {count} completions; grpo.num_generations={num_generations} a prompt"
                )
            for i, completion in enumerate(completions):
                ids = isinstance(completion, list) and all(isinstance(t, int) for t in completion)
                if not (isinstance(completion, str) or ids):
                    raise ConfigError(
                        f"{where}, completion {i}: a text or a list of token ids, got {clip(completion)}"
                    )
            lines.append((number, record))
    if not lines:
        raise ConfigError(f"rollout.path={str(path)!r}: no lines")
    return lines


def clip(value: Any, width: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"
