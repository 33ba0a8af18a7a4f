"""The command line: bad configs fail fast with their message on every rank (no hang), and the
README's embedded-default command trains a model whose loss falls."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import ROOT, read_metrics, run, torchrun

pytestmark = pytest.mark.slow  # every test launches processes

SFT = ["-m", "dtrain.sft"]

# (overrides, processes, expected words of the message). Hydra owns unknown keys and wrong types.
BAD_CONFIGS = [
    (["train.max_stepz=3"], 1, "Key 'max_stepz' not in 'TrainConfig'"),
    (["train.max_steps=many"], 1, "Value 'many' of type 'str' could not be converted to Integer"),
    (["parallel.tp=2", "parallel.dp_shard=2"], 1, "but the world size is 1"),
    (["parallel.tp=1", "train.global_batch_size=24"], 2, "train.global_batch_size=24 is not divisible"),
    (
        ["+model.config.num_key_value_heads=3", "+model.config.num_attention_heads=6"],
        2,
        "num_key_value_heads=3 is not divisible by parallel.tp=2",
    ),
    (["data.max_len=33"], 2, "data.max_len=33 is not divisible by parallel.tp=2"),
    (["data.path=/nonexistent.jsonl"], 2, "data.path='/nonexistent.jsonl': no such file"),
    (["parallel.tp=1", "train.precision=fp16"], 1, "train.precision='fp16': must be one of bf16, fp32"),
]


@pytest.mark.parametrize("overrides,nproc,message", BAD_CONFIGS, ids=[c[2][:40] for c in BAD_CONFIGS])
def test_bad_config_fails_fast_with_its_message(tmp_path, overrides, nproc, message):
    args = [*overrides, f"hydra.run.dir={tmp_path}"]
    if nproc == 1:
        result = run([sys.executable, *SFT, *args], timeout=120)
    else:
        result = torchrun(nproc, *SFT, *args, timeout=120)
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-3000:]
    # torchrun prints its own traceback when a worker exits non-zero; dtrain's code must not crash.
    assert not re.search(r'File "[^"]*/dtrain/[^"]*", line', result.stdout), result.stdout[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_readme_command_trains_the_embedded_default(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "./launch/local.sh\n" in readme
    logs = tmp_path / "rank_logs"
    env = {"NPROC": "4", "LOG_DIR": str(logs)}
    result = run(["./launch/local.sh", f"hydra.run.dir={tmp_path}"], timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    records = read_metrics(tmp_path)
    for key in (
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens",
        "tokens_per_s",
        "step_time_s",
        "mem_peak_gib",
        "mfu",
    ):
        assert key in records[0], key
    assert records[-1]["step"] == 60
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    config = (tmp_path / "config.yaml").read_text()
    assert "tp: 2" in config and "${" not in config  # resolved
    assert (tmp_path / ".hydra").is_dir()
    assert (tmp_path / "sft.log").read_text().count("step 60/60") == 1  # rank 0 alone writes the log
    # Rank 0 keeps the console; ranks 1-3 write their own files, quiet unless something is wrong.
    assert "step 60/60" in result.stdout
    rank_dirs = sorted(path.parent.name for path in logs.glob("*/attempt_0/*/stderr.log"))
    assert rank_dirs == ["1", "2", "3"]
