"""The data pipeline in one process: sources, masks against an independent rendering, drops, the
loader's global stream (coverage, resume on another dp size), and every bad input through the CLI."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections import Counter
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from dtrain.checks import check_config
from dtrain.config import ConfigError, DataConfig, TrainConfig
from dtrain.data.formats import (
    EMPTY,
    EMPTY_COMPLETION,
    FORMATS,
    NO_TARGET,
    OK,
    OVERLONG,
    SAME,
    TRUNCATED,
    Format,
    text_ids,
    tokenize_example,
)
from dtrain.data.loader import SFTLoader, eval_micro_batches
from dtrain.data.pipeline import build_data, prepare, to_rows
from dtrain.data.sources import load_split, places
from dtrain.model import load_model_config
from tests.helpers import (
    DATASET,
    TOKENIZER,
    dtrain_frames,
    parity_config,
    read_metrics,
    run,
    run_in_one_interpreter,
    torchrun,
)

TEMPLATE = (TOKENIZER / "chat_template.jinja").read_text()
NO_MARKERS = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# The generation prompt ends in a token that the assistant turn itself does not start with: a
# prefix rendering's length would mark one prompt token too many and lose the first response token.
SEAM = "{%- if add_generation_prompt -%}<|assistant|>"
MIS_MASKING = TEMPLATE.replace(SEAM, SEAM + ":")
MIS_MASKING_NO_MARKERS = NO_MARKERS.replace(SEAM, SEAM + ":")

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "sort: b a"},
    {"role": "assistant", "content": "a b"},
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba"},
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


def tokenizer_with(template: str):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = template
    return tokenizer


def independent_rendering(tokenizer, messages) -> tuple[list[int], list[int]]:
    """The shipped template written out by hand: special tokens between separately encoded texts."""
    ids, mask = [tokenizer.bos_token_id], [0]
    for message in messages:
        body = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        assistant = message["role"] == "assistant"
        end = tokenizer.eos_token_id if assistant else tokenizer.convert_tokens_to_ids("<|end|>")
        ids += [tokenizer.convert_tokens_to_ids(f"<|{message['role']}|>"), *body, end]
        mask += [0] + [int(assistant)] * (len(body) + 1)
    return ids, mask


def tokenize(tokenizer, record: dict, max_len: int = 1000, overlong: str = "truncate", **data) -> dict:
    (source,) = DataConfig(path="unused.jsonl", **data).sources()
    return tokenize_example(record, 0, tokenizer=tokenizer, source=source, max_len=max_len, overlong=overlong)


PROMPT_RESPONSE = {"system": "be brief", "prompt": "sort: b a", "response": "a b"}


@pytest.mark.parametrize("template", [TEMPLATE, NO_MARKERS, MIS_MASKING], ids=["markers", "prefix", "seam"])
@pytest.mark.parametrize("fmt", ["prompt_response", "messages"])
def test_supervised_tokens_are_exactly_the_assistant_tokens(template, fmt):
    tokenizer = tokenizer_with(template)
    if fmt == "messages":
        messages, record, keys = CONVERSATION, {"messages": CONVERSATION}, {}
    else:
        messages = CONVERSATION[:3]
        record, keys = PROMPT_RESPONSE, {"system_key": "system"}
    result = tokenize(tokenizer, record, format=fmt, **keys)
    assert (result["input_ids"], result["mask"]) == independent_rendering(tokenizer, messages)
    assert result["status"] == OK


def test_prefix_rendering_that_would_mis_mask_raises_naming_the_example():
    tokenizer = tokenizer_with(MIS_MASKING_NO_MARKERS)
    ids, mask = independent_rendering(tokenizer, CONVERSATION[1:3])
    prompt = tokenizer.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=True, tokenize=True)
    naive = [0] * len(prompt["input_ids"]) + [1] * (len(ids) - len(prompt["input_ids"]))
    assert naive != mask  # what masking by the prompt's length would have done
    with pytest.raises(ConfigError, match=r"example 0: .*differently alone.*generation"):
        tokenize(tokenizer, PROMPT_RESPONSE)


def test_text_is_supervised_everywhere_and_lengths_are_handled():
    tokenizer = tokenizer_with(TEMPLATE)
    text = tokenize(tokenizer, {"text": "hello world"}, format="text")
    assert text["input_ids"][0] == tokenizer.bos_token_id and text["input_ids"][-1] == tokenizer.eos_token_id
    assert set(text["mask"]) == {1}
    assert tokenize(tokenizer, {"text": " "}, format="text")["status"] == EMPTY
    assert tokenize(tokenizer, {"prompt": "q", "response": " "})["status"] == EMPTY
    long = {"prompt": "x " * 40, "response": "y"}
    assert tokenize(tokenizer, long, max_len=32)["status"] == NO_TARGET  # the response was cut off
    assert tokenize(tokenizer, long, max_len=32, overlong="drop")["status"] == OVERLONG
    cut = tokenize(tokenizer, {"prompt": "q", "response": "y " * 40}, max_len=32)
    assert cut["status"] == TRUNCATED and cut["length"] == 32


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"data.overlong": "cut"}, "data.overlong='cut': must be one of truncate, drop"),
        ({"data.format": "chat"}, "data.format='chat': must be one of"),
        ({"train.eval_every": 5}, "train.eval_every=5 needs an eval set"),
        ({"data.eval_fraction": 1.0}, "data.eval_fraction=1.0: must be in [0, 1)"),
        ({"data.mix": [{"path": "/no/such.jsonl"}]}, "data.mix[0].path='/no/such.jsonl': no such file"),
        ({"data.mix": [{"path": str(DATASET), "weight": 0}]}, "data.mix[0].weight=0.0: must be > 0"),
        (
            {"data.mix": [{"path": str(DATASET), "format": "chat"}]},
            "data.mix[0].format='chat': must be one of",
        ),
        ({"data.mix": [{"path": str(DATASET), "input_kye": "q"}]}, "data.mix[0].input_kye: unknown key"),
        (
            {"data.mix": [{"path": str(DATASET), "max_samples": "ten"}]},
            "data.mix[0].max_samples: Value 'ten'",
        ),
        ({"data.mix": [{"weight": 2}]}, "data.mix[0].path: missing"),
    ],
)
def test_bad_data_config_is_refused_before_launch(changes, message):
    config = parity_config(None, dp=1, tp=1)
    for key, value in changes.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)
    with pytest.raises(ConfigError) as error:
        check_config(config, 1, load_model_config(config.model))
    assert message in str(error.value)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RECORDS = [{"prompt": f"sort: {i} a", "response": f"a {i}"} for i in range(24)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "arrow", "folder", "saved"])
def test_local_sources_of_every_kind(tmp_path, kind):
    table = datasets.Dataset.from_list(RECORDS)
    path = tmp_path / f"data.{kind}"
    if kind in ("jsonl", "folder"):
        folder = tmp_path / "folder"
        folder.mkdir()
        write_jsonl(folder / "train.jsonl" if kind == "folder" else path, RECORDS)
        path = folder if kind == "folder" else path
    elif kind == "parquet":
        table.to_parquet(path)
    elif kind == "csv":
        table.to_csv(path, index=False)
    elif kind == "arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.data.schema) as writer:
            writer.write_table(table.data.table)
    else:
        table.save_to_disk(path)
    (source,) = DataConfig(path=str(path), max_samples=10).sources()
    loaded = load_split(source, "train")
    assert loaded["prompt"] == [r["prompt"] for r in RECORDS[:10]]
    # how errors and the start name example 3: the line it is in a file of lines (its text read back
    # from the file: the record itself), else the split and datasets' index
    name = places(source, "train", loaded)(3)
    if kind in ("jsonl", "folder", "csv"):
        file, line = name.rsplit(":", 1)
        text = Path(file).read_text().splitlines()[int(line) - 1]
        record = text.split(",")[0] if kind == "csv" else json.loads(text)
        assert record == (RECORDS[3]["prompt"] if kind == "csv" else RECORDS[3])
    else:
        assert name == f"{path} [train] example 3"


def test_examples_are_named_by_their_line_across_blank_lines_and_split_slices(tmp_path):
    """The line of a JSON-lines file an example is (blank lines skipped, as datasets skips them), in
    a sliced split too; a CSV record by the line it starts on (a quoted field may span lines)."""
    path = tmp_path / "d.jsonl"
    lines = ["", json.dumps(RECORDS[0]), "  ", json.dumps(RECORDS[1]), json.dumps(RECORDS[2])]
    path.write_text("\n".join(lines))
    (source,) = DataConfig(path=str(path)).sources()
    assert [places(source, "train", load_split(source, "train"))(i) for i in range(3)] == [
        f"{path}:{line}" for line in (2, 4, 5)
    ]
    assert places(source, "train[1:]", load_split(source, "train[1:]"))(0) == f"{path}:4"
    csv = tmp_path / "d.csv"
    csv.write_text('prompt,response\n"two\nlines",a\n\nb,c\n')
    (source,) = DataConfig(path=str(csv)).sources()
    loaded = load_split(source, "train")
    assert loaded["prompt"] == ["two\nlines", "b"]
    assert [places(source, "train", loaded)(i) for i in range(2)] == [f"{csv}:2", f"{csv}:5"]


def test_mix_weights_eval_split_and_eval_fraction(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", RECORDS[:12])
    second = write_jsonl(tmp_path / "b.jsonl", [{"q": "reverse: ab", "a": "ba"}] * 4)
    mix = [
        {"path": first, "weight": 1.0},
        {"path": second, "weight": 3.0, "input_key": "q", "output_key": "a"},
    ]
    tokenizer = tokenizer_with(TEMPLATE)
    examples, held_out = prepare(DataConfig(path="unused", mix=mix, eval_fraction=0.25), tokenizer, seed=0)
    assert held_out is not None and len(held_out) == 3 + 1  # a quarter of each source
    decoded = Counter("reverse" in tokenizer.decode(ids) for ids in examples["input_ids"])
    assert decoded == {True: 9, False: 3}  # 12 per epoch (9 + 3 left after eval), weights 3:1

    folder = tmp_path / "splits"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", RECORDS[:20])
    write_jsonl(folder / "test.jsonl", RECORDS[20:])
    examples, held_out = prepare(DataConfig(path=str(folder), eval_split="test"), tokenizer, seed=0)
    assert (len(examples), len(held_out)) == (20, 4)


class Shout(Format):
    """A format of the test's own: the text column upper-cased, loss on its second half only."""

    name = "shout"
    keys = ("text_key",)

    def tokenize(self, record, source, tokenizer, where):
        ids = text_ids(tokenizer, str(record[source.text_key]).upper())
        half = len(ids) // 2
        return ids, [0] * half + [1] * (len(ids) - half)


