"""Records → token ids and a per-token supervision mask, one `Format` per data.format in FORMATS.

Formats: `prompt_response` (one user turn, one assistant turn, optional system), `messages` (a list
of {role, content}; loss on every assistant turn), `text` (loss on every token), `preference`
(dtrain.dpo's pairs: a prompt and its chosen and rejected completions, tokenized as TRL's DPOTrainer
tokenizes them; `Preference` below), `prompt` (dtrain.grpo's prompts alone, tokenized as TRL's
GRPOTrainer tokenizes them; `PromptOnly` below) and `prompt_completion` (dtrain.distill's: a prompt
and its completion, tokenized as TRL's GKDTrainer and DistillationTrainer do; `PromptCompletion`
below). The chat formats go through the tokenizer's chat template: the assistant tokens come from
the template's `{% generation %}` markers when it has them; otherwise from rendering each prompt
alone, which must be a token-level prefix of the full rendering (raises if not: templates and BPE
merges at the seam make a string-level prefix mis-mask). Adding a format is adding a class and its
FORMATS entry here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import datasets
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
# A pair: a completion with no token at all (an empty list of messages; dropped, where TRL scores a
# log-probability of 0), and one whose chosen and rejected completions are the same tokens within
# max_len: kept, as TRL keeps it, but it has no preference to learn (zero gradient of every
# preference loss), so a dataset of nothing else is refused.
EMPTY_COMPLETION, SAME = "empty completion", "chosen = rejected"
KEPT = (OK, TRUNCATED, SAME)
NOTHING_TO_LEARN = (SAME,)  # kept, but a source needs one example that is not
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_IDS = datasets.Sequence(datasets.Value("int32"))
# The tokenized dataset's columns: an SFT format's, and the preference format's (a pair).
FEATURES = datasets.Features(
    {"input_ids": _IDS, "mask": datasets.Sequence(datasets.Value("int8")), "length": datasets.Value("int32")}
    | {"status": datasets.Value("string")}
)
PAIR_FEATURES = datasets.Features(
    {"prompt_ids": _IDS, "chosen_ids": _IDS, "rejected_ids": _IDS, "length": datasets.Value("int32")}
    | {"status": datasets.Value("string")}
)
COMPLETION_FEATURES = datasets.Features(
    {"prompt_ids": _IDS, "completion_ids": _IDS, "prompt": datasets.Value("string")}
    | {"length": datasets.Value("int32"), "status": datasets.Value("string")}
)

# dtrain.grpo's prompts: the prompt's ids and the whole record as JSON (its other columns reach the
# reward functions).
PROMPT_FEATURES = datasets.Features(
    {"prompt_ids": _IDS, "record": datasets.Value("string"), "length": datasets.Value("int32")}
    | {"status": datasets.Value("string")}
)


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


class Settings(NamedTuple):
    """What shapes a source's tokenized examples besides the record."""

    source: Source
    tokenizer: PreTrainedTokenizerBase
    max_len: int
    overlong: str  # data.overlong: truncate | drop


class Format:
    """How a record reads: the columns it needs and the record as token ids with a supervision mask.

    A new format is a subclass here with its `name`, its `keys` and `tokenize` (or `messages`, for a
    ChatFormat), and an instance in FORMATS; data.format=NAME then selects it (the config check
    reads FORMATS). Bump pipeline.TOKENIZE_VERSION when a format changes what it writes."""

    name: str
    keys: tuple[str, ...]  # the source fields (data.*_key) naming the columns it reads
    optional_keys: tuple[str, ...] = ()  # ... and those naming a column it reads when set
    features = FEATURES  # the columns `example` writes

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

    def example(self, record: dict[str, Any], where: str, settings: Settings) -> dict[str, Any]:
        """One row of the tokenized dataset (`features`): input_ids, mask (supervised tokens), length,
        status."""
        ids, mask = self.tokenize(record, settings.source, settings.tokenizer, where)
        max_len, overlong = settings.max_len, settings.overlong
        if len(ids) != len(mask):
            raise ValueError(f"format {self.name!r} gave {len(ids)} token ids and {len(mask)} mask values")
        status = OK if ids else EMPTY
        if len(ids) > max_len:
            status = TRUNCATED if overlong == "truncate" else OVERLONG
            ids, mask = ids[:max_len], mask[:max_len]
        # A token is a target of the loss from the one before it: the first token never is.
        if status in KEPT and not any(mask[1:]):
            status = NO_TARGET
        return {"input_ids": ids, "mask": mask, "length": len(ids), "status": status}


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


