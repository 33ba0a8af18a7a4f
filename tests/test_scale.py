"""Llama-3-8B at real scale without GPUs: meta device, fake process group, the trainer's own
parallelize. Every rank's share of the parameters is total / world, embedding and lm_head included
(with DeepSpeed AutoTP those two stay whole on every tp rank)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import run, worker

pytestmark = pytest.mark.slow  # every test launches processes

LLAMA3_8B = "meta-llama/Meta-Llama-3-8B"  # planned offline from the architecture dtrain ships


@pytest.fixture(scope="module")
def plans():
    result = run([sys.executable, *worker("plan_8b"), LLAMA3_8B], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_all_planned_configurations_ran(plans):
    assert [(p["world"], p["tp"]) for p in plans] == [(4, 2), (4, 4), (8, 4), (8, 8), (64, 8)]


@pytest.mark.parametrize("index", range(5))
def test_per_rank_bytes_are_total_over_world(plans, index):
    plan = plans[index]
    world, local, total = plan["world"], plan["local"], plan["total"]
    assert sum(total.values()) / 4 == pytest.approx(8.03e9, rel=0.001)  # fp32 master weights
    assert sum(local.values()) == pytest.approx(sum(total.values()) / world, rel=0.01)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert local[name] == pytest.approx(total[name] / world, rel=0.01), name