def test_a_format_added_to_the_registry_is_checked_and_tokenized_through_the_pipeline(tmp_path, monkeypatch):
    """The extension point: one Format object in FORMATS, and data.format / data.mix[i].format take it."""
    config = parity_config(None, dp=1, tp=1)
    model_config = load_model_config(config.model)
    config.data = DataConfig(path=write_jsonl(tmp_path / "s.jsonl", RECORDS[:4]), format="shout", max_len=32)
    with pytest.raises(ConfigError, match="data.format='shout': must be one of"):
        check_config(config, 1, model_config)
    monkeypatch.setitem(FORMATS, "shout", Shout())  # removed again after the test

    check_config(config, 1, model_config)
    tokenizer = tokenizer_with(TEMPLATE)
    with pytest.raises(ConfigError, match=r"missing key 'text' \(data.text_key, data.format=shout\)"):
        prepare(config.data, tokenizer, seed=0)

    config.data.path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    examples, _ = prepare(config.data, tokenizer, seed=0)
    for i, (ids, mask) in enumerate(zip(examples["input_ids"], examples["mask"], strict=True)):
        assert ids == text_ids(tokenizer, f"DOC {i}")
        assert mask == [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
    labels = to_rows(examples, config.data, tokenizer)[0]["labels"].tolist()
    length = len(examples["input_ids"][0])
    assert [t for t, label in enumerate(labels) if label != -100] == list(range(length // 2 - 1, length - 1))

    config.data.mix = [{"path": config.data.path}, {"path": config.data.path, "format": "text", "weight": 3}]
    check_config(config, 1, model_config)
    assert [source.format for source in config.data.sources()] == ["shout", "text"]


def test_tokenizing_in_two_processes_gives_the_same_examples_and_errors(tmp_path):
    tokenizer = tokenizer_with(TEMPLATE)
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    one, _ = prepare(DataConfig(path=path), tokenizer, seed=0)
    two, _ = prepare(DataConfig(path=path, num_proc=2), tokenizer, seed=0)
    assert one["input_ids"][:] == two["input_ids"][:] and one["mask"][:] == two["mask"][:]
    robot = [{"messages": CONVERSATION}] * 5 + [{"messages": [{"role": "robot", "content": "hi"}]}]
    path = write_jsonl(tmp_path / "m.jsonl", robot)
    with pytest.raises(ConfigError, match="m.jsonl:6, message 0: unknown role 'robot'"):
        prepare(DataConfig(path=path, format="messages", num_proc=2), tokenizer, seed=0)


@pytest.fixture(scope="module")
def rows_by_packing(tmp_path_factory):
    """Rows of 30 distinct examples, one per row and packed (so every row is recognisable)."""
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_cache"))
    path = write_jsonl(tmp_path_factory.mktemp("data") / "d.jsonl", [{"text": f"doc {i}"} for i in range(30)])
    tokenizer = tokenizer_with(TEMPLATE)
    result = {}
    for packing in (False, True):
        data = DataConfig(path=path, format="text", max_len=16, packing=packing)
        result[packing] = to_rows(prepare(data, tokenizer, seed=0)[0], data, tokenizer)
    return result


def loaders(rows, dp: int, micro: int = 1, workers: int = 0) -> list[SFTLoader]:
    return [
        SFTLoader(rows, global_batch_size=4, micro_batch_size=micro, dp_rank=r, dp_size=dp, seed=5,
                  shuffle=True, num_workers=workers)
        for r in range(dp)
    ]  # fmt: skip


def global_batches(ranks: list[SFTLoader], steps: int) -> list[list[tuple]]:
    """Each step's rows, micro-step by micro-step, dp rank 0's part of each first: the global batch in
    stream order (the epoch checks below then show the ranks disjoint and covering, and each
    micro-step's rows those of the stream's next global micro-batch whatever the dp size)."""
    batches = []
    for _ in range(steps):
        per_rank = [loader.next_step() for loader in ranks]
        micro_steps = zip(*per_rank, strict=True)
        batches.append([tuple(r) for micro in micro_steps for mb in micro for r in mb["input_ids"].tolist()])
    return batches


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_dp_ranks_cover_each_epoch_and_resume_on_another_dp_size(rows_by_packing, packing):
    rows = rows_by_packing[packing]
    every_row = sorted(tuple(rows[i]["input_ids"].tolist()) for i in range(len(rows)))
    steps = math.ceil(2 * len(rows) / 4) + 1
    stream = [row for batch in global_batches(loaders(rows, dp=2), steps) for row in batch]
    assert sorted(stream[: len(rows)]) == every_row  # epoch 0: every row once
    assert sorted(stream[len(rows) : 2 * len(rows)]) == every_row  # epoch 1 too, in another order
    assert stream[: len(rows)] != stream[len(rows) : 2 * len(rows)]

    stop = len(rows) // 4 + 1  # past the end of epoch 0: the epoch is part of the state
    first = loaders(rows, dp=2)
    done = global_batches(first, stop)
    states = [loader.state_dict() for loader in first]
    assert states[0] == states[1] and states[0]["epoch"] == 1
    for dp, micro, workers in ((2, 2, 0), (4, 1, 1), (1, 2, 0)):
        resumed = loaders(rows, dp=dp, micro=micro, workers=workers)
        for loader in resumed:
            loader.load_state_dict(json.loads(json.dumps(states[0])))  # plain JSON: any checkpoint format
        after = global_batches(resumed, steps - stop)
        assert [row for batch in done + after for row in batch] == stream, f"dp={dp}"


def test_eval_rows_are_split_over_dp_ranks_once_each_with_equal_counts(rows_by_packing):
    rows = rows_by_packing[False]
    per_rank = [eval_micro_batches(rows, 4, rank, 3) for rank in range(3)]
    assert len({len(batches) for batches in per_rank}) == 1  # same number of forwards everywhere
    seen = [tuple(r) for batches in per_rank for mb in batches for r in mb["input_ids"].tolist()]
    assert sorted(seen[: len(rows)]) == sorted(tuple(rows[i]["input_ids"].tolist()) for i in range(len(rows)))
    padding = [mb["labels"][i] for batches in per_rank for mb in batches for i in range(len(mb["labels"]))]
    assert all((labels == -100).all() for labels in padding[len(rows) :])


def test_loader_state_from_other_data_is_refused(rows_by_packing):
    state = loaders(rows_by_packing[True], dp=1)[0].state_dict()
    with pytest.raises(ConfigError, match="rows_per_epoch"):
        loaders(rows_by_packing[False], dp=1)[0].load_state_dict(state)


@pytest.mark.parametrize("key,value", [("seed", 6), ("shuffle", False)])
def test_loader_state_of_another_seed_or_order_is_refused(rows_by_packing, key, value):
    """The same rows in another order would not continue the saved stream (loaders(): seed 5, shuffled)."""
    rows = rows_by_packing[False]
    state = loaders(rows, dp=1)[0].state_dict()
    other = dict(
        rows=rows, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=1, seed=5, shuffle=True
    )
    with pytest.raises(ConfigError, match=f"{key}={state[key]!r} in the checkpoint, {value!r} now"):
        SFTLoader(**{**other, key: value}).load_state_dict(state)


# Bad input through the real CLI: (file contents or None, overrides, expected words of the message).
BAD_RECORD = '{"prompt": "sort: b a", bad json}\n'
BAD_INPUT = {
    "missing key": (None, ["data.input_key=question"], ["missing key 'question'", "['prompt', 'response']"]),
    "malformed JSON": ([RECORDS[0], BAD_RECORD], [], ["d.jsonl:2: malformed JSON"]),
    "empty file": ([], [], ["d.jsonl'", "the file is empty"]),
    "nothing left": ([{"prompt": "q", "response": ""}] * 3, [], ["no example left after filtering"]),
    "unknown role": (
        [{"messages": CONVERSATION}, {"messages": [{"role": "robot", "content": "hi"}]}],
        ["data.format=messages"],
        ["d.jsonl:2, message 0: unknown role 'robot'"],
    ),
    "hub id offline": (
        None,
        ["data.path=nobody/no_such_dataset"],
        ["nobody/no_such_dataset", "from the hub"],
    ),
}
SFT = [sys.executable, "-m", "dtrain.sft", "parallel.tp=1", "train.max_steps=2"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
BAD_MIX = {
    "unknown key": ("input_kye: q", "data.mix[0].input_kye: unknown key; an entry takes path, split,"),
    "wrong type": (
        "weight: heavy",
        "data.mix[0].weight: Value 'heavy' of type 'str' could not be converted to Float",
    ),
}


def cli_args(folder: Path, records, overrides) -> list[str]:
    """A command's overrides: its own data file in `folder` (unless it names data.path) and run folder."""
    path = DATASET if records is None else folder / "d.jsonl"
    if records is not None:
        path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    if not any(o.startswith("data.path=") for o in overrides):
        overrides = [f"data.path={path}", *overrides]
    return [*SFT[3:], *overrides, f"hydra.run.dir={folder}/run"]


def cli(tmp_path, records, overrides, nproc: int = 1) -> tuple[int, str]:
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    args = cli_args(tmp_path, records, overrides)
    if nproc == 1:
        result = run([*SFT[:3], *args], timeout=180, env=env)
    else:
        result = torchrun(nproc, *SFT[1:3], *args, timeout=180, env=env)
    return result.returncode, result.stdout


@pytest.fixture(scope="module")
def bad_commands(tmp_path_factory) -> dict[str, dict]:
    """Every one-process bad command of this file (BAD_INPUT, BAD_MIX), run by tests/workers/cli_many
    in one interpreter: `dtrain.sft.main()` with each argv, as `python -m dtrain.sft` runs it, without
    paying an interpreter's start-up per message. {name: {"returncode", "output"}}."""
    root = tmp_path_factory.mktemp("bad_cli")
    commands = {}
    for case, (records, overrides, _) in BAD_INPUT.items():
        folder = root / case.replace(" ", "_")
        folder.mkdir()
        commands[case] = cli_args(folder, records, overrides)
    for case, (entry, _) in BAD_MIX.items():
        folder = root / case.replace(" ", "_")
        folder.mkdir()
        commands[case] = cli_args(folder, None, [f"data.mix=[{{path: {DATASET}, {entry}}}]"])
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(root / "hf_cache")}
    results = run_in_one_interpreter(root / "cli_many", commands, env=env)
    for name, outcome in results.items():  # each folder is left as its command left it
        outcome["run_dir"] = root / name.replace(" ", "_") / "run"
    return results


def assert_refused_with(returncode: int, output: str, words: list[str]) -> None:
    assert returncode == 2, output[-3000:]
    for word in words:
        assert word in output, output[-3000:]
    assert not dtrain_frames(output), output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_through_the_cli_with_its_message(bad_commands, case):
    outcome = bad_commands[case]
    assert_refused_with(outcome["returncode"], outcome["output"], BAD_INPUT[case][2])


@pytest.mark.slow
def test_bad_input_reaches_both_ranks_of_2_processes(tmp_path):
    """The error found while rank 0 prepares the data reaches the other rank too: both exit with
    it instead of one waiting in a barrier (torchrun exits 1 when its workers do, naming their 2)."""
    records, overrides, words = BAD_INPUT["malformed JSON"]
    returncode, output = cli(tmp_path, records, overrides, nproc=2)
    assert returncode == 1 and re.search(r"exitcode\s*: 2 ", output), output[-3000:]
    assert_refused_with(2, output, words)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_MIX))
def test_a_bad_mix_entry_fails_through_the_cli_naming_its_key(bad_commands, case):
    """data.mix entries are checked with the rest of the config, before any process group: exit 2
    and one line naming data.mix[i].KEY (OmegaConf's own multi-line report does not reach the user)."""
    outcome = bad_commands[case]
    output = outcome["output"]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert outcome["returncode"] == 2 and len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"dtrain: error: {BAD_MIX[case][1]}"), output[-3000:]
    assert "full_key" not in output and not (outcome["run_dir"] / "metrics.jsonl").exists()


