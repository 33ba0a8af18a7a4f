"""dtrain.grpo's reward functions (grpo.reward_funcs, grpo.reward_weights): loaded by name before
launch, called as TRL 1.16's GRPOTrainer calls them.

A function is `module:function` (imported as Python imports: the run's working directory, then
PYTHONPATH), or a built-in name (BUILTINS). Its signature is TRL's: `f(prompts, completions,
completion_ids, **columns) -> list[float | None]`, one value a completion: `prompts` the data's
prompts as they are (strings or chat messages), `completions` the decoded completions (special tokens
skipped; for chat prompts each one `[{"role": "assistant", "content": text}]`), `completion_ids` their
token ids (EOS included), and every other column of the data as a keyword, one value a completion.
None skips that completion for that function (TRL's NaN). A function that cannot be imported fails
before launch; one that raises, returns the wrong count or a value that is not a number fails naming
the function and the example (`RewardError`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.config import ConfigError, SamplingConfig


def _texts(completions: Sequence[Any]) -> list[str]:
    """A completion's text, whether it came as a string or as one assistant message."""
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


def accuracy(completions: list, solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 where the completion's answer equals the `solution` column's, by math-verify (the field's
    verifier: LaTeX and plain answers, \\boxed{} first), 0.0 where not; None (skipped) where the
    solution itself cannot be parsed. TRL's `accuracy_reward`."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    extraction = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    rewards: list[float | None] = []
    for content, gold in zip(_texts(completions), solution, strict=True):
        gold_parsed = parse(gold, parsing_timeout=10)
        if not gold_parsed:
            rewards.append(None)
            continue
        answer = parse(
            content, extraction_config=[extraction], extraction_mode="first_match", parsing_timeout=10
        )
        rewards.append(float(verify(gold_parsed, answer, timeout_seconds=5)))
    return rewards


THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format(completions: list, **kwargs: Any) -> list[float]:
    """1.0 where the completion puts its reasoning in one `<think>...</think>` before the answer, else
    0.0. TRL's `think_format_reward`."""
    return [1.0 if THINK.match(text) else 0.0 for text in _texts(completions)]


def _kind(char: str) -> str:
    """A character's kind: a digit, a lowercase or an uppercase letter, or anything else."""
    if char.isdigit():
        return "0"
    if "a" <= char <= "z":
        return "a"
    return "A" if "A" <= char <= "Z" else "?"


def match(completions: list, solution: list[str], **kwargs: Any) -> list[float]:
    """Partial credit against the `solution` column, 0.0 to 1.0 (1.0: the solution itself): the mean of
    the share of the completion's characters (spaces aside) of a kind the solution has (digits for a
    sum, capitals for an uppercased word ...) and difflib's similarity ratio of the two stripped texts.
    The embedded default's verifiable reward: a random policy earns some of it from the first step, and
    can climb it by writing the right kind of answer before the right answer."""
    rewards = []
    for text, gold in zip(_texts(completions), solution, strict=True):
        text, gold = text.strip(), gold.strip()
        kinds = {_kind(char) for char in gold if char != " "}
        chars = [char for char in text if char != " "]
        kind = sum(_kind(char) in kinds for char in chars) / len(chars) if chars else 0.0
        similar = difflib.SequenceMatcher(None, text, gold, autojunk=False).ratio()
        rewards.append((kind + similar) / 2)
    return rewards


BUILTINS: dict[str, Callable[..., list]] = {"accuracy": accuracy, "format": think_format, "match": match}


@dataclass(frozen=True)
class RewardFunction:
    key: str  # where it is configured: grpo.reward_funcs[i]=NAME
    name: str  # its metrics' name (rewards/NAME/mean), TRL's: the function's __name__
    function: Callable[..., list]


def function_name(function: Callable) -> str:
    """TRL's name for a reward function: its __name__ (a partial: its function's; an object: its class's)."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def load(specs: Sequence[str]) -> list[RewardFunction]:
    """Each of grpo.reward_funcs: a built-in, or `module:function` imported; a ConfigError naming the
    one that cannot be."""
    if os.getcwd() not in sys.path and "" not in sys.path:  # the run's working directory, as `python -m`
        sys.path.insert(0, os.getcwd())
    loaded = []
    for i, spec in enumerate(specs):
        key = f"grpo.reward_funcs[{i}]={spec}"
        if spec in BUILTINS:
            if spec == "accuracy":
                try:
                    import math_verify  # noqa: F401
                except ImportError as error:
                    raise ConfigError(
                        f"{key}: needs math-verify ({error}): pip install math-verify"
                    ) from None
            loaded.append(RewardFunction(key, function_name(BUILTINS[spec]), BUILTINS[spec]))
            continue
        module_name, _, attribute = spec.partition(":")
        if not module_name or not attribute:
            raise ConfigError(f"{key}: not a built-in ({', '.join(BUILTINS)}) nor `module:function`")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # ImportError, or the module's own error while importing
            raise ConfigError(
                f"{key}: cannot import {module_name!r}: {type(error).__name__}: {error}"
            ) from None
        function = getattr(module, attribute, None)
        if not callable(function):
            raise ConfigError(f"{key}: module {module_name!r} has no function {attribute!r}")
        loaded.append(RewardFunction(key, function_name(function), function))
    return loaded


class RewardError(ValueError):
    """A reward function that raised or returned what is not one number (or None) a completion."""


@dataclass
class Scored:
    """What the reward functions are given for one batch of prompts and their completions."""

    prompts: list[Any]  # one a completion (each prompt repeated G times)
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]  # every other column, one value a completion
    examples: list[int]  # the data example of each completion (names it in errors)


def score(functions: Sequence[RewardFunction], batch: Scored) -> torch.Tensor:
    """[completions, functions] float32: each function's rewards, NaN where it returned None."""
    columns = [_call(function, batch) for function in functions]
    return torch.tensor(columns, dtype=torch.float32).T.reshape(len(batch.completions), len(functions))


def _call(function: RewardFunction, batch: Scored) -> list[float]:
    try:
        values = function.function(
            prompts=batch.prompts,
            completions=batch.completions,
            completion_ids=batch.completion_ids,
            **batch.columns,
        )
    except Exception as error:
        example = _failing_example(function, batch)
        raise RewardError(
            f"{function.key} raised {type(error).__name__}: {error} (data example {example})"
        ) from None
    values = list(values) if values is not None else []
    if len(values) != len(batch.completions):
        raise RewardError(
            f"{function.key} returned {len(values)} rewards for {len(batch.completions)} completions "
            f"(data examples {sorted(set(batch.examples))[:8]}): one a completion"
        )
    out = []
    for value, example in zip(values, batch.examples, strict=True):
        if value is None:
            out.append(math.nan)
            continue
        try:
            out.append(float(value))
        except (TypeError, ValueError):
            raise RewardError(
                f"{function.key} returned {value!r} for data example {example}: not a number"
            ) from None
    return out


def _failing_example(function: RewardFunction, batch: Scored) -> int | str:
    """The first example whose completions alone make `function` raise (else the batch's examples)."""
    for example in dict.fromkeys(batch.examples):
        rows = [i for i, e in enumerate(batch.examples) if e == example]
        try:
            function.function(
                prompts=[batch.prompts[i] for i in rows],
                completions=[batch.completions[i] for i in rows],
                completion_ids=[batch.completion_ids[i] for i in rows],
                **{key: [values[i] for i in rows] for key, values in batch.columns.items()},
            )
        except Exception:
            return example
    return ", ".join(str(e) for e in sorted(set(batch.examples))[:8])


def score_completions(
    functions: Sequence[RewardFunction],
    tokenizer: Any,
    prompts: list[dict[str, Any]],
    completions: list,
    settings: SamplingConfig,
) -> torch.Tensor:
    """[completions, functions]: a rank's prompts' completions (dtrain.rollout.Completion, G a prompt)
    scored by every function, as TRL calls them: the decoded texts (special tokens skipped; a chat
    prompt's as one assistant message), the ids, every other column (`prompts`: dtrain/data/prompts.py's,
    their records {"prompt", "columns"})."""
    count = settings.num_generations
    for prompt, found in zip(prompts, completions, strict=True):
        if len(found) != count:
            raise ValueError(
                f"the engine returned {len(found)} completions for data example {prompt['index']}"
            )
    if not prompts:
        return torch.zeros(0, len(functions))
    ids = [c.ids for found in completions for c in found]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    records = [p["record"] for p in prompts for _ in range(count)]
    chat = [not isinstance(r["prompt"], str) for r in records]
    batch = Scored(
        prompts=[r["prompt"] for r in records],
        completions=[
            [{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat, strict=True)
        ],
        completion_ids=ids,
        columns={key: [r["columns"].get(key) for r in records] for key in records[0]["columns"]},
        examples=[p["index"] for p in prompts for _ in range(count)],
    )
    return score(functions, batch)
