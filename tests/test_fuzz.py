"""Property-based tests of the data pipeline on random and hostile input (hypothesis, bounded
example counts): every record gives a clear ConfigError or a counted row, never another exception,
an overlong row, or a kept row without a target (which would make a NaN loss). Each property counts
its outcomes and requires both kept rows and refusals among them, so strategies that only ever
produced one kind (every record refused, say) would fail instead of passing vacuously."""

from __future__ import annotations

import json
from collections import Counter

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
# A well-formed conversation (user and assistant turns of short text) among the hostile ones, so that
# the messages property also sees rows kept (the hostile lists alone are almost always refused).
conversation = st.lists(
    st.tuples(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20)), min_size=1, max_size=2
).map(lambda turns: [{"role": r, "content": c} for u, a in turns for r, c in (("user", u), ("assistant", a))])


def check(record: dict, data: DataConfig) -> str:
    """The record's outcome: "refused" (a ConfigError naming the example) or the row's status, after
    checking the row's invariants."""
    (source,) = data.sources()
    try:
        row = tokenize_example(
            record, 7, tokenizer=TOKENIZER_, source=source, max_len=MAX_LEN, overlong=data.overlong
        )
    except ConfigError as error:
        assert "example 7" in str(error)  # the error says which example
        return "refused"
    assert row["status"] in STATUSES
    assert row["length"] == len(row["input_ids"]) == len(row["mask"]) <= MAX_LEN
    if row["status"] in KEPT:
        assert any(row["mask"][1:]), "a kept row must have a target"
        return "kept"
    return row["status"]


def bounded(max_examples: int) -> settings:
    """hypothesis' settings for these properties: derandomized (the examples follow from the test's
    name, not from a random seed or the local example database), so which outcomes occur, and
    assert_both_outcomes' verdict, are the same on every machine and run."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def assert_both_outcomes(outcomes: Counter) -> None:
    assert outcomes["kept"] > 0 and outcomes["refused"] > 0, dict(outcomes)


def test_prompt_response_records():
    outcomes = Counter()

    @bounded(80)
    @given(prompt=values, response=values, system=values, overlong=st.sampled_from(["truncate", "drop"]))
    def records(prompt, response, system, overlong):
        data = DataConfig(path="fuzz.jsonl", system_key="system", overlong=overlong)
        outcomes[check({"prompt": prompt, "response": response, "system": system}, data)] += 1

    records()
    assert_both_outcomes(outcomes)


def test_messages_records():
    outcomes = Counter()

    @bounded(80)
    @given(messages=st.one_of(values, st.lists(message, max_size=5), conversation))
    def records(messages):
        outcomes[check({"messages": messages}, DataConfig(path="fuzz.jsonl", format="messages"))] += 1

    records()
    assert_both_outcomes(outcomes)


def test_text_records():
    outcomes = Counter()

    @bounded(40)
    @given(text=values)
    def records(text):
        outcomes[check({"text": text}, DataConfig(path="fuzz.jsonl", format="text"))] += 1

    records()
    assert_both_outcomes(outcomes)


line = st.one_of(
    st.fixed_dictionaries({"prompt": hostile_text, "response": hostile_text}).map(json.dumps),
    st.dictionaries(st.sampled_from(["prompt", "response", "other"]), values, max_size=3).map(json.dumps),
    st.text(max_size=20),  # not JSON at all
)
# Files of well-formed records only (short non-blank text): with any hostile line a file is refused
# whole, so these are what give the property its prepared files.
good_line = st.fixed_dictionaries(
    {
        "prompt": st.text(min_size=1, max_size=20),
        "response": st.text(min_size=3, max_size=20).filter(str.strip),
    }
).map(json.dumps)


def test_whole_files(tmp_path_factory):
    """Through datasets: a file is either prepared into rows or refused with a ConfigError."""
    outcomes = Counter()

    @bounded(12)
    @given(lines=st.one_of(st.lists(line, max_size=6), st.lists(good_line, min_size=1, max_size=4)))
    def files(lines):
        path = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
        path.write_text("\n".join(lines), encoding="utf-8")
        try:
            examples, _ = prepare(DataConfig(path=str(path), max_len=MAX_LEN), TOKENIZER_, seed=0)
        except ConfigError as error:
            assert str(path) in str(error) or "data.path" in str(error), error
            outcomes["refused"] += 1
            return
        assert len(examples) > 0
        for mask, length in zip(examples["mask"], examples["length"], strict=True):
            assert length <= MAX_LEN and any(mask[1:])
        outcomes["kept"] += 1

    files()
    assert_both_outcomes(outcomes)
