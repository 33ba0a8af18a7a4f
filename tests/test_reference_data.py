"""dtrain's data pipeline (`build_data`) against the independent rendering of tests/reference.py, row by
row, on the dataset, tokenizer and max_len the parity tests train on: every row of the epoch (token
ids, shifted labels, restarting positions, filled length), packed and unpacked, and the first global
batches of the seeded stream. The parity tests feed the reference's batches to HF and dtrain's own to
the mesh runs; this is where the two data paths are shown to be the same."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dtrain.config import TrainConfig
from dtrain.data.pipeline import build_data
from tests import distill_reference, grpo_reference, reference, tolerance
from tests.helpers import DATASET, GLOBAL_BATCH, MAX_LEN, STEPS, TOKENIZER, parity_config

pytestmark = pytest.mark.slow  # tokenizing the 4000 records twice (dtrain's map, the reference's loop)


# The parity runs' dataset and max_len, and the same records at max_len 12, where the rules the
# parity rows never meet apply (their longest document has 25 tokens): truncation, and the drop of a
# record whose prompt leaves no response token within max_len.
CASES = {
    "parity": (DATASET, MAX_LEN),
    "truncating": (DATASET, 12),
}


def reference_data(path: Path, max_len: int, packing: bool) -> reference.Data:
    seed = parity_config(None, 1, 1).train.seed
    return reference.Data(path=path, tokenizer=TOKENIZER, max_len=max_len, packing=packing, seed=seed)


def dtrain_loader(path: Path, max_len: int, packing: bool, global_batch: int = GLOBAL_BATCH):
    config = parity_config(None, dp=1, tp=1)
    config.data.path, config.data.max_len, config.data.packing = str(path), max_len, packing
    one_batch = TrainConfig(
        global_batch_size=global_batch, micro_batch_size=global_batch, seed=config.train.seed
    )
    return build_data(config.data, one_batch, AutoTokenizer.from_pretrained(TOKENIZER), 0, 1).train


def assert_row(built: dict, row: reference.Row, where: str) -> None:
    assert torch.equal(built["input_ids"], row.input_ids), f"{where}: input_ids"
    assert torch.equal(built["labels"], row.labels), f"{where}: labels"
    assert torch.equal(built["position_ids"], row.position_ids), f"{where}: position_ids"
    assert int(built["num_tokens"]) == (row.spans[-1][1] if row.spans else 0), f"{where}: num_tokens"


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("case", CASES)
def test_build_data_gives_the_reference_rows_and_stream(case, packing):
    path, max_len = CASES[case]
    data = reference_data(path, max_len, packing)
    expected = reference.rows(data)
    loader = dtrain_loader(path, max_len, packing)
    assert len(loader.rows) == len(expected)
    for index, row in enumerate(expected):
        assert_row(loader.rows[index], row, f"row {index}")
    batches = reference.stream(data, GLOBAL_BATCH)
    for step in range(1, STEPS + 1):
        (built,) = loader.next_step()
        for position, row in enumerate(next(batches)):
            assert_row(
                {key: value[position] for key, value in built.items()}, row, f"step {step} row {position}"
            )


def test_the_truncating_case_truncates_and_drops():
    """A check of the check: at max_len 12 some documents are cut to 12 tokens with labels left and
    some records are dropped; at the parity max_len packed rows hold several documents."""
    documents = reference.examples(reference_data(DATASET, 12, False))
    records = sum(1 for line in DATASET.read_text().splitlines() if line.strip())
    assert 0 < records - len(documents) < records
    assert any(len(doc.input_ids) == 12 for doc in documents)
    assert max(len(row.spans) for row in reference.rows(reference_data(DATASET, MAX_LEN, True))) > 1


def test_odd_records_are_dropped_alike(tmp_path):
    """Empty and blank responses are dropped; a response whose text the tokenizer merges with the
    template's markers keeps the template's mask; every row equal, over more than one epoch."""
    records = [
        {"prompt": "sort: b a", "response": "a b"},
        {"prompt": "sort: c", "response": ""},
        {"prompt": "sort: d c", "response": "   "},
        {"prompt": "", "response": "<|end|> x"},
        {"prompt": "sort: f e", "response": "e f"},
    ]
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    for packing in (False, True):
        data = reference_data(path, MAX_LEN, packing)
        expected = reference.rows(data)
        loader = dtrain_loader(path, MAX_LEN, packing, global_batch=2)
        assert len(loader.rows) == len(expected) == (3 if not packing else 1)
        batches = reference.stream(data, 2)
        for step in range(4):  # 8 stream rows: several epochs of the 3 (or 1) rows
            (built,) = loader.next_step()
            for position, row in enumerate(next(batches)):
                assert_row(
                    {k: v[position] for k, v in built.items()}, row, f"{packing=} step {step} row {position}"
                )


def test_the_reference_masks_what_the_template_marks():
    """The assistant mask is the tokenizer template's: the prompt is never a target, the response
    and the end-of-turn token the template puts in the assistant turn are."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    record = json.loads(DATASET.read_text().splitlines()[0])
    first = reference.examples(reference_data(DATASET, MAX_LEN, False))[0]
    supervised = [token for token in first.labels if token != reference.IGNORE]
    assert supervised[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(supervised[:-1]).split() == record["response"].split()
    assert first.labels.index(supervised[0]) == len(first.labels) - len(supervised) - 1  # all at the end


def absolute_imports(module) -> set[str]:
    """The modules a source file imports, read from its import statements (none relative)."""
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree)), module
    return imported


@pytest.mark.parametrize(
    "module", [reference, grpo_reference, distill_reference], ids=lambda module: module.__name__
)
def test_the_reference_imports_nothing_of_dtrain(module):
    """The independence of tests/reference.py, grpo_reference.py and distill_reference.py, read from
    their import statements: neither dtrain nor the tests' own modules (tests.helpers imports dtrain), but
    tests.tolerance (the AdamW allowance each sizes from its own run), which imports neither."""
    imported = absolute_imports(module)
    ours = {name for name in imported if name.split(".")[0] in ("dtrain", "tests")}
    assert imported and ours == {"tests.tolerance"}, imported
    own = {name for name in absolute_imports(tolerance) if name.split(".")[0] in ("dtrain", "tests")}
    assert not own, own