def checked_messages(messages: Any, key: str, where: str) -> list[dict[str, str]]:
    """A record's list of {role, content} under `key` (other fields dropped); a ConfigError naming
    the message if it is not one."""
    if not isinstance(messages, list):
        raise ConfigError(f"{where}: {key!r} must be a list of {{role, content}}")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}, message {turn}: needs a role and a string content, got {message!r}")
        if message.get("role") not in ROLES:
            role = message.get("role")
            raise ConfigError(f"{where}, message {turn}: unknown role {role!r} (expected one of {ROLES})")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class Messages(ChatFormat):
    """A list of {role, content}; loss on every assistant turn."""

    name = "messages"
    keys = ("messages_key",)

    def messages(self, record: dict[str, Any], source: Source, where: str) -> list[dict[str, str]] | None:
        messages = checked_messages(record[source.messages_key], source.messages_key, where)
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


class Preference(Format):
    """A preference pair (dtrain.dpo), tokenized token for token as TRL 1.16's DPOTrainer does.

    Explicit prompt: `input_key` (the prompt), `chosen_key`, `rejected_key`, each a string or each a
    list of {role, content}. Implicit prompt (no `input_key` column, or a string prompt beside
    conversations): chosen and rejected are whole conversations (or strings) and the prompt is their
    longest shared prefix of messages (of characters, TRL's `extract_prompt`), which must end where
    both continue with an assistant turn. Conversations: the prompt rendered by the chat template with
    the generation prompt, prompt + chosen and prompt + rejected without; each completion is what
    follows the longest token prefix that rendering shares with both (so it holds the template's
    end-of-turn tokens), no EOS added. Strings: the tokenizer on the text, the EOS text appended to
    chosen and rejected unless they end with it. Each sequence (prompt + completion) is cut to
    data.max_len, the prompt kept whole (TRL's `keep_start`); a pair whose prompt alone fills
    data.max_len has no completion token left and is dropped (data.overlong=drop: any overlong pair)."""

    name = "preference"
    keys = ("chosen_key", "rejected_key")
    features = PAIR_FEATURES

    def pair(self, record: dict[str, Any], source: Source, where: str) -> tuple[Any, Any, Any]:
        """(prompt, chosen, rejected): three strings or three lists of {role, content}."""
        sides = []
        for key in ("chosen_key", "rejected_key"):
            column = getattr(source, key)
            value = record.get(column)
            if value is None:
                raise ConfigError(f"{where}: key {column!r} is missing or null")
            sides.append(
                value if isinstance(value, str) else checked_messages(value, column, f"{where} {column}")
            )
        chosen, rejected = sides
        if isinstance(chosen, str) != isinstance(rejected, str):
            raise ConfigError(f"{where}: chosen and rejected must both be strings or both lists of messages")
        prompt = record.get(source.input_key)
        if prompt is not None and isinstance(prompt, str) == isinstance(chosen, str):
            if not isinstance(prompt, str):
                prompt = checked_messages(prompt, source.input_key, f"{where} {source.input_key}")
            return prompt, chosen, rejected
        return implicit_prompt(chosen, rejected, where)

    def example(self, record: dict[str, Any], where: str, settings: Settings) -> dict[str, Any]:
        tokenizer, max_len, overlong = settings.tokenizer, settings.max_len, settings.overlong
        prompt, chosen, rejected = self.pair(record, settings.source, where)
        if isinstance(chosen, str):
            eos = tokenizer.eos_token
            chosen, rejected = (text if text.endswith(eos) else text + eos for text in (chosen, rejected))
            prompt_ids, *full = (
                list(tokenizer(text=text)["input_ids"])
                for text in (prompt, prompt + chosen, prompt + rejected)
            )
        else:
            prompt_ids = chat_ids(tokenizer, prompt, where, generation_prompt=True)
            full = [chat_ids(tokenizer, prompt + side, where) for side in (chosen, rejected)]
        shared = min(common_prefix_length(prompt_ids, ids) for ids in full)
        prompt_ids = prompt_ids[:shared]
        completions = [ids[shared:] for ids in full]
        longest = max(len(ids) for ids in full)
        status = OK if longest <= max_len else TRUNCATED if overlong == "truncate" else OVERLONG
        if not all(completions):  # nothing after the prompt: an empty list of messages
            status = EMPTY_COMPLETION
        completions = [ids[: max(0, max_len - shared)] for ids in completions]
        if status in KEPT and not all(completions):  # the prompt fills max_len (TRL drops these too)
            status = NO_TARGET
        elif status in KEPT and completions[0] == completions[1]:
            status = SAME
        return {
            "prompt_ids": prompt_ids,
            "chosen_ids": completions[0],
            "rejected_ids": completions[1],
            "length": 2 * len(prompt_ids) + sum(len(ids) for ids in completions),
            "status": status,
        }


def implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """TRL's extract_prompt: the prompt is chosen's and rejected's longest shared prefix (messages, or
    characters, then less a space that starts the completions), which must be their whole prompt: the
    first messages where they differ are assistant turns (or the last one when they do not differ)."""
    end = 0
    for end in range(min(len(chosen), len(rejected))):
        if chosen[end] != rejected[end]:
            if end > 0 and chosen[end - 1] == " ":  # strings: the completion keeps its leading space
                end -= 1
            break
    if end == 0 and chosen == rejected:
        raise ConfigError(f"{where}: chosen and rejected are the same, with no assistant turn to compare")
    if end == 0:
        raise ConfigError(
            f"{where}: chosen and rejected share no prompt (implicit prompt: they must start alike)"
        )
    if not isinstance(chosen, str):
        roles = {side[end]["role"] for side in (chosen, rejected) if end < len(side)}
        if roles != {"assistant"}:
            raise ConfigError(
                f"{where}: chosen and rejected disagree at message {end} (role {sorted(roles)}), before "
                "their assistant turn: in the implicit prompt format both hold the same prompt"
            )
    return chosen[:end], chosen[end:], rejected[end:]


def chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    where: str,
    generation_prompt: bool = False,
) -> list[int]:
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )
    except Exception as error:  # the template's own raise_exception(), jinja errors
        raise ConfigError(f"{where}: the chat template failed: {error}") from error
    return list(rendered["input_ids"])


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


class PromptOnly(Format):
    """A prompt alone (dtrain.grpo), TRL's prompt-only format: `input_key` holds a string or a list of
    {role, content}; every other column of the record goes with it to the reward functions (the
    `record` column keeps them as JSON: {"prompt": ..., "columns": {...}}). Tokenized as TRL 1.16's
    GRPOTrainer does: a string by the tokenizer with its special tokens (`add_special_tokens=True`),
    messages by the chat template with the generation prompt. Never truncated (TRL has no prompt
    length limit): dtrain.grpo refuses a prompt that leaves no room for grpo.max_completion_length in
    data.max_len (dtrain/data/prompts.py)."""

    name = "prompt"
    keys = ("input_key",)
    features = PROMPT_FEATURES

    def example(self, record: dict[str, Any], where: str, settings: Settings) -> dict[str, Any]:
        column, tokenizer = settings.source.input_key, settings.tokenizer
        prompt = record.get(column)
        if prompt is None:
            raise ConfigError(f"{where}: key {column!r} is missing or null")
        if isinstance(prompt, str):
            ids = list(tokenizer(text=prompt)["input_ids"])
        else:
            messages = checked_messages(prompt, column, where)
            ids = chat_ids(tokenizer, messages, where, generation_prompt=True)
        columns = {key: value for key, value in record.items() if key != column}
        return {
            "prompt_ids": ids,
            "record": json.dumps({"prompt": prompt, "columns": columns}, ensure_ascii=False, default=str),
            "length": len(ids),
            "status": OK if ids else EMPTY,
        }


