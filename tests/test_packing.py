"""Packing: rows, labels and positions in one process; exactness and isolation of documents on the
2×2 mesh (tests/workers/packing_mesh.py, 4 gloo processes)."""

from __future__ import annotations

import random

import pytest
import torch

from dtrain.data.packing import build_row, efficiency, pack
from dtrain.loss import IGNORE
from tests.helpers import run_worker


@pytest.mark.slow
def test_packed_rows_on_the_mesh_match_one_by_one_and_keep_documents_apart(tmp_path):
    done = tmp_path / "done"
    result = run_worker(4, "packing_mesh", "--done", str(done), timeout=300)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]


def test_pack_is_deterministic_complete_and_within_max_len():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(500)]
    rows = pack(lengths, 40)
    assert rows == pack(list(lengths), 40)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 40 for row in rows)
    assert efficiency(lengths, rows, 40) > 0.95  # best-fit decreasing on uniform lengths


def test_row_restarts_positions_and_ignores_each_documents_last_position():
    documents = [([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1]), ([10, 11, 12], [0, 0, 1])]
    row = build_row(documents, max_len=10, pad_id=2)
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 2, 2]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]  # padding restarts nothing
    # labels[t] is the target at t; a document's last token predicts nothing (not the next document)
    assert row["labels"].tolist() == [6, 7, IGNORE, 9, IGNORE, IGNORE, 12, IGNORE, IGNORE, IGNORE]
    assert row["num_tokens"].item() == 8
    single = build_row(documents[:1], max_len=4, pad_id=2)
    assert single["position_ids"].tolist() == [0, 1, 2, 3]
    assert torch.equal(build_row([], 3, 2)["labels"], torch.full((3,), IGNORE))
