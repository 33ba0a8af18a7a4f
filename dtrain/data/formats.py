"""Records → token ids and a per-token supervision mask, one `Format` per data.format in FORMATS.

Formats: `prompt_response` (one user turn, one assistant turn, optional system), `messages` (a list
of {role, content}; loss on every assistant turn), `text` (loss on every token). The chat formats
go through the tokenizer's chat template: the assistant tokens come from the template's
`{% generation %}` markers when it has them; otherwise from rendering each prompt alone, which must
be a token-level prefix of the full rendering (raises if not: templates and BPE merges at the seam
make a string-level prefix mis-mask). Adding a format is adding a class and its FORMATS entry here.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dtrain.config import ConfigError, Source

ROLES = ("system", "user", "assistant")
# Why an example is kept or dropped (a column of the tokenized dataset, counted and logged).
OK, TRUNCATED = "ok", "truncated"
EMPTY, OVERLONG, NO_TARGET = (
    "empty response",
    "overlong (data.overlong=drop)",
    "no response token within max_len",
)
KEPT = (OK, TRUNCATED)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        raise ConfigError(f"model.tokenizer={path!r}: the tokenizer has no chat template")
    return tokenizer


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def has_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(_GENERATION.search(tokenizer.chat_template or ""))


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], where: str
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and, per token, whether it belongs to an assistant turn."""
    marked = has_generation_markers(tokenizer)
    full = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=marked
    )
    ids = list(full["input_ids"])
    if marked:
        return ids, [int(m) for m in full["assistant_masks"]]
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_length(tokenizer, messages[:turn], ids, True, where, turn)
        end = _prefix_length(tokenizer, messages[: turn + 1], ids, False, where, turn)
        mask[start:end] = [1] * (end - start)
    return ids, mask


def _prefix_length(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    ids: list[int],
    generation_prompt: bool,
    where: str,
    turn: int,
) -> int:
    """How many tokens of `ids` the rendering of `messages` alone covers (it must be a prefix)."""
    prefix = list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )["input_ids"]
    )
    if ids[: len(prefix)] != prefix:
        seam = next((i for i, (a, b) in enumerate(zip(prefix, ids, strict=False)) if a != b), len(ids))
        raise ConfigError(
            f"{where}: the chat template renders the conversation up to message {turn} differently alone "
            f"and inside the whole conversation (tokens differ at position {seam}), so the assistant "
            "tokens cannot be found by prefix; use a template with {% generation %} markers"
        )
    return len(prefix)


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Continued pretraining: bos + text + eos, whether or not the tokenizer adds them itself."""
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.bos_token_id is not None and ids[:1] != [tokenizer.bos_token_id]:
        ids.insert(0, tokenizer.bos_token_id)
    if ids[-1:] != [tokenizer.eos_token_id]:
        ids.append(tokenizer.eos_token_id)
    return ids


class Format:
    """How a record reads: the columns it needs and the record as token ids with a supervision mask.

    A new format is a subclass here with its `name`, its `keys` and `tokenize` (or `messages`, for a
    ChatFormat), and an instance in FORMATS; data.format=NAME then selects it (the config check
    reads FORMATS). Bump pipeline.TOKENIZE_VERSION when a format changes what it writes."""

    name: str
    keys: tuple[str, ...]  # the source fields (data.*_key) naming the columns it reads
    optional_keys: tuple[str, ...] = ()  # ... and those naming a column it reads when set

    def columns(self, source: Source) -> dict[str, str]:
        """The columns it reads, each under the source field that names it (e.g. input_key: 'prompt')."""
        keys = [*self.keys, *(key for key in self.optional_keys if getattr(source, key))]
        return {key: getattr(source, key) for key in keys}

    def tokenize(
        self, record: dict[str, Any], source: Source, tokenizer: PreTrainedTokenizerBase, where: str
    ) -> tuple[list[int], list[int]]:
        """Token ids and, per token, 1 where the loss learns it; ([], []) when there is nothing to
        learn. A record that cannot be read raises a ConfigError starting with `where`."""
        raise NotImplementedError


class ChatFormat(Format):
    """A record as chat messages, through the tokenizer's chat template: loss on the assistant turns."""

    def messages(self, record: dict[str, Any], source: Source, where: str) -> list[dict[str, str]] | None:
        """The record as [{role, content}]; None when it has no response to learn."""
        raise NotImplementedError

    def tokenize(
        self, record: dict[str, Any], source: Source, tokenizer: PreTrainedTokenizerBase, where: str
    ) -> tuple[list[int], list[int]]:
        messages = self.messages(record, source, where)
        if messages is None:
            return [], []
        try:
            return render(tokenizer, messages, where)
        except ConfigError:
            raise
        except Exception as error:  # the template's own raise_exception(), jinja errors
            raise ConfigError(f"{where}: the chat template failed: {error}") from error


