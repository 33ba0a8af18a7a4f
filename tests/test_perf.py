"""Performance paths that must not change numerics: the chunked vocab-parallel loss on the 2×2 mesh
(tests/workers/perf_mesh.py, 4 gloo processes), and the planner showing its saving."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import MAX_LEN, ROOT, parity_config, torchrun

from dtrain.config import ConfigError, check_config
from dtrain.estimate.planner import plan
from dtrain.model import load_model_config


def test_chunked_loss_matches_the_unchunked_loss_and_gradients_on_2x2(tmp_path):
    done = tmp_path / "done"
    result = torchrun(4, str(ROOT / "tests" / "workers" / "perf_mesh.py"), "--done", str(done), timeout=300)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]


def test_planner_shows_the_chunked_loss_saving():
    """The planner runs the trainer's step: with loss_chunk the logits alive at once drop by the chunk
    factor (local sequence / chunk) and so does the step's peak (the logits dominate a tiny model)."""
    config = parity_config(None, dp=2, tp=2)
    config.model.config["vocab_size"] = 8192  # logits large enough to dominate the peak
    unchunked = plan(config, 4).step
    config.parallel.loss_chunk = 4
    chunked = plan(config, 4).step
    local_len = MAX_LEN // 2  # the sequence-parallel shard
    assert chunked.logits * (local_len // 4) == unchunked.logits, (chunked.logits, unchunked.logits)
    assert chunked.peak < unchunked.peak, (chunked.peak, unchunked.peak)


def test_negative_loss_chunk_names_the_key():
    config = parity_config(None, dp=1, tp=1)
    config.parallel.loss_chunk = -1
    with pytest.raises(ConfigError, match="parallel.loss_chunk=-1"):
        check_config(config, 1, load_model_config(config.model))


def test_bench_prints_one_table_of_every_variant():
    """Smoke only (no timed assertion): one invocation, one row per variant, ratio 1.00 for the first."""
    command = [sys.executable, "-m", "dtrain.bench", "--seq", "16", "--steps", "1", "--warmup", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("plain", "dtrain"))]
    assert len(rows) == 3 and rows[0].split()[-1] == "1.00", result.stdout
    assert "CPU figures" in result.stdout