@pytest.mark.slow
def test_empty_and_truncated_responses_are_dropped_counted_and_packed_training_evaluates(tmp_path):
    records = RECORDS * 2 + [{"prompt": "q", "response": ""}, {"prompt": "x " * 40, "response": "y"}]
    overrides = ["data.packing=true", "data.eval_fraction=0.1", "train.eval_every=1"]
    overrides += ["train.global_batch_size=4", "train.micro_batch_size=2", "data.max_len=32"]
    returncode, output = cli(tmp_path, records, overrides)
    assert returncode == 0, output[-3000:]
    data = str(tmp_path / "d.jsonl")  # the last two records: lines 49 and 50 of cli's file
    assert f"dropped 1 {EMPTY} ({data}:49), 1 {NO_TARGET} ({data}:50)" in output, output[-3000:]
    assert f"(dropped: 1 {EMPTY}, 1 {NO_TARGET})" in output, output[-3000:]  # the start line's count
    assert "(packed), efficiency" in output
    lines = read_metrics(tmp_path / "run")
    steps = [line for line in lines if "loss" in line]
    evals = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in evals] == [1, 2]
    assert all(math.isfinite(line["loss"]) and line["tokens"] > 0 for line in steps)
    assert all(0.0 <= line["padding_fraction"] < 1.0 for line in steps)
    assert all(math.isfinite(line["eval_loss"]) for line in evals)
    assert torch.tensor([line["eval_tokens"] for line in evals]).unique().numel() == 1


