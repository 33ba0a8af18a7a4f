"""A run that survives its user and its cluster, through ./launch/local.sh (dtrain.launch: torchrun,
2 CPU processes: the embedded default at tp=2; every rank must agree, and 2 show that as 4 would at
half the cost; 1 where the ranks are not the point), each launch in a folder of its own as a user's
working directory:

- SIGTERM to the launcher's pid alone (a scheduler's), while a second identical command is refused
  (one line, exit 2), then the identical command: it resumes (saying so in its first line); then
  Ctrl-C (SIGINT to the whole process group, as a terminal sends it) with the default checkpoint
  settings: dtrain's line and exit 75, no traceback; then SIGUSR1 to the launcher during the last
  step, which lets the run finish. The curve equals an uninterrupted run's (1e-6), metrics.jsonl
  holds each step once, and W&B (offline) logs every launch to the same run id.
- The workers SIGKILLed while saving a checkpoint and the newest complete one truncated on disk, then
  the identical command: it skips the partial checkpoint, sets the unreadable one aside, resumes
  from the one before, and the steps logged after it are not repeated.
- The launcher SIGKILLed: no worker outlives it, nothing is saved after it; its lock is stale, so
  `checkpoint.resume=never` starts over in the folder.
- The default periodic save (checkpoint.every_minutes) on a clock the test controls.
- The embedded default on 3 and 4 ranks (tp=1): fitted to the world size, the same curve where the
  global batch is unchanged.
- The documented exit codes as the shell sees them: 75 preempted, 3 non-finite (train.max_skips),
  2 for a full disk at save (the last checkpoint intact and loadable, no partial left).
- The failures known before any process group, each one `dtrain: error:` line and exit code 2, in
  this process (dtrain.sft.main with a patched argv): no interpreter start-up per check.

The reference is an uninterrupted run of the same overrides on 2 ranks (forked, W&B off: neither
moves a loss): resuming must reproduce exactly what not stopping would have done, which no other
program can tell."""

from __future__ import annotations

import gc
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dtrain import collector
from dtrain.checkpoint import COMPLETE, find_resume_path
from dtrain.config import CheckpointConfig
from dtrain.hydra_glue import run_name, with_embedded_defaults
from dtrain.objectives.dpo import SPEC as DPO
from dtrain.trainer import train
from tests.helpers import ROOT, read_metrics, run, sft, wandb_records, worker_command

STEPS = 6
COMMAND = [f"train.max_steps={STEPS}", "train.log_every=1", "logging.wandb.mode=offline"]
NAME = "sft/embedded"  # the folder the embedded default's command names: outputs/sft/embedded
SLOW_STEPS = {"DTRAIN_TEST_STEP_SLEEP_S": "1"}  # a signal lands mid-run, not after the last step
MINUTES_PER_STEP = 11  # the reference's clock: checkpoint.every_minutes (30) passes during step 4


def launch(cwd: Path, *overrides: str, env: dict | None = None, when=None, send=None) -> tuple[int, str]:
    """`./launch/local.sh OVERRIDES` with 2 processes in `cwd`; once `when(records)` holds for the
    run's metrics.jsonl, `send(process)` (a signal). Returns the exit code the shell sees and the
    output."""
    cwd.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(
        [str(ROOT / "launch" / "local.sh"), *overrides],
        cwd=cwd,
        env=launch_env(cwd, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a test's Ctrl-C reaches it, not pytest
    ) as process:
        if when is not None:
            deadline = time.time() + 600
            while time.time() < deadline and process.poll() is None and not when(records(cwd)):
                time.sleep(0.05)
            send(process)
        output, _ = process.communicate(timeout=900)
    return process.returncode, output


def launch_env(cwd: Path, env: dict | None = None) -> dict:
    return {
        **os.environ,
        "NPROC": "2",
        "LOG_DIR": str(cwd / "logs"),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "WANDB_API_KEY": "",
        **(env or {}),
    }


def records(cwd: Path) -> list[dict]:
    """The complete lines of a (possibly running) run's metrics.jsonl."""
    path = cwd / "outputs" / NAME / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return [json.loads(line) for line in lines]


def after_step(step: int):
    return lambda logged: any(r["step"] >= step for r in logged)


def to_group(signum: int):
    """The signal to the launch's whole process group, as a terminal's Ctrl-C or `kill -- -PGID`."""
    return lambda process: os.killpg(process.pid, signum)


def to_launcher(signum: int):
    """The signal to the launcher's pid alone (the script execs it), as a scheduler sends it."""
    return lambda process: os.kill(process.pid, signum)


def worker_pids(root: int) -> dict[str, int]:
    """The dtrain workers below `root` (the launch script), by their RANK."""
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        stack += [int(child) for child in children]
        rank = next((item[5:].decode() for item in environ if item.startswith(b"RANK=")), None)
        if rank is not None and b"dtrain.sft" in Path(f"/proc/{pid}/cmdline").read_bytes():
            found[rank] = pid
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_same_curve(logged: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))  # each step once, in order
    for mine, theirs in zip(logged, reference, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6), mine["step"]