class PromptResponse(ChatFormat):
    """One user turn and one assistant turn, after an optional system turn."""

    name = "prompt_response"
    keys = ("input_key", "output_key")
    optional_keys = ("system_key",)

    def messages(self, record: dict[str, Any], source: Source, where: str) -> list[dict[str, str]] | None:
        for column in self.columns(source).values():
            if record[column] is None:
                raise ConfigError(f"{where}: key {column!r} is missing or null")
        if not str(record[source.output_key]).strip():
            return None
        messages = [{"role": "user", "content": str(record[source.input_key])}]
        if source.system_key:
            messages.insert(0, {"role": "system", "content": str(record[source.system_key])})
        messages.append({"role": "assistant", "content": str(record[source.output_key])})
        return messages


class Messages(ChatFormat):
    """A list of {role, content}; loss on every assistant turn."""

    name = "messages"
    keys = ("messages_key",)

    def messages(self, record: dict[str, Any], source: Source, where: str) -> list[dict[str, str]] | None:
        messages = record[source.messages_key]
        if not isinstance(messages, list):
            raise ConfigError(f"{where}: {source.messages_key!r} must be a list of {{role, content}}")
        for turn, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise ConfigError(
                    f"{where}, message {turn}: needs a role and a string content, got {message!r}"
                )
            if message.get("role") not in ROLES:
                raise ConfigError(
                    f"{where}, message {turn}: unknown role {message.get('role')!r} (expected one of {ROLES})"
                )
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            return None
        return messages


class Text(Format):
    """Plain text, no chat template: bos + text + eos, loss on every token."""

    name = "text"
    keys = ("text_key",)

    def tokenize(
        self, record: dict[str, Any], source: Source, tokenizer: PreTrainedTokenizerBase, where: str
    ) -> tuple[list[int], list[int]]:
        text = record[source.text_key]
        if text is None:
            raise ConfigError(f"{where}: key {source.text_key!r} is null")
        if not str(text).strip():
            return [], []
        ids = text_ids(tokenizer, str(text))
        return ids, [1] * len(ids)


# data.format's choices, by name.
FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in (PromptResponse(), Messages(), Text())}


def tokenize_example(
    record: dict[str, Any],
    index: int,
    *,
    tokenizer: PreTrainedTokenizerBase,
    source: Source,
    max_len: int,
    overlong: str,
) -> dict[str, Any]:
    """One row of the tokenized dataset: input_ids, mask (supervised tokens), length, status."""
    fmt = FORMATS[source.format]
    ids, mask = fmt.tokenize(record, source, tokenizer, f"{source.where} example {index}")
    if len(ids) != len(mask):
        raise ValueError(f"format {fmt.name!r} gave {len(ids)} token ids and {len(mask)} mask values")
    status = OK if ids else EMPTY
    if len(ids) > max_len:
        status = TRUNCATED if overlong == "truncate" else OVERLONG
        ids, mask = ids[:max_len], mask[:max_len]
    # A token is a target of the loss from the one before it: the first token never is.
    if status in KEPT and not any(mask[1:]):
        status = NO_TARGET
    return {"input_ids": ids, "mask": mask, "length": len(ids), "status": status}
