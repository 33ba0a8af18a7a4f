"""The command line: bad configs fail fast with their message and exit code. (The README's
embedded-default command, ./launch/local.sh, is test_metrics.py's run.)"""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_in_one_interpreter

pytestmark = pytest.mark.slow  # every test launches processes


# (overrides, world size, exit code, expected words of the message). Hydra owns unknown keys and
# wrong types (its exit code 1); dtrain's own checks exit 2.
BAD_CONFIGS = [
    (["train.max_stepz=3"], 1, 1, "Key 'max_stepz' not in 'TrainConfig'"),
    (["train.max_steps=many"], 1, 1, "Value 'many' of type 'str' could not be converted to Integer"),
    (["estimate.world_size=4"], 1, 1, "Key 'estimate' not in 'Config'"),  # the planner's keys
    (["parallel.tp=2", "parallel.dp_shard=2"], 1, 2, "but the world size is 1"),
    (["parallel.tp=1", "train.global_batch_size=24"], 2, 2, "train.global_batch_size=24 is not divisible"),
    (
        ["+model.config.num_key_value_heads=3", "+model.config.num_attention_heads=6"],
        2,
        2,
        "num_key_value_heads=3 is not divisible by parallel.tp=2",
    ),
    (["data.max_len=33"], 2, 2, "data.max_len=33 is not divisible by parallel.tp=2"),
    (["data.path=/nonexistent.jsonl"], 2, 2, "data.path='/nonexistent.jsonl': no such file"),
    (["parallel.tp=1", "train.precision=fp16"], 1, 2, "train.precision='fp16': must be one of bf16, fp32"),
    (["parallel.tp=1", "parallel.loss_impl=sparse"], 1, 2, "parallel.loss_impl='sparse'"),
]
IDS = [case[3][:40] for case in BAD_CONFIGS]


@pytest.fixture(scope="module")
def bad_config_outcomes(tmp_path_factory) -> dict[str, dict]:
    """Every bad command, run by tests/workers/cli_many in one interpreter: each is
    `dtrain.sft.main()` with its argv, as `python -m dtrain.sft` (or one rank under torchrun, with
    WORLD_SIZE set as torchrun sets it) runs it, up to where the check refuses it, before any process
    group. That every rank of a real launch refuses at once is test_lifecycle's (4 processes, through
    the launch script) and test_data's (2 processes). {id: {"returncode", "output", "run_dir"}}."""
    root = tmp_path_factory.mktemp("bad_configs")
    commands, worlds = {}, {}
    for index, ((overrides, world, _, _), name) in enumerate(zip(BAD_CONFIGS, IDS, strict=True)):
        commands[name] = [*overrides, f"hydra.run.dir={root / str(index)}"]
        worlds[name] = world
    outcomes = run_in_one_interpreter(root / "cli_many", commands, worlds)
    for name in outcomes:
        outcomes[name]["run_dir"] = root / str(IDS.index(name))
    return outcomes


@pytest.mark.parametrize("overrides,world,code,message", BAD_CONFIGS, ids=IDS)
def test_bad_config_fails_fast_with_its_message(bad_config_outcomes, overrides, world, code, message):
    outcome = bad_config_outcomes[message[:40]]
    output = outcome["output"]
    assert outcome["returncode"] == code, output[-3000:]
    assert message in output, output[-3000:]
    assert not re.search(r'File "[^"]*/dtrain/[^"]*", line', output), output[-3000:]  # no crash of dtrain's
    assert not (outcome["run_dir"] / "metrics.jsonl").exists()