def checkpoints(cwd: Path) -> Path:
    return cwd / "outputs" / NAME / "checkpoints"


def saved_steps(cwd: Path) -> list[int]:
    return sorted(json.loads((p / COMPLETE).read_text())["step"] for p in checkpoints(cwd).glob("step-*"))


def dtrain_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("dtrain")]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The uninterrupted run of what every scenario trains: the same overrides on 2 ranks (dtrain.sft's
    main() on forked ranks, helpers.sft, and W&B off: neither the launcher nor W&B moves a loss), with
    the default checkpoint settings on a clock that shows MINUTES_PER_STEP more at each step (a save
    changes no loss)."""
    run_dir = tmp_path_factory.mktemp("reference")
    clock = {"DTRAIN_TEST_MINUTES_PER_STEP": str(MINUTES_PER_STEP)}
    result = sft(2, *COMMAND, "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}", env=clock)
    assert result.returncode == 0, result.stdout[-3000:]
    logged = read_metrics(run_dir)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    return run_dir, logged


@pytest.fixture(scope="module")
def reference(reference_run) -> list[dict]:
    return reference_run[1]


@pytest.mark.slow
def test_the_default_periodic_save_follows_the_clock(reference_run):
    """checkpoint.every_minutes (30, the default) by rank 0's clock, agreed by every rank at a step
    boundary: the save follows the first step whose start is 30 minutes after the last save, and the
    last step is saved (checkpoint.save_final); the newest 2 are kept (checkpoint.keep)."""
    run_dir, _ = reference_run
    due, last_save = [], 0
    for step in range(1, STEPS + 1):
        start = (step - 1) * MINUTES_PER_STEP  # the clock at this step's start, when the ranks agree
        if start - last_save >= 30:
            due.append(step)
            last_save = start
    expected = sorted({*due, STEPS})[-2:]
    saved = sorted(int(path.name.removeprefix("step-")) for path in (run_dir / "checkpoints").iterdir())
    assert due and saved == expected, (saved, expected)


@pytest.mark.slow
def test_sigterm_ctrl_c_and_a_signal_in_the_last_step_then_the_same_command_resumes(tmp_path, reference):
    hold = tmp_path / "hold"  # while it exists, the run waits before its next step (DTRAIN_TEST_HOLD_FILE)

    def refuse_a_second_run_then_sigterm(process: subprocess.Popen) -> None:
        """The identical command while the first runs: refused, one line, exit 2 (on one process:
        each rank refuses on its own, before any process group). Then SIGTERM (SLURM's,
        Kubernetes') to the first launcher's pid alone."""
        hold.touch()
        second = subprocess.run(
            [str(ROOT / "launch" / "local.sh"), *COMMAND],
            cwd=tmp_path,
            env=launch_env(tmp_path, {"NPROC": "1"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        assert second.returncode == 2, second.stdout[-3000:]
        folder = f"outputs/{NAME}"
        assert second.stdout.splitlines() == [
            f"dtrain: error: {folder} is in use by another run: pid {worker_pids(process.pid)['0']} on "
            f"{os.uname().nodename} (since {json_since(tmp_path)}); wait for it to end or stop it (its "
            f"lock, {folder}/run.lock, goes with it), or name another folder with hydra.run.dir="
        ]
        os.kill(process.pid, signal.SIGTERM)
        hold.unlink()

    code, output = launch(
        tmp_path,
        *COMMAND,
        env={**SLOW_STEPS, "DTRAIN_TEST_HOLD_FILE": str(hold)},
        when=after_step(1),
        send=refuse_a_second_run_then_sigterm,
    )
    assert code == 75, output[-3000:]
    assert "received SIGTERM" in output and "dtrain: preempted: checkpoint saved after step" in output
    first = saved_steps(tmp_path)[-1]
    assert 1 <= first < STEPS - 2 and [r["step"] for r in records(tmp_path)] == list(range(1, first + 1))

    # The identical command resumes; Ctrl-C (the whole process group) saves and exits 75 as well,
    # with the default checkpoint settings (no checkpoint.every). What the user sees: dtrain's lines
    # and the code, no traceback of torchrun's or a worker's (torchrun's report is in the log folder).
    code, output = launch(
        tmp_path, *COMMAND, env=SLOW_STEPS, when=after_step(first + 1), send=to_group(signal.SIGINT)
    )
    assert code == 75, output[-3000:]
    assert f"resuming outputs/{NAME} at step {first}" in output, output[-3000:]
    assert "received SIGINT" in output and "Traceback" not in output, output[-3000:]
    second = saved_steps(tmp_path)[-1]
    assert dtrain_lines(output) == [
        f"dtrain: preempted: checkpoint saved after step {second}; rerun the same command to resume"
    ]
    assert first < second < STEPS

    # Again; SIGUSR1 (SLURM's warning) to the launcher during the last step: the run finishes.
    code, output = launch(
        tmp_path, *COMMAND, env=SLOW_STEPS, when=after_step(STEPS - 1), send=to_launcher(signal.SIGUSR1)
    )
    assert code == 0, output[-3000:]
    assert f"resuming outputs/{NAME} at step {second}" in output
    assert "received SIGUSR1" in output and "preempted" not in output
    assert saved_steps(tmp_path)[-1] == STEPS
    assert_same_curve(records(tmp_path), reference)
    assert [p.relative_to(tmp_path / "outputs").as_posix() for p in (tmp_path / "outputs").glob("*/*")] == [
        NAME
    ]  # one folder, found again

    # W&B: three launches, one run id (the run folder's), and each step logged to it once.
    run_dir = tmp_path / "outputs" / NAME
    run_id = (run_dir / "wandb_id").read_text().strip()
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3
    logged = {}
    for path in files:
        (run,) = [r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
        assert run.run_id == run_id, path
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                item = record.history.item
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in item}
                assert items["_step"] not in logged, items["_step"]
                logged[items["_step"]] = items["loss"]
    assert logged == {r["step"]: r["loss"] for r in records(tmp_path)}

    # The finished run rerun with a smaller train.max_steps: one line, exit code 0, and the folder as
    # it was (config.yaml still says what it holds; Hydra's record put back; its log says what happened).
    files = [path for path in run_dir.rglob("*") if path.is_file() and path.suffix != ".log"]
    kept = {path: path.read_bytes() for path in files}
    code, output = launch(tmp_path, *COMMAND, "train.max_steps=3")
    assert code == 0, output[-3000:]
    (said,) = [line for line in output.splitlines() if "nothing to train" in line]
    assert said.endswith(
        f"outputs/{NAME} is at step {STEPS}, past train.max_steps=3: nothing to train, and the folder is "
        "left as it was (a larger train.max_steps continues the run; checkpoint.resume=never starts it over)"
    ), output[-3000:]
    assert {path: path.read_bytes() for path in kept if path.is_file()} == kept
    assert f"max_steps: {STEPS}" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_a_save_killed_mid_write_and_a_truncated_checkpoint_then_the_same_command_resumes(
    tmp_path, reference
):
    """The workers are SIGKILLed while saving step 6 (its files written, not yet marked complete),
    and the newest complete checkpoint, step 4, is truncated on disk: the identical command skips the
    partial one, sets step 4 aside (renamed, its files kept) in one line, resumes from step 2 and
    logs steps 3-5 once. (A rank killed between steps, restarted in place: test_reliability.)"""
    command = [*COMMAND, "checkpoint.every=2", "logging.wandb.mode=disabled"]
    code, output = launch(tmp_path, *command, env={"DTRAIN_TEST_CRASH_IN_SAVE": str(STEPS)})
    assert code != 0
    folder = checkpoints(tmp_path)
    # step 6 trained, but its line comes after its save, which never finished
    assert [r["step"] for r in records(tmp_path)] == list(range(1, STEPS)) and saved_steps(tmp_path) == [2, 4]
    assert (folder / f".step-{STEPS:08d}.partial").is_dir() and not (folder / f"step-{STEPS:08d}").exists()
    shard = folder / "step-00000004" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)

    code, output = launch(tmp_path, *command)
    assert code == 0, output[-3000:]
    assert "skipping incomplete checkpoint" in output
    assert f"resuming outputs/{NAME} at step 4" in output
    (line,) = [line for line in output.splitlines() if "cannot be read" in line]
    aside = folder / "unreadable-step-00000004"
    assert f"checkpoint {aside.resolve()} cannot be read (rank " in line, line
    assert f"set aside; resuming from {(folder / 'step-00000002').resolve()} instead" in line, line
    assert (aside / "__0_0.distcp").stat().st_size == size // 2  # set aside, not deleted
    assert "Traceback" not in output
    assert_same_curve(records(tmp_path), reference)  # steps 3-5 once: the killed attempt's are gone


@pytest.mark.slow
def test_a_sigkilled_launcher_takes_its_workers_with_it_and_leaves_no_stuck_lock(tmp_path):
    """SIGKILL to the launcher (its pid: the script execs it) of a run saving every step: 10 s later
    no worker is alive and no checkpoint, complete or partial, appeared after the kill; the identical
    command then finds the lock stale (its holder is gone) and `checkpoint.resume=never` starts over
    there, on 1 rank (the embedded default fitted to it). One rank: the launcher's worker dies as 4
    would (each asks the kernel for SIGKILL at its parent's death)."""
    one = {"NPROC": "1"}
    command = [*COMMAND, "checkpoint.every=1", "logging.wandb.mode=disabled"]
    workers, listing = {}, []

    def sigkill(process: subprocess.Popen) -> None:
        workers.update(worker_pids(process.pid))
        os.kill(process.pid, signal.SIGKILL)
        listing.extend(sorted(path.name for path in checkpoints(tmp_path).iterdir()))

    code, _ = launch(tmp_path, *command, env={**SLOW_STEPS, **one}, when=after_step(1), send=sigkill)
    assert code == -signal.SIGKILL and workers
    time.sleep(10)
    assert not [pid for pid in workers.values() if alive(pid)]
    assert sorted(path.name for path in checkpoints(tmp_path).iterdir()) == listing
    assert (tmp_path / "outputs" / NAME / "run.lock").is_file()  # left by the killed run

    code, output = launch(tmp_path, *command, "train.max_steps=2", "checkpoint.resume=never", env=one)
    assert code == 0, output[-3000:]
    assert "taking over the lock of pid" in output and "its process is gone" in output
    assert f"starting outputs/{NAME} (checkpoint.resume=never" in output
    assert "the embedded default fitted to 1 rank: parallel.tp=1" in output
    assert [r["step"] for r in records(tmp_path)] == [1, 2] and saved_steps(tmp_path) == [1, 2]
    assert not (tmp_path / "outputs" / NAME / "run.lock").exists()  # released at the end


@pytest.mark.slow
def test_the_embedded_default_runs_on_3_and_4_ranks(tmp_path, reference):
    """The README's main command on other world sizes: 3 ranks (tp=1; 32 is not a multiple of dp=3,
    so the global batch is 30) and 4 ranks at parallel.tp=1 (dp=4: micro batch 8, global batch 32),
    each fitted and said so in the first line, 2 steps. At 4 ranks the global batch is the
    reference's (2 ranks, tp=2, micro batch 16 × 2 accumulation steps), so the losses are the
    reference's up to fp32 reduction order: the weights are the same at both steps (the warmup's
    learning rate is 0 at step 1), and the token losses are summed in another grouping, a relative
    error of about sqrt(n)·eps ~ 1e-6 for n ~ 500 tokens: within the documented 1e-5 across meshes."""
    short = ["train.max_steps=2", "train.log_every=1"]
    for world, extra, fitted in (
        (3, [], "parallel.tp=1, train.global_batch_size=30, train.micro_batch_size=10"),
        (4, ["parallel.tp=1"], "train.micro_batch_size=8"),
    ):
        run_dir = tmp_path / str(world)
        result = sft(world, *short, *extra, f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stdout[-3000:]
        assert f"(the embedded default fitted to {world} ranks: {fitted})" in result.stdout
        logged = read_metrics(run_dir)
        assert [r["step"] for r in logged] == [1, 2]
    for mine, theirs in zip(logged, reference[:2], strict=False):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def json_since(cwd: Path) -> str:
    """The lock's `since`, as the refusal shows it."""
    holder = json.loads((cwd / "outputs" / NAME / "run.lock").read_text())
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))


@pytest.mark.slow
def test_exit_codes_through_the_launch_script(tmp_path):
    """3 for too many non-finite steps, 2 for a full disk at save (as for every dtrain error: a bad
    config's 2 is test_cli's, in one interpreter): what a requeue script reads from ./launch/local.sh,
    where torchrun alone says 1."""
    short = ["train.max_steps=4", "logging.wandb.mode=disabled"]
    # one process (the ranks' agreement on a non-finite step is test_reliability's, on 2)
    nan = {"DTRAIN_TEST_NAN_AT_STEP": "2", "NPROC": "1"}
    code, output = launch(tmp_path / "nan", *short, "train.max_skips=0", env=nan)
    assert code == 3, output[-3000:]
    assert "dtrain: error: step 2: 1 non-finite steps in a row (train.max_skips=0)" in output

    # one process too: the ranks' agreement on a failed save is DCP's (every rank raises its error)
    folder = tmp_path / "disk"
    full_disk = {"DTRAIN_TEST_FAIL_SAVE": "4", "NPROC": "1"}
    code, output = launch(folder, *short, "checkpoint.every=2", env=full_disk)
    assert code == 2, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("dtrain: error:")]
    checkpoints = folder / "outputs" / NAME / "checkpoints"
    assert "saving the step-4 checkpoint (" in line and f"to {checkpoints.resolve()} failed" in line
    assert "No space left on device" in line and "MiB free there" in line and "step-00000002" in line
    assert "The newest complete checkpoint is still" in line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002"]  # no partial left
    assert find_resume_path(CheckpointConfig(resume="auto"), checkpoints).name == "step-00000002"
    dcp_to_torch_save(checkpoints / "step-00000002", tmp_path / "last.pt")  # the last one still loads
    assert torch.load(tmp_path / "last.pt", weights_only=False)["progress"]["step"] == 2


