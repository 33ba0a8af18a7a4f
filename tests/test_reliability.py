"""Faults through the real CLI on 2 gloo processes: a rank SIGKILLed under torchrun --max-restarts,
a poisoned (NaN) step skipped or aborting, a bad batch on one rank; each exit code as torchrun reports
it per worker. Each compares with an uninterrupted run where a curve is involved. The runs whose
launcher is not what is tested (that reference, the skipped step) are dtrain.sft's main() in forked
ranks (helpers.sft). Signals, rerunning the same command and the launch scripts' exit codes:
test_lifecycle.py."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import assert_adam_state_equal, read_metrics, sft, torchrun

pytestmark = pytest.mark.slow  # every test launches processes

STEPS = 6
SFT = ["-m", "dtrain.sft"]
ARGS = [
    "parallel.tp=1",
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "checkpoint.every=2",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("reference")
    result = sft(2, *ARGS, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:]
    return read_metrics(run_dir)


def assert_same_curve(records: list[dict], reference: list[dict], first_step: int) -> None:
    tail = {r["step"]: r["loss"] for r in records if r["step"] >= first_step}
    assert sorted(tail) == list(range(first_step, STEPS + 1))
    for r in reference[first_step - 1 :]:
        assert tail[r["step"]] == pytest.approx(r["loss"], rel=1e-6), r["step"]


def test_a_killed_rank_restarts_and_resumes_the_same_curve(tmp_path, reference):
    result = torchrun(
        2,
        "--max-restarts=1",
        *SFT,
        *ARGS,
        f"hydra.run.dir={tmp_path}",
        env={"DTRAIN_TEST_KILL_AT_STEP": "4", "DTRAIN_TEST_FAULT_RANK": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "resumed from" in result.stdout and "step-00000002 at step 2" in result.stdout
    assert_same_curve(read_metrics(tmp_path), reference, first_step=3)


NAN_AT_STEP_3 = {"DTRAIN_TEST_NAN_AT_STEP": "3"}  # a NaN gradient on lm_head, the last parameter


def nan_at_step_3(run_dir: Path, *extra: str) -> list[str]:
    """The overrides of a run whose step 3 gets a NaN gradient, checkpointing each step."""
    return [*ARGS, "checkpoint.every=1", *extra, f"hydra.run.dir={run_dir}"]


def test_a_nan_step_is_skipped_and_changes_no_weight(tmp_path):
    result = sft(2, *nan_at_step_3(tmp_path, "checkpoint.keep=10"), env=NAN_AT_STEP_3)
    assert result.returncode == 0, result.stdout[-3000:]
    records = read_metrics(tmp_path)
    assert records[2]["step"] == 3 and records[2]["skipped_steps"] == 1
    assert records[-1]["skipped_steps"] == 1 and all(r["loss"] == r["loss"] for r in records[3:])
    states = {}
    for step in (2, 3):
        dcp_to_torch_save(tmp_path / "checkpoints" / f"step-{step:08d}", tmp_path / f"{step}.pt")
        states[step] = torch.load(tmp_path / f"{step}.pt", weights_only=False)
    model_keys = [k for k in states[2]["model"]]
    assert model_keys
    for key in model_keys:
        assert torch.equal(states[2]["model"][key], states[3]["model"][key]), key
    assert states[2]["scheduler"]["last_epoch"] == states[3]["scheduler"]["last_epoch"]
    before, after = states[2]["optimizer"]["state"], states[3]["optimizer"]["state"]
    assert before.keys() == set(model_keys)  # every parameter has AdamW state
    assert_adam_state_equal(before, after)  # its step count and both moments: untouched by the skip


def test_a_nan_step_aborts_when_asked_naming_step_and_tensor(tmp_path):
    result = torchrun(2, *SFT, *nan_at_step_3(tmp_path, "train.nonfinite=abort"), env=NAN_AT_STEP_3)
    assert result.returncode != 0
    first, codes = exit_codes(result.stdout)  # torchrun's report of each worker
    assert first == 3 and codes <= {3, -signal.SIGTERM}, result.stdout[-3000:]
    assert "step 3: non-finite gradient norm" in result.stdout
    assert "first non-finite gradient on rank 0: lm_head.weight" in result.stdout
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-00000001", "step-00000002"]


def exit_codes(output: str) -> tuple[int, set[int]]:
    """torchrun's failure report: the root cause's (first failed worker's) exit code, and the codes
    of all failed workers (those torchrun stopped itself, after the first, show -15: SIGTERM)."""
    root = output[output.index("Root Cause (first observed failure)") :]
    first = int(re.search(r"exitcode\s*:\s*(-?\d+)", root).group(1))
    return first, {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}


def test_a_bad_batch_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    start = time.time()
    result = torchrun(
        2, *SFT, *ARGS, f"hydra.run.dir={tmp_path}", env={"DTRAIN_TEST_FAIL_FETCH_AT_STEP": "2"}, timeout=120
    )
    assert result.returncode != 0
    # Printed by local rank 0, which did not fail itself: the ranks agreed on rank 1's error.
    assert "dtrain: error: step 2: rank 1: ValueError: injected bad batch" in result.stdout
    first, codes = exit_codes(result.stdout)
    assert first == 2 and codes <= {2, -signal.SIGTERM}, result.stdout[-3000:]
    assert time.time() - start < 100  # no rank waited for the collective timeout
