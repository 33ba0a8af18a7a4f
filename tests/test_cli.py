"""The command line: bad configs fail fast with their message and exit code. (The README's
embedded-default command, ./launch/local.sh, is test_metrics.py's run.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import DATASET, one_interpreter_command, run, run_in_one_interpreter, save_tiny_llama

pytestmark = pytest.mark.slow  # every test launches processes


# (overrides, world size, exit code, expected words of the message). Hydra owns unknown keys and
# wrong types (its exit code 1); dtrain's own checks exit 2.
BAD_CONFIGS = [
    (["train.max_stepz=3"], 1, 1, "Key 'max_stepz' not in 'TrainConfig'"),
    (["train.max_steps=many"], 1, 1, "Value 'many' of type 'str' could not be converted to Integer"),
    (["estimate.world_size=4"], 1, 1, "Key 'estimate' not in 'Config'"),  # the planner's keys
    (["parallel.tp=2", "parallel.dp_shard=2"], 1, 2, "but the world size is 1"),
    (
        ["parallel.tp=1", "train.micro_batch_size=16", "train.global_batch_size=24"],
        2,
        2,
        "train.global_batch_size=24 is not divisible",
    ),
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
    assert "Traceback" not in output, output[-3000:]
    if code == 2:  # dtrain's refusals leave no folder behind (Hydra's own errors come before it makes one)
        assert not outcome["run_dir"].exists()


# Values and files that once slipped through (each a one-process command; the ranks' agreement on a
# failure is test_lifecycle's and test_data's): exit code 2 and one line naming the value or the file.
SLIPPED = {
    "negative lora.r": (["lora.r=-4"], "lora.r=-4: must be >= 0 (0: LoRA off, every parameter trains)"),
    "lora.alpha at lora.r=0": (["lora.alpha=16"], "lora.alpha=16.0 is set but lora.r=0 (LoRA off"),
    "truncated safetensors": (
        ["model.name_or_path={truncated}"],
        "{truncated}/model.safetensors: not a readable safetensors file (Error while deserializing "
        "header: incomplete metadata, file not fully covered); copy it again",
    ),
    "garbage safetensors": (
        ["model.name_or_path={garbage}"],
        "{garbage}/model.safetensors: not a readable safetensors file (Error while deserializing header",
    ),
    "a byte that is not UTF-8 on line 51": (
        ["data.path={not_utf8}"],
        "{not_utf8}:51: not UTF-8 (byte 0xff, column 35)",
    ),
    "malformed JSON on line 51": (
        ["data.path={malformed}"],
        "{malformed}:51: malformed JSON (Expecting ',' delimiter, column",
    ),
    "a full disk before the run starts": (
        ["hydra.run.dir={full_disk}/run"],
        "{full_disk}/run: the run folder cannot be written (No space left on device; 0.0 MiB free there)",
    ),
}


@pytest.fixture(scope="module")
def slipped_outcomes(tmp_path_factory) -> tuple[dict[str, dict], dict[str, Path]]:
    """SLIPPED's commands in one interpreter (tests/workers/cli_many), in a mount namespace of its
    own (`unshare`) where a small tmpfs is filled up: the full disk is a real one. The files: a model
    folder whose model.safetensors is cut in half, one whose file is garbage, JSONL files of the
    shipped dataset's first 60 lines with line 51 broken."""
    root = tmp_path_factory.mktemp("slipped")
    files = {"full_disk": root / "full_disk"}
    files["full_disk"].mkdir()
    for name in ("truncated", "garbage"):
        folder = files[name] = save_tiny_llama(root / name, tied=False)
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2] if name == "truncated" else b"\x00garbage" * 64)
    lines = DATASET.read_bytes().splitlines()[:60]
    broken = {"not_utf8": lines[50][:34] + b"\xff" + lines[50][34:], "malformed": lines[50][:-1]}
    for name, line in broken.items():
        files[name] = root / f"{name}.jsonl"
        files[name].write_bytes(b"\n".join([*lines[:50], line, *lines[51:]]) + b"\n")
    commands = {}
    for index, (name, (overrides, _)) in enumerate(SLIPPED.items()):
        args = [override.format(**files) for override in overrides]
        if not any(arg.startswith("hydra.run.dir=") for arg in args):
            args.append(f"hydra.run.dir={root / 'runs' / str(index)}")
        commands[name] = ["parallel.tp=1", "train.max_steps=1", *args]
    envs = dict.fromkeys(commands, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    disk = files["full_disk"]
    fill = f'mount -t tmpfs -o size=256k tmpfs {disk} || exit 1; cat /dev/zero > {disk}/fill; exec "$@"'
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", fill, "sh"]
    result = run([*namespace, *one_interpreter_command(root / "cli_many", commands, envs=envs)], timeout=300)
    assert result.returncode == 0, f"(this test needs unprivileged user namespaces)\n{result.stdout[-4000:]}"
    return json.loads((root / "cli_many" / "out.json").read_text()), {**files, "runs": root / "runs"}


@pytest.mark.parametrize("name", SLIPPED)
def test_what_slipped_through_is_refused_in_one_line(slipped_outcomes, name):
    outcomes, files = slipped_outcomes
    outcome, (_, message) = outcomes[name], SLIPPED[name]
    output = outcome["output"]
    (line,) = [line for line in output.splitlines() if "error" in line.lower()]  # datasets' log line too
    assert outcome["returncode"] == 2 and line.startswith(f"dtrain: error: {message.format(**files)}"), output
    assert "Traceback" not in output, output[-3000:]
    assert not files["runs"].exists() or not list(files["runs"].iterdir())  # nothing left behind