class PromptCompletion(Format):
    """A prompt and its completion (dtrain.distill), tokenized as TRL 1.16 does: `prompt_ids`, and the
    `completion_ids` the loss scores (empty for a record with a prompt only: on-policy steps sample
    its completions); `prompt`, the prompt as the record gives it (JSON: what a rollout file's lines
    are matched on).

    A record holds a conversation under `messages_key` (GKDTrainer's format: the last message is the
    completion, the ones before it the prompt), or a prompt under `input_key` (a string or a list of
    {role, content}) and optionally its completion under `output_key` (a string, or a list of
    assistant messages). Conversations: the prompt rendered by the chat template with the generation
    prompt; the completion is what follows the longest token prefix that rendering shares with the
    whole conversation's (GKD's: the answer, the end-of-turn token and whatever the template writes
    after it; an empty answer still scores those). A string prompt: the tokenizer on the text, its
    special tokens added, no template (DistillationTrainer's standard prompts); its string completion
    `tokenizer(text, add_special_tokens=False)` + EOS (the ids a sampled completion has). Cut to
    data.max_len keeping the prompt whole (data.overlong=drop: any overlong record is dropped); a
    prompt that fills data.max_len leaves nothing to score and is dropped."""

    name = "prompt_completion"
    keys = ()  # a conversation or a prompt: which columns a record needs is checked record by record
    features = COMPLETION_FEATURES

    def parts(self, record: dict[str, Any], source: Source, where: str) -> tuple[Any, Any]:
        """(prompt, completion or None): strings, or lists of {role, content}."""
        conversation = record.get(source.messages_key)
        if conversation is not None:
            messages = checked_messages(conversation, source.messages_key, where)
            if len(messages) < 2 or messages[-1]["role"] != "assistant":
                raise ConfigError(
                    f"{where}: {source.messages_key!r} must end with an assistant message (the completion) "
                    "after at least one prompt message"
                )
            return messages[:-1], messages[-1:]
        prompt, completion = record.get(source.input_key), record.get(source.output_key)
        if prompt is None:
            raise ConfigError(
                f"{where}: key {source.input_key!r} is missing or null (and no conversation under "
                f"{source.messages_key!r})"
            )
        if not isinstance(prompt, str):
            prompt = checked_messages(prompt, source.input_key, where)
        if completion is not None and not isinstance(completion, str):
            completion = checked_messages(completion, source.output_key, where)
            if isinstance(prompt, str) or any(m["role"] != "assistant" for m in completion):
                raise ConfigError(
                    f"{where}: {source.output_key!r} as messages needs a conversational prompt and "
                    "assistant messages only"
                )
        return prompt, completion

    def example(self, record: dict[str, Any], where: str, settings: Settings) -> dict[str, Any]:
        tokenizer, max_len = settings.tokenizer, settings.max_len
        prompt, completion = self.parts(record, settings.source, where)
        if isinstance(prompt, str):
            prompt_ids = list(tokenizer(text=prompt)["input_ids"])
            completion_ids = []
            if completion is not None:
                completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
                completion_ids.append(tokenizer.eos_token_id)
        else:
            prompt_ids = chat_ids(tokenizer, prompt, where, generation_prompt=True)
            completion_ids = []
            if completion is not None:
                if isinstance(completion, str):
                    completion = [{"role": "assistant", "content": completion}]
                whole = chat_ids(tokenizer, prompt + completion, where)
                shared = common_prefix_length(prompt_ids, whole)
                prompt_ids, completion_ids = prompt_ids[:shared], whole[shared:]
        length = len(prompt_ids) + len(completion_ids)
        status = OK if length <= max_len else TRUNCATED if settings.overlong == "truncate" else OVERLONG
        completion_ids = completion_ids[: max(0, max_len - len(prompt_ids))]
        if status in KEPT and len(prompt_ids) >= max_len:  # nothing to score, nothing to sample after
            status = NO_TARGET
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "prompt": json.dumps(prompt, ensure_ascii=False),
            "length": len(prompt_ids) + len(completion_ids),
            "status": status,
        }


# data.format's choices, by name.
FORMATS: dict[str, Format] = {
    fmt.name: fmt
    for fmt in (PromptResponse(), Messages(), Text(), Preference(), PromptOnly(), PromptCompletion())
}


def tokenize_example(
    record: dict[str, Any],
    index: int,
    *,
    tokenizer: PreTrainedTokenizerBase,
    source: Source,
    max_len: int,
    overlong: str,
    places: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """One row of the tokenized dataset, by the source's format (its `features`). `places` names the
    example `index` in errors (sources.Places: FILE:LINE); without it, the source and the index."""
    settings = Settings(source, tokenizer, max_len, overlong)
    where = places(index) if places else f"{source.where} example {index}"
    return FORMATS[source.format].example(record, where, settings)
