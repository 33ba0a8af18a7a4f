"""The GPU scripts run in CI: `bench/gpu_all.sh --dry-run` goes through every step of the device run
(bench/gpu_estimate_check.py's plan and real step, a 1-process `torchrun -m dtrain.sft` in bf16,
its LoRA, QLoRA and dtrain.dpo LoRA runs, dtrain.grpo's embedded default, the mixture-of-experts run,
bench/gpu_check.py's variants, bench/gpu_rollout_check.py's comparisons of log-probs over a stand-in
for vLLM) on the CPU with tiny shapes, over the same code as on CUDA, so the first lent GPU is not
spent on an ImportError or a bad flag. No figure here is a GPU figure."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import ROOT, read_metrics, run

pytestmark = pytest.mark.slow  # launches the script's processes


def test_gpu_all_dry_run_runs_every_check(tmp_path):
    out = tmp_path / "out"
    env = {
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
    }
    result = run(["bash", str(ROOT / "bench" / "gpu_all.sh"), "--dry-run"], timeout=1200, env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    rows = {line.split()[0]: line.split()[1] for line in (out / "summary.txt").read_text().splitlines()[1:]}
    # no test is CUDA-only today (gpu_all.sh's CUDA_ONLY): the row says so instead of running nothing
    expected = {
        "estimate": "ok",
        "sft": "ok",
        "lora": "ok",
        "qlora": "ok",
        "dpo": "ok",
        "grpo": "ok",
        "cuda_tests": "none",
        "moe": "ok",
        "gpu_check": "ok",
        "rollout": "ok",
    }
    assert rows == expected, rows

    estimate = json.loads((out / "estimate.json").read_text())
    assert (
        estimate["cuda_peak"] is None and estimate["measured_by"] == "tracker"
    )  # the CPU has no allocator peak
    assert abs(estimate["ratio"] - 1) <= 0.10, estimate  # the planner against the real step's tracker

    assert read_metrics(out / "sft")[-1]["step"] == 2  # the dry run's step count (20 on the GPU)
    assert read_metrics(out / "lora")[-1]["step"] == 2  # the LoRA row's (10 on the GPU: Llama-3-8B)
    moe = read_metrics(out / "moe")  # 2 gloo processes at ep = 2 (on the GPU: Qwen3-30B-A3B's layers)
    assert moe[-1]["step"] == 2 and all("aux_loss" in r and r["tokens_per_s"] > 0 for r in moe), moe
    assert read_metrics(out / "qlora")[-1]["step"] == 2  # QLoRA's (10 on the GPU: 70B-shaped layers)
    dpo = read_metrics(out / "dpo")  # the DPO LoRA row's (10 on the GPU: Llama-3-8B)
    assert dpo[-1]["step"] == 2 and "rewards/accuracies" in dpo[-1]
    grpo = read_metrics(out / "grpo")  # dtrain.grpo's embedded default, hf engine (10 steps on the GPU)
    assert grpo[-1]["step"] == 2 and grpo[-1]["reward"] is not None and grpo[-1]["time/rollout_s"] > 0

    rollout = json.loads((out / "rollout.json").read_text())  # the stand-in's figures, not vLLM's
    assert rollout["failed"] == [] and rollout["synced"]["tokens"] > 0, rollout
    assert rollout["stale"]["vllm_vs_trainer"]["max"] > rollout["stale"]["tolerance"], rollout

    check = json.loads((out / "gpu_check.json").read_text())
    assert check["failed"] == [], check["failed"]
    names = [row["variant"] for row in check["rows"]]
    for shape in ("eager, unpacked", "eager, packed", "compiled, unpacked", "compiled, packed"):
        for variant in ("plain loop", "dtrain 1x1", "dtrain 1x1 fused"):
            assert f"{variant}, {shape}" in names, names
    for variant in ("LoRA r=16: PEFT + plain loop", "LoRA r=16: dtrain 1x1"):  # the bench's LoRA rows
        assert variant in names, names
    qlora = {
        "QLoRA r=16: PEFT + bitsandbytes NF4",
        "QLoRA r=16: dtrain 1x1, NF4 base",
        "QLoRA r=16: PEFT, dense NF4 base",
    }
    assert qlora <= set(names), names
