"""SFT data: JSONL prompt/response records → chat-templated token ids with loss on the response →
fixed-length micro-batches. The order is one seeded global stream, independent of the mesh: step s
uses global samples [s·G, (s+1)·G), each dp rank takes its contiguous slice, tp ranks the same one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dtrain.config import ConfigError, DataConfig

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    supervised: list[bool]  # per token: is it a target of the loss


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        raise ConfigError(f"model.tokenizer={path!r}: the tokenizer has no chat template")
    return tokenizer


def read_jsonl(path: str, keys: list[str]) -> list[dict]:
    """Records with the given keys; errors name the file, line and key."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"data.path={path!r}: no such file")
    records = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: malformed JSON ({error.msg})") from error
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            for key in keys:
                if key not in record:
                    raise ConfigError(
                        f"{path}:{number}: missing key {key!r} (data.input_key/output_key); "
                        f"the record has {sorted(record)}"
                    )
            records.append(record)
    if not records:
        raise ConfigError(f"data.path={path!r}: no records")
    return records


def tokenize(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> Example:
    """Render the conversation with the chat template; the last (assistant) message is supervised.

    With `{% generation %}` in the template the template marks the assistant tokens; otherwise the
    prompt is rendered alone and must be a token-level prefix of the full rendering."""
    full = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(full["input_ids"])
    mask = full.get("assistant_masks")
    if mask is not None and any(mask):
        return Example(ids, [bool(m) for m in mask])
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=True, return_dict=True, add_generation_prompt=True
    )["input_ids"]
    if ids[: len(prompt)] != list(prompt):
        raise ConfigError(
            "the chat template renders the prompt differently alone and before the response "
            "(tokens differ at the seam), so the response tokens cannot be found; "
            "use a template with {% generation %} markers"
        )
    return Example(ids, [False] * len(prompt) + [True] * (len(ids) - len(prompt)))


def load_examples(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    keys = [data.input_key, data.output_key] + ([data.system_key] if data.system_key else [])
    examples = []
    for record in read_jsonl(data.path, keys):
        messages = [{"role": "user", "content": str(record[data.input_key])}]
        if data.system_key:
            messages.insert(0, {"role": "system", "content": str(record[data.system_key])})
        messages.append({"role": "assistant", "content": str(record[data.output_key])})
        example = tokenize(tokenizer, messages)
        # Truncated examples keep what fits; those left with no target are dropped, never a NaN.
        if any(example.supervised[1 : data.max_len + 1]):
            examples.append(example)
    if not examples:
        raise ConfigError(f"data.path={data.path!r}: no example has a response token within data.max_len")
    return examples


def collate(examples: list[Example], max_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of max_len; labels already shifted (labels[t] is the target at t)."""
    input_ids = torch.full((len(examples), max_len), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), max_len), IGNORE, dtype=torch.long)
    for row, example in enumerate(examples):
        ids = example.input_ids[: max_len + 1]  # max_len inputs and the target of the last one
        inputs, targets = ids[:max_len], ids[1:]
        supervised = torch.tensor(example.supervised[1 : len(ids)])
        input_ids[row, : len(inputs)] = torch.tensor(inputs)
        labels[row, : len(targets)] = torch.where(supervised, torch.tensor(targets), IGNORE)
    position_ids = torch.arange(max_len).expand(len(examples), -1).contiguous()
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


class StepBatches:
    """The micro-batches of one dp rank for each optimizer step, from the global seeded stream."""

    def __init__(
        self,
        examples: list[Example],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        max_len: int,
        pad_id: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        self.examples = examples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.max_len = max_len
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._orders = {epoch: torch.randperm(len(self.examples), generator=generator).tolist()}
            else:
                self._orders = {epoch: list(range(len(self.examples)))}
        return self._orders[epoch]

    def _sample(self, global_index: int) -> Example:
        epoch, position = divmod(global_index, len(self.examples))
        return self.examples[self._order(epoch)[position]]

    def state_dict(self) -> dict:
        """The position in the stream is the step itself, restored with the training progress."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Step is 0-based. Returns global_batch / (micro × dp) micro-batches."""
        start = step * self.global_batch_size + self.dp_rank * self.per_rank
        mine = [self._sample(start + i) for i in range(self.per_rank)]
        return [
            collate(mine[i : i + self.micro_batch_size], self.max_len, self.pad_id)
            for i in range(0, self.per_rank, self.micro_batch_size)
        ]
