"""Property-based tests of the data pipeline on random and hostile input (hypothesis, bounded
example counts): every record gives a clear ConfigError or a counted row, never another exception,
an overlong row, or a kept row without a target (which would make a NaN loss)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtrain.config import ConfigError, DataConfig
from dtrain.data.formats import EMPTY, KEPT, NO_TARGET, OVERLONG, load_tokenizer, tokenize_example
from dtrain.data.pipeline import prepare
from tests.helpers import TOKENIZER

MAX_LEN = 24
STATUSES = {*KEPT, EMPTY, NO_TARGET, OVERLONG}
TOKENIZER_ = load_tokenizer(str(TOKENIZER))

hostile_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=2000),  # huge, any unicode
    st.sampled_from(["", " ", "\n\t", "<|eos|>", "<|assistant|>", "{% generation %}", "\x00", "🦙" * 50]),
)
values = st.one_of(
    hostile_text,
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "", "ASSISTANT"]), "content": values}
    ),
    values,
)


def check(record: dict, data: DataConfig) -> None:
    (source,) = data.sources()
    try:
        row = tokenize_example(
            record, 7, tokenizer=TOKENIZER_, source=source, max_len=MAX_LEN, overlong=data.overlong
        )
    except ConfigError as error:
        assert "example 7" in str(error)  # the error says which example
        return
    assert row["status"] in STATUSES
    assert row["length"] == len(row["input_ids"]) == len(row["mask"]) <= MAX_LEN
    if row["status"] in KEPT:
        assert any(row["mask"][1:]), "a kept row must have a target"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=values, response=values, system=values, overlong=st.sampled_from(["truncate", "drop"]))
def test_prompt_response_records(prompt, response, system, overlong):
    data = DataConfig(path="fuzz.jsonl", system_key="system", overlong=overlong)
    check({"prompt": prompt, "response": response, "system": system}, data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.one_of(values, st.lists(message, max_size=5)))
def test_messages_records(messages):
    check({"messages": messages}, DataConfig(path="fuzz.jsonl", format="messages"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=values)
def test_text_records(text):
    check({"text": text}, DataConfig(path="fuzz.jsonl", format="text"))


line = st.one_of(
    st.fixed_dictionaries({"prompt": hostile_text, "response": hostile_text}).map(json.dumps),
    st.dictionaries(st.sampled_from(["prompt", "response", "other"]), values, max_size=3).map(json.dumps),
    st.text(max_size=20),  # not JSON at all
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(lines=st.lists(line, min_size=0, max_size=6))
def test_whole_files(tmp_path_factory, lines):
    """Through datasets: a file is either prepared into rows or refused with a ConfigError."""
    path = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    try:
        examples, _ = prepare(DataConfig(path=str(path), max_len=MAX_LEN), TOKENIZER_, seed=0)
    except ConfigError as error:
        assert str(path) in str(error) or "data.path" in str(error), error
        return
    assert len(examples) > 0
    for mask, length in zip(examples["mask"], examples["length"], strict=True):
        assert length <= MAX_LEN and any(mask[1:])


def test_the_fuzzers_reach_both_outcomes():
    """Guard against strategies that never produce an error, or never a row."""
    good = {"prompt": "sort: b a", "response": "a b", "system": None}
    with pytest.raises(ConfigError):
        (source,) = DataConfig(path="fuzz.jsonl", system_key="system").sources()
        tokenize_example(good, 7, tokenizer=TOKENIZER_, source=source, max_len=MAX_LEN, overlong="truncate")
    good["system"] = "be brief"
    row = tokenize_example(good, 7, tokenizer=TOKENIZER_, source=source, max_len=MAX_LEN, overlong="truncate")
    assert row["status"] in KEPT
