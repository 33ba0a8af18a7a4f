"""Observability: the README's ./launch/local.sh (the embedded default, 2×2 on 4 CPU processes)
trains, writes every figure to metrics.jsonl and the same losses to an offline W&B run (read back
from its run file); the start summary; the progress bar on a terminal; W&B without credentials;
`python -m dtrain.plot` on a sweep folder."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import matplotlib.image
import pytest

import dtrain.plot
from dtrain.sinks import ConsoleSink, wandb_credentials
from tests.helpers import ROOT, read_metrics, run, wandb_records

STEPS, LOG_EVERY = 60, 10  # the embedded default's (dtrain/conf/experiment/embedded.yaml)
FIGURES = [
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "padding_fraction",
    "tokens_per_s",
    "input_tokens_per_s",
    "input_tokens_per_s_per_device",
    "step_time_s",
    "data_wait_s",
    "mem_peak_gib",
    "mem_rss_gib",
    "skipped_steps",
]
CUDA_ONLY = ["mfu", "mem_reserved_gib", "alloc_retries"]  # no peak FLOP/s or caching allocator on CPU


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, str, Path]:
    """The README's first command, `./launch/local.sh` (the embedded default: tiny Llama, 2×2 on 4
    processes, 60 steps), with W&B asked for online and no credentials anywhere. (run folder, rank
    0's console, the other ranks' log folder)"""
    run_dir = tmp_path_factory.mktemp("run")
    logs = tmp_path_factory.mktemp("rank_logs")
    home = tmp_path_factory.mktemp("home")  # no ~/.netrc
    env = {"HOME": str(home), "WANDB_API_KEY": "", "NETRC": str(home / ".netrc")}
    env |= {"NPROC": "4", "LOG_DIR": str(logs)}
    args = ["logging.wandb.mode=online", f"hydra.run.dir={run_dir}"]
    result = run(["./launch/local.sh", *args], timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    return run_dir, result.stdout, logs


@pytest.fixture(scope="module")
def run_2x2(launched) -> Path:
    return launched[0]


@pytest.mark.slow
def test_readme_command_trains_the_embedded_default(launched):
    run_dir, stdout, logs = launched
    assert "./launch/local.sh\n" in (ROOT / "README.md").read_text()
    records = read_metrics(run_dir)
    assert records[-1]["step"] == STEPS
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    config = (run_dir / "config.yaml").read_text()
    assert "tp: 2" in config and "${" not in config  # resolved
    assert (run_dir / ".hydra").is_dir()
    assert (run_dir / "sft.log").read_text().count(f"step {STEPS}/{STEPS}") == 1  # rank 0 alone writes it
    # Rank 0 keeps the console; ranks 1-3 write their own files, quiet unless something is wrong.
    assert f"step {STEPS}/{STEPS}" in stdout
    rank_dirs = sorted(path.parent.name for path in logs.glob("*/attempt_0/*/stderr.log"))
    assert rank_dirs == ["1", "2", "3"]


@pytest.mark.slow
def test_metrics_jsonl_holds_every_figure(run_2x2):
    records = read_metrics(run_2x2)
    assert [r["step"] for r in records] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for record in records:
        for key in FIGURES:
            assert record.get(key) is not None, key
        for key in CUDA_ONLY:
            assert key in record and record[key] is None, key
        world = 4
        assert record["input_tokens_per_s_per_device"] * world == pytest.approx(record["input_tokens_per_s"])
        assert record["tokens_per_s"] < record["input_tokens_per_s"]  # prompts and padding are not supervised
        assert 0 < record["data_wait_s"] < record["step_time_s"]
        assert record["mem_rss_gib"] > 0.05  # a python process with torch: well over 50 MiB


@pytest.mark.slow
def test_start_summary_and_credentials_line(run_2x2):
    log = (run_2x2 / "sft.log").read_text()
    assert log.count("W&B: no credentials") == 1
    assert not (run_2x2 / "job_status.yaml").exists()  # a sweep's record only
    summary = next(line for line in log.splitlines() if "per-rank shards" in line)
    shards = summary.split("per-rank shards ")[1].split(" M |")[0].split()
    assert len(shards) == 4
    assert "mesh {'dp_shard': 2, 'tp': 2}" in summary and "1 accumulation steps" in summary


@pytest.mark.slow
def test_offline_wandb_run_holds_the_same_losses_and_the_config(run_2x2):
    (run_file,) = (run_2x2 / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            history[record.history.step.num] = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items
            }
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    jsonl = read_metrics(run_2x2)
    assert sorted(history) == [r["step"] for r in jsonl]
    for record in jsonl:
        assert history[record["step"]]["loss"] == record["loss"]
        assert history[record["step"]]["input_tokens_per_s"] == record["input_tokens_per_s"]
    assert config["train"]["max_steps"] == STEPS and config["parallel"]["tp"] == 2  # a plain dict
    assert "logging.wandb.mode=online" in config["hydra"]["overrides"]
    assert "experiment" in config["hydra"]


@pytest.mark.slow
def test_plot_draws_a_sweep_folder(run_2x2, tmp_path, capsys):
    """`python -m dtrain.plot FOLDER` is dtrain.plot.main([FOLDER]): called here in this process
    (the interpreter's and matplotlib's start-up is most of a fresh process's time)."""
    for job, lr in enumerate(["1e-3", "5e-4"]):  # a sweep folder's layout: SWEEP/JOB/{metrics,.hydra}
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        shutil.copy(run_2x2 / "metrics.jsonl", tmp_path / str(job))
        (tmp_path / str(job) / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n")
    dtrain.plot.main([str(tmp_path)])
    assert "2 run(s)" in capsys.readouterr().err
    height, width, _ = matplotlib.image.imread(tmp_path / "curves.png").shape
    assert width > 2 * height  # three panels side by side

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_:
        dtrain.plot.main([str(empty)])
    assert exit_.value.code != 0 and "no metrics.jsonl" in str(exit_.value.code)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_plain_lines_otherwise(caplog):
    record = json.loads(
        '{"step": 4, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, '
        '"input_tokens_per_s": 40.0, "input_tokens_per_s_per_device": 10.0, "step_time_s": 0.1, '
        '"data_wait_s": 0.01, "mem_peak_gib": 1.0, "mfu": null}'
    )
    terminal = Terminal()
    sink = ConsoleSink(max_steps=10, stream=terminal)
    sink.write(record)
    sink.close()
    assert " 4/10 [" in terminal.getvalue() and "loss=2.5000" in terminal.getvalue()  # tqdm: n/total [ETA]

    pipe = io.StringIO()
    with caplog.at_level("INFO", logger="dtrain"):
        ConsoleSink(max_steps=10, stream=pipe).write(record)
    assert pipe.getvalue() == ""  # no bar into a file or pipe
    assert "step  4/10 | loss 2.5000" in caplog.text


def test_wandb_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    assert not wandb_credentials()
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_credentials()
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    assert wandb_credentials()


def test_wandb_falls_back_offline_when_online_init_fails(monkeypatch, tmp_path, caplog):
    import wandb

    from dtrain.config import WandbConfig
    from dtrain.sinks import WandbSink

    modes = []

    def init(mode, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("Timed out while retrying: dial tcp: connection refused")
        return object()

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    with caplog.at_level("WARNING", logger="dtrain"):
        WandbSink(WandbConfig(mode="online"), {"train": {}}, tmp_path, start_step=0)
    assert modes == ["online", "offline"]
    assert caplog.text.count("W&B: online init failed (Timed out while retrying") == 1