def test_degenerate_pairs_are_counted_named_and_a_source_of_nothing_else_is_refused(tmp_path, caplog):
    """Preference pairs whose chosen and rejected are the same (given so, or implicit conversations
    that never diverge) are kept, as TRL keeps them, and named on the start as having nothing to
    learn; an empty completion is dropped as one (not as "no response token within max_len"); each
    named by its line (a blank line in the file skipped); a source of nothing but such pairs is
    refused before training (they would train at zero gradient)."""
    user, answer = [{"role": "user", "content": "hi"}], lambda text: [{"role": "assistant", "content": text}]
    pairs = [
        {"prompt": user, "chosen": answer("good"), "rejected": answer("bad")},
        {"prompt": user, "chosen": answer("same"), "rejected": answer("same")},
        {"prompt": user, "chosen": [], "rejected": answer("bad")},
        {"chosen": user + answer("x"), "rejected": user + answer("x")},  # implicit: never diverge
        {"prompt": user, "chosen": answer("good"), "rejected": answer("bad")},
    ]
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(pair) for pair in pairs]
    path.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    train = TrainConfig(global_batch_size=2, micro_batch_size=1)
    caplog.set_level(logging.INFO, logger="dtrain")
    data = build_data(DataConfig(path=str(path), format="preference", max_len=32), train, tokenizer, 0, 1)
    assert data.num_examples == 4
    line = (
        f"data: {path} [train]: 5 examples, 0 truncated to data.max_len=32, dropped 1 {EMPTY_COMPLETION} "
        f"({path}:4); kept with nothing to learn (as TRL keeps them): 2 {SAME} ({path}:2, {path}:5)"
    )
    assert line in caplog.text, caplog.text
    flagged = f"kept with nothing to learn: 2 {SAME}; dropped: 1 {EMPTY_COMPLETION}"
    assert data.examples() == f"4 examples ({flagged})"  # the start line's
    same = tmp_path / "same.jsonl"
    same.write_text("".join(line + "\n" for line in (lines[1], lines[3])))
    with pytest.raises(ConfigError, match=f"no example with anything to learn .*'{SAME}': 2"):
        build_data(DataConfig(path=str(same), format="preference", max_len=32), train, tokenizer, 0, 1)
