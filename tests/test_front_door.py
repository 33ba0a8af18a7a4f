"""The front door, typed as a user types it: `model.name_or_path=FOLDER data.path=FILE` trains the
user's model (its architecture, tokenizer and weights) on the user's data with the schema's
defaults, and nothing of the embedded default leaks in. The fixture differs from the embedded
default in vocabulary, width, KV heads, tokenizer, special tokens and record keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import (
    USER_ARCHITECTURE,
    chat_rows,
    dtrain_frames,
    read_metrics,
    reference_losses,
    run_in_one_interpreter,
    save_user_model,
    sft,
    torchrun,
    user_rows,
    write_user_dataset,
)

pytestmark = pytest.mark.slow  # every test launches processes

SFT = ["-m", "dtrain.sft"]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    return {
        "llama": save_user_model(root / "llama"),
        "gpt_neox": save_user_model(root / "gpt_neox", "gpt_neox"),
        "data": write_user_dataset(root / "my.jsonl"),  # 32 rows: the default global batch
        "splits": write_splits(root / "splits"),
    }


EVAL_ROWS = user_rows(40)[32:]  # 8 rows unlike the training ones (their numbers)


def write_splits(folder: Path) -> Path:
    """A dataset folder of two splits: train.jsonl (the 32 rows of my.jsonl) and test.jsonl (EVAL_ROWS)."""
    folder.mkdir()
    write_user_dataset(folder / "train.jsonl")
    (folder / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in EVAL_ROWS))
    return folder


@pytest.fixture(scope="module")
def user_run(user, tmp_path_factory):
    """The README's fine-tuning command on the fixture, with a tiny step count, an eval split
    evaluated at the last step and an export. torchrun sends ranks 1-3's output to files of their own
    (launch/local.sh's redirects) and rank 0's to the terminal."""
    run_dir = tmp_path_factory.mktemp("user_run")
    logs = tmp_path_factory.mktemp("user_run_logs")
    command = [
        f"--log-dir={logs}",
        "--redirects=1:3,2:3,3:3",
        *SFT,
        f"model.name_or_path={user['llama']}",
        f"data.path={user['splits']}",
        "data.input_key=question",
        "data.eval_split=test",
        "parallel.tp=2",
        "train.max_steps=2",
        "train.eval_every=2",
        "checkpoint.export_hf=true",
        "checkpoint.export_dtype=fp32",
        f"hydra.run.dir={run_dir}",
    ]
    result = torchrun(4, *command, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    return run_dir, result.stdout, logs


def test_step_one_is_the_users_model_on_the_users_rows(user, user_run):
    """Step 1 covers the whole dataset (32 rows = the default global batch, in any order), so its
    token-mean loss is the plain transformers forward of the folder's weights over every row."""
    run_dir, _, _ = user_run
    model = AutoModelForCausalLM.from_pretrained(user["llama"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(user["llama"])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids, labels in chat_rows(tokenizer, user_rows()):
            logits = model(input_ids=ids[None]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            tokens += int((labels != -100).sum())
    first = read_metrics(run_dir)[0]
    assert first["tokens"] == tokens
    assert first["loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_eval_loss_is_a_plain_forward_of_the_trained_weights_over_the_eval_rows(user, user_run):
    """The eval line after the last step (train.eval_every=2) against a plain transformers forward
    over test.jsonl's rows, rendered with the folder's own chat template, of the weights that step
    left: the fp32 export, loaded by from_pretrained (test_checkpoint shows an export gives the
    trained logits; here it only supplies the weights the eval ran on)."""
    run_dir, _, _ = user_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(user["llama"])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids, labels in chat_rows(tokenizer, EVAL_ROWS):
            logits = model(input_ids=ids[None]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            tokens += int((labels != -100).sum())
    (evaluated,) = [record for record in read_metrics(run_dir) if "eval_loss" in record]
    assert evaluated["step"] == 2 and evaluated["eval_tokens"] == tokens
    assert evaluated["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_ranks_other_than_0_are_quiet(user_run):
    """A run that goes well: every line comes from rank 0 (the terminal), and ranks 1-3 write
    nothing, neither to stdout nor to stderr (torchrun's per-rank files)."""
    _, stdout, logs = user_run
    files = {path.relative_to(logs).as_posix(): path.read_text() for path in logs.rglob("*.log")}
    others = {name: text for name, text in files.items() if name.split("/")[-2] in ("1", "2", "3")}
    assert len(others) == 6, sorted(files)  # stdout.log and stderr.log of each of ranks 1-3
    assert all(text == "" for text in others.values()), others
    assert "per-rank shards" in stdout and "step 2/2 | eval_loss" in stdout, stdout[-3000:]


def test_export_is_the_users_architecture(user, user_run):
    run_dir, _, _ = user_run
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert exported.config.vocab_size == USER_ARCHITECTURE["vocab_size"]
    assert exported.config.hidden_size == USER_ARCHITECTURE["hidden_size"]
    assert len(AutoTokenizer.from_pretrained(run_dir / "hf")) == len(
        AutoTokenizer.from_pretrained(user["llama"])
    )


def test_no_embedded_setting_leaks_into_the_users_run(user, user_run):
    run_dir, stdout, _ = user_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"] == {
        "name_or_path": str(user["llama"]),
        "config": {},
        "init": "pretrained",  # auto, resolved: the folder has weights
        "tokenizer": None,
    }
    assert config["data"]["path"] == str(user["splits"]) and config["data"]["input_key"] == "question"
    assert config["data"]["max_len"] == 128  # the schema's, not the embedded 32
    assert config["optim"]["lr"] == 2e-5 and config["optim"]["warmup_steps"] == 0
    assert config["train"]["micro_batch_size"] == 4 and config["train"]["log_every"] == 1
    assert config["parallel"]["tp"] == 2  # typed
    summary = next(line for line in stdout.splitlines() if "per-rank shards" in line)
    assert f"model {user['llama']} (weights loaded) | tokenizer {user['llama']}" in summary


@pytest.fixture(scope="module")
def refusals(user, tmp_path_factory) -> dict[str, dict]:
    """Launches refused before any process group, each `dtrain.sft.main()` as one rank of the torchrun
    (WORLD_SIZE set) in one interpreter (helpers.run_in_one_interpreter); that every rank of a real
    launch refuses at once is test_lifecycle's and test_data's."""
    root = tmp_path_factory.mktemp("refusals")
    data = [f"data.path={user['data']}", "data.input_key=question"]
    kv_heads = [f"model.name_or_path={user['llama']}", *data, "parallel.tp=4", f"hydra.run.dir={root / 'kv'}"]
    no_plan = [f"model.name_or_path={user['gpt_neox']}", *data, "parallel.tp=2"]
    no_plan.append(f"hydra.run.dir={root / 'np'}")
    commands = {"kv_heads": kv_heads, "no_plan": no_plan}
    return run_in_one_interpreter(root / "cli_many", commands, world={"kv_heads": 4, "no_plan": 2})


def refused(outcome: dict) -> str:
    """The one dtrain error line of a launch that must fail before any process group: exit code 2,
    no traceback."""
    output = outcome["output"]
    assert outcome["returncode"] == 2, output[-3000:]
    assert not dtrain_frames(output), output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("dtrain: error:")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def test_tp_beyond_the_folders_kv_heads_is_refused(refusals):
    assert "num_key_value_heads=2 is not divisible by parallel.tp=4" in refused(refusals["kv_heads"])


def test_a_family_without_a_plan_is_refused_at_tp_2_before_any_process_group(refusals):
    line = refused(refusals["no_plan"])
    assert "'gpt_neox' has no TP plan" in line and "llama" in line


def test_a_family_without_a_plan_trains_fsdp_only_at_tp_1(user, tmp_path):
    """GPT-NeoX (no TP plan; its decoder layers, `gpt_neox.layers`, found from _no_split_modules)
    sharded over 2 ranks: the plain transformers loop's losses."""
    steps, batch, lr = 3, 8, 1e-3
    args = [
        f"model.name_or_path={user['gpt_neox']}",
        f"data.path={user['data']}",
        "data.input_key=question",
        "data.shuffle=false",
        f"train.max_steps={steps}",
        f"train.global_batch_size={batch}",
        "train.micro_batch_size=4",
        f"optim.lr={lr}",
        "checkpoint.save_final=false",
        f"hydra.run.dir={tmp_path}",
    ]
    result = sft(2, *args, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    losses = [record["loss"] for record in read_metrics(tmp_path)]
    expected = reference_losses(user["gpt_neox"], user_rows(), steps, batch, lr)
    assert losses == pytest.approx(expected, rel=1e-5)