def main_in_process(monkeypatch, cwd: Path, *overrides: str) -> tuple[int, str]:
    """dtrain.sft's main in this process, as `python -m dtrain.sft OVERRIDES` run in `cwd` (one
    process: every check here comes before any process group)."""
    from dtrain import sft

    monkeypatch.chdir(cwd)
    # main sets DTRAIN_RUN_NAME for its resolver: set it here first so that monkeypatch unsets it after
    # the test (delenv of an unset variable records nothing, and the name leaked into later tests)
    monkeypatch.setenv("DTRAIN_RUN_NAME", "")
    monkeypatch.delenv("DTRAIN_RUN_NAME")
    monkeypatch.setattr(sys, "argv", ["dtrain.sft", "parallel.tp=1", *overrides])
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as exit:
        sft.main()
    return exit.value.code, stderr.getvalue()


@pytest.mark.slow
def test_failures_before_the_process_group_are_one_line_and_exit_code_2(tmp_path, monkeypatch):
    no_config = tmp_path / "not_a_model"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text("{}")
    other_run = tmp_path / "other"
    (other_run / "outputs" / NAME).mkdir(parents=True)
    (other_run / "outputs" / NAME / "config.yaml").write_text("optim: {lr: 1.0}\n")
    (other_run / "outputs" / NAME / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    cases = [
        ([f"model.name_or_path={no_config}"], f"model.name_or_path='{no_config}': no config.json"),
        (["hydra.run.dir=/proc/dtrain"], "/proc/dtrain: the run folder cannot be written"),
        (["+optim.lrr=1"], "optim.lrr: unknown key"),
        (["+train.max_stepz=3"], "train.max_stepz: unknown key"),
        (["checkpoint.resume=none"], "checkpoint.resume=none: starting over is checkpoint.resume=never"),
    ]
    for overrides, message in cases:
        code, stderr = main_in_process(monkeypatch, tmp_path, *overrides)
        errors = [line for line in stderr.splitlines() if line.startswith("dtrain: error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (overrides, stderr[-2000:])
    assert not (tmp_path / "outputs").exists()  # a failed command leaves no folder behind
    code, stderr = main_in_process(monkeypatch, other_run)
    assert code == 2 and "config.yaml is from a run with a different" in stderr
    assert "checkpoint.resume=never starts over there" in stderr
    assert (other_run / "outputs" / NAME / "metrics.jsonl").read_text().count("\n") == 1  # untouched


@pytest.mark.slow
def test_a_refused_start_on_4_ranks_leaves_nothing_whichever_rank_starts_first(tmp_path):
    """4 ranks of dtrain.dpo, rank 0 starting after the others (tests/workers/rank0_last): a value
    refused before the process group (the run folder named by the command) and data refused after it
    (config.yaml written; hydra.run.dir given): exit code 2, one line, and nothing left behind. Before,
    another rank's Hydra made the run folder first, and rank 0, finding it made, left config.yaml,
    .hydra/ and dpo.log there."""
    bad = tmp_path / "bad.jsonl"  # a pair without its rejected completion: refused while tokenizing
    pair = {"prompt": "a", "chosen": "b", "rejected": "c"}
    bad.write_text("".join(json.dumps(record) + "\n" for record in (pair, {**pair, "rejected": None})))
    refused = ["dpo.beta=-1"]
    named = Path("outputs") / "dpo" / run_name(with_embedded_defaults(refused, DPO.embedded))
    cases = [
        (refused, named, "dpo.beta=-1.0: must be > 0"),
        ([f"data.path={bad}", "hydra.run.dir=runs/bad"], Path("runs/bad"), "'rejected' is missing or null"),
    ]
    for case, (overrides, folder, message) in enumerate(cases):
        cwd = tmp_path / f"case{case}"
        cwd.mkdir()
        args = [*overrides, "logging.wandb.mode=disabled"]
        result = run(worker_command(4, "rank0_last", "dpo", str(cwd), str(cwd / folder), *args), timeout=600)
        errors = [line for line in result.stdout.splitlines() if line.startswith("dtrain: error:")]
        assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stdout[-3000:]
        assert sorted(cwd.iterdir()) == [], sorted(cwd.rglob("*"))


def test_the_run_folder_is_named_by_what_is_trained():
    """The same command names the same folder in any order; overrides of what is trained name
    another; the mesh, the step count, logging and checkpointing do not (they resume the run)."""
    embedded = ["+experiment=embedded"]
    assert f"sft/{run_name(embedded)}" == NAME
    assert run_name([*embedded, "parallel.tp=1", "train.max_steps=9", "checkpoint.every=5"]) == "embedded"
    lr = run_name([*embedded, "optim.lr=1e-4", "train.seed=3"])
    assert lr == run_name(["train.seed=3", "optim.lr=1e-4", *embedded]) != "embedded"
    assert run_name([*embedded, "optim.lr=1e-3", "train.seed=3"]) != lr
    assert run_name(["model.name_or_path=/a/llama", "data.path=/d/x.jsonl"]).startswith("llama-")
    assert run_name(["model.name_or_path=/a/llama", "data.path=/d/x.jsonl"]) != run_name(
        ["model.name_or_path=/a/llama", "data.path=/d/y.jsonl"]
    )


def test_a_run_lock_is_stale_when_its_holder_is_gone(tmp_path, monkeypatch):
    """The lock's rules, on lock files written as another holder would have (a second host, a crash,
    a reused pid, a restart of the same launch cannot all be staged with real processes here): the
    same machine judges by the pid and its start time, another machine by the heartbeat's age, the
    same launch takes its own lock over; a live holder refuses, naming itself."""
    from dataclasses import asdict, replace

    from dtrain.run_lock import LOCK, STALE_S, Holder, LockHeld, RunLock, check_free

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    me = Holder.this_process()
    parent = os.getppid()  # alive, and not this process
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    lock = tmp_path / LOCK

    def holder(**changes) -> None:
        lock.write_text(json.dumps(asdict(replace(me, **changes))))

    def held() -> bool:
        try:
            check_free(tmp_path)
        except LockHeld as refusal:
            assert f"{tmp_path} is in use by another run: pid" in str(refusal)
            return True
        return False

    holder(pid=parent, started=_start_of(parent))
    assert held()  # a live process on this machine
    holder(pid=dead)
    assert not held()  # its process is gone
    holder(pid=parent, started="1")
    assert not held()  # the pid is another process now
    holder(pid=parent, started=_start_of(parent), launch="job-7")
    monkeypatch.setenv("SLURM_JOB_ID", "job-7")
    assert not held()  # the same launch, restarted (a requeued job)
    monkeypatch.delenv("SLURM_JOB_ID")
    holder(host="another-node", pid=dead)
    assert held()  # another machine: its pid means nothing here, its heartbeat is fresh
    os.utime(lock, (time.time() - STALE_S - 1,) * 2)
    assert not held()  # no heartbeat for longer than STALE_S
    taken = RunLock.take(tmp_path)  # takes the stale lock over
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert not lock.exists()


def _start_of(pid: int) -> str:
    """/proc/PID/stat's start time (field 22), read here independently of dtrain.run_lock."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def test_a_stalled_run_is_warned_once(caplog):
    """The pattern of optim.lr=1e6 (loss pinned at ln(vocab), grad_norm 0) warns once; a
    from-scratch model's first steps near ln(vocab), whose loss moves, do not."""
    from dtrain.reliability import StallWatch

    uniform = math.log(1024)
    watch = StallWatch(1024)
    for step, loss in enumerate([uniform + 0.01, uniform - 0.02, uniform - 0.05, uniform - 0.1], 1):
        watch.check(step, loss, 3.0)
    assert "stopped learning" not in caplog.text
    for step in range(5, 12):
        watch.check(step, uniform, 0.0)
    assert caplog.text.count("stopped learning") == 1


@pytest.mark.slow
def test_epochs_size_the_run_once_the_rows_are_packed(tmp_path):
    """train.epochs: ceil(epochs × packed rows / global batch) steps, and the schedule spans them
    (its learning rates against transformers' own schedule over that many steps)."""
    from transformers import get_cosine_schedule_with_warmup

    overrides = [
        "parallel.tp=1",
        "data.max_samples=40",
        "data.packing=true",
        "train.epochs=1.5",
        "train.log_every=1",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "optim.warmup_steps=2",
        "checkpoint.save_final=false",
        f"hydra.run.dir={tmp_path}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "dtrain.sft", *overrides],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    rows = int(re.search(r"40 training examples in (\d+) rows of 32 \(packed\)", result.stdout).group(1))
    assert rows < 40  # packed
    steps = math.ceil(1.5 * rows / 8)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    peak = config["optim"]["lr"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    expected = []
    for _ in range(steps):
        expected.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert [r["lr"] for r in logged] == pytest.approx(expected, rel=1e-12)


def test_plot_draws_one_line_per_run_with_the_overrides_that_differ(tmp_path):
    """A metrics.jsonl written before resumes truncated it (steps 1 2 3 2 3 4) is one line in step
    order, the resumed run's records winning; legend labels are what tells the runs apart."""
    from dtrain.plot import labels, read_records

    runs = []
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        run = tmp_path / name
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(
            f"- +experiment=embedded\n- train.max_steps=4\n- optim.lr={lr}\n"
        )
        losses = [(1, 9.0), (2, 8.0), (3, 7.0), (2, 8.5), (3, 7.5), (4, 6.5)]
        lines = [json.dumps({"step": step, "loss": loss}) + "\n" for step, loss in losses]
        (run / "metrics.jsonl").write_text("".join(lines))
        runs.append(run)
    assert [(r["step"], r["loss"]) for r in read_records(runs[0])] == [(1, 9.0), (2, 8.5), (3, 7.5), (4, 6.5)]
    assert labels(runs, tmp_path) == ["optim.lr=1e-3", "optim.lr=3e-3"]
    assert labels(runs[:1], tmp_path) == ["a"]


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    """One process (`python -m dtrain.sft`, where the terminal's Ctrl-C reaches the trainer itself):
    the first SIGINT asks for a save at the next step boundary, the second, before it, stops."""
    command = [sys.executable, "-m", "dtrain.sft", "parallel.tp=1", f"train.max_steps={STEPS}"]
    command += ["train.log_every=1", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_TEST_STEP_SLEEP_S": "3"}
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        deadline = time.time() + 600
        log = tmp_path / "metrics.jsonl"
        while time.time() < deadline and not (log.is_file() and log.read_text().strip()):
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)  # within the 3 s before the next step's agreement sees the first one
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output[-3000:]
    assert "received SIGINT" in output and "dtrain: interrupted again: stopping without saving" in output
    assert "Traceback" not in output
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_a_run_pauses_the_garbage_collector_and_gives_it_back():
    """dtrain.trainer.train (and the entry points' imports) run under collector.paused: automatic
    collection off inside, the state before restored after it, a failed run included (a sweep's next
    job, a caller's process), and a caller's own choice to keep it off kept."""
    assert train.__wrapped__  # train is collector.paused's
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector.paused():
        raise RuntimeError("a failed run")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
