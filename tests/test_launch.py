"""Launching: a Hydra sweep under torchrun (one process group, a folder per job, failed jobs
recorded), the same sweep through submitit_local with 2 tasks per job, two "nodes" on loopback
with c10d rendezvous, and the launch/ scripts. Every curve is checked against a run of the same
world size launched another way."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, read_metrics, run, torchrun, wandb_records

# Two ranks, dp=2, a curve that moves from step 1 (no warm-up) and two schedules to tell jobs apart.
COMMON = ["train.max_steps=3", "train.log_every=1", "optim.warmup_steps=0", "parallel.tp=1"]


def sft(*overrides: str, multirun: bool = False) -> list[str]:
    return ["-m", "dtrain.sft", *(["--multirun"] if multirun else []), *COMMON, *overrides]


def losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir)]


def status(job_dir: Path) -> dict:
    return yaml.safe_load((job_dir / "job_status.yaml").read_text())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """3 jobs on one torchrun of 2 ranks: two schedules, and one job whose config is bad."""
    folder = tmp_path_factory.mktemp("sweep") / "sweep"
    args = sft("optim.schedule=cosine,constant,bogus", "logging.wandb.mode=offline", multirun=True)
    result = torchrun(2, *args, f"hydra.sweep.dir={folder}", timeout=300, env={"WANDB_API_KEY": ""})
    return folder, result


@pytest.mark.slow
def test_sweep_runs_every_job_in_its_own_folder_on_one_process_group(sweep):
    folder, result = sweep
    assert sorted(p.name for p in folder.iterdir()) == ["0", "1", "2", "multirun.yaml"]  # no rank folders
    for job, schedule in ((0, "cosine"), (1, "constant")):
        job_dir = folder / str(job)
        assert status(job_dir)["status"] == "COMPLETED"
        assert f"schedule: {schedule}" in (job_dir / "config.yaml").read_text()
        assert (job_dir / ".hydra" / "overrides.yaml").is_file()
        assert [r["step"] for r in read_metrics(job_dir)] == [1, 2, 3]
    cosine, constant = losses(folder / "0"), losses(folder / "1")
    assert cosine[:2] == constant[:2] and cosine[2] != constant[2]  # the schedules part after step 2
    assert result.stdout.count("Launching 3 jobs locally") == 1  # one Hydra sweep, not one per rank


@pytest.mark.slow
def test_a_failed_job_is_recorded_and_the_sweep_goes_on(sweep):
    folder, result = sweep
    failed = status(folder / "2")
    assert failed["status"] == "FAILED" and "optim.schedule='bogus'" in failed["error"]
    assert "optim.schedule=bogus" in failed["overrides"]
    assert not (folder / "2" / "metrics.jsonl").exists()
    assert result.returncode != 0  # the sweep as a whole reports the failure
    assert "job 2 (" in result.stdout and "failed: optim.schedule='bogus'" in result.stdout


@pytest.mark.slow
def test_each_job_is_its_own_wandb_run_grouped_by_sweep(sweep):
    folder, _ = sweep
    for job in ("0", "1"):
        (run_file,) = (folder / job / "wandb").glob("offline-run-*/run-*.wandb")
        (run_record,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
        assert run_record.run_group == folder.name
        history = [r.history for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
        logged = [json.loads(next(i.value_json for i in h.item if i.nested_key == ["loss"])) for h in history]
        assert logged == losses(folder / job)


@pytest.mark.slow
def test_stop_ends_the_sweep_at_the_failed_job(tmp_path):
    args = sft("optim.schedule=bogus,cosine", "train.sweep_on_failure=stop", multirun=True)
    result = run([sys.executable, *args, f"hydra.sweep.dir={tmp_path}"], timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "train.sweep_on_failure=stop: the sweep ends here" in result.stdout
    assert status(tmp_path / "0")["status"] == "FAILED"
    assert not (tmp_path / "1").exists()


@pytest.mark.slow
def test_submitit_local_sweep_with_two_tasks_per_job(sweep, tmp_path):
    """hydra/launcher=submitit_local: a job is 2 processes that take their ranks from submitit, and
    trains the same curve as the torchrun sweep's job (one job: several jobs in one sweep, a failed
    one included, are the torchrun sweep's cases)."""
    reference, _ = sweep
    launcher = [
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=5",
    ]
    args = sft(*launcher, "optim.schedule=cosine", multirun=True)
    result = run([sys.executable, *args, f"hydra.sweep.dir={tmp_path}"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    for job in ("0",):
        assert status(tmp_path / job)["status"] == "COMPLETED"
        assert "'dp_shard': 2" in (tmp_path / job / "sft.log").read_text()
        assert (tmp_path / job / "sft.log").read_text().count("step 3/3") == 1  # rank 0 alone logs
        assert losses(tmp_path / job) == pytest.approx(losses(reference / job), rel=1e-6)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_match_one_node(sweep, tmp_path):
    """Two torchrun agents (--nnodes=2, one process each) meet through c10d on 127.0.0.1."""
    reference, _ = sweep
    rendezvous = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=loopback",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        *sft(),
        f"hydra.run.dir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(tmp_path / "node1.log", "w") as node1_log:
        node1 = subprocess.Popen(command, cwd=ROOT, env=env, stdout=node1_log, stderr=subprocess.STDOUT)
        try:
            node0 = run(command, timeout=300)
            assert node1.wait(timeout=120) == 0, (tmp_path / "node1.log").read_text()[-3000:]
        finally:
            node1.kill()
    assert node0.returncode == 0, node0.stdout[-3000:]
    assert losses(tmp_path) == pytest.approx(losses(reference / "0"), rel=1e-6)


def test_launch_scripts_parse():
    for script in ("launch/local.sh", "launch/slurm.sbatch"):
        assert run(["bash", "-n", str(ROOT / script)]).returncode == 0, script
    sbatch = (ROOT / "launch" / "slurm.sbatch").read_text()
    assert "--rdzv-backend=c10d" in sbatch and "--rdzv-id" in sbatch


# The signal a scheduler sends, once the run has logged this step (a checkpoint after step 2 or 3).
SIGNAL_AFTER_STEP = 1
SLOW = {"DTRAIN_TEST_STEP_SLEEP_S": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def signal_mid_run(
    command: list[str], cwd: Path, env: dict, run_dir: Path, signum: int | None, target=None
) -> tuple[int, str]:
    """`command` in `cwd`; `signum` (if any) to its process (or to the pid `target(process)` names)
    once the run in `run_dir` logged step SIGNAL_AFTER_STEP. The exit code and output."""
    metrics = run_dir / "metrics.jsonl"
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        deadline = time.time() + 600
        while signum and time.time() < deadline and process.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= SIGNAL_AFTER_STEP:
                os.kill(target(process) if target else process.pid, signum)
                break
            time.sleep(0.05)
        output, _ = process.communicate(timeout=600)
    return process.returncode, output


STUBS = {
    # scontrol: records its arguments; `show hostnames` names this machine as the only node
    "scontrol": 'echo "scontrol $*" >> "$STUB_LOG"\nif [ "$1" = show ]; then echo 127.0.0.1; fi\n',
    # srun: records its arguments and runs the task itself on this node (its options dropped)
    "srun": 'echo "srun $*" >> "$STUB_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\n'
    'export SLURM_NNODES=1 SLURMD_NODENAME=node0\nexec "$@"\n',
}


@pytest.mark.slow
def test_slurm_passes_sigusr1_on_requeues_on_75_and_the_requeued_job_resumes(tmp_path):
    """launch/slurm.sbatch as SLURM runs it (its own code path; `srun` and `scontrol` are stubs on
    PATH that record their arguments, srun running the one node's task here): SIGUSR1 to the batch
    script (the time limit's warning) reaches the workers through srun and the launcher, they save
    and exit 75, the script runs `scontrol requeue JOB`; the requeued job (the same script and job
    id again) resumes from that checkpoint and finishes, each step logged once. One GPU a node
    (SLURM_GPUS_ON_NODE=1): one worker shows the way as 8 would."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}")
        (stubs / name).chmod(0o755)
    (tmp_path / "logs").mkdir()  # sbatch's --output needs it before the script runs
    env = {
        **os.environ,
        **SLOW,
        "PATH": f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STUB_LOG": str(tmp_path / "stubs.log"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node0",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    command = ["bash", str(ROOT / "launch" / "slurm.sbatch"), "train.max_steps=5", "train.log_every=1"]
    run_dir = tmp_path / "outputs" / "sft" / "embedded"
    code, output = signal_mid_run(command, tmp_path, env, run_dir, signal.SIGUSR1)
    assert code == 75, output[-3000:]
    assert "received SIGUSR1" in output and "dtrain: preempted: requeueing job 4242" in output
    calls = (tmp_path / "stubs.log").read_text().splitlines()
    assert calls[-1] == "scontrol requeue 4242", calls
    (saved,) = [int(path.name.removeprefix("step-")) for path in (run_dir / "checkpoints").iterdir()]
    assert SIGNAL_AFTER_STEP <= saved < 5

    code, output = signal_mid_run(command, tmp_path, {**env, "DTRAIN_TEST_STEP_SLEEP_S": "0"}, run_dir, None)
    assert code == 0, output[-3000:]
    assert f"resuming outputs/sft/embedded at step {saved}" in output
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert (tmp_path / "stubs.log").read_text().count("requeue") == 1  # not after a finished run


@pytest.mark.slow
def test_the_kubernetes_launcher_as_pid_1_passes_sigterm_on(tmp_path):
    """launch/k8s/pytorchjob.yaml's container command, as the container runs it: PID 1 of a pid
    namespace of its own (`unshare`), with the yaml's environment and what the operator sets
    (PET_*: one node, one process). SIGTERM to PID 1 (Kubernetes' stop; the kernel drops a signal a
    namespace's init does not handle): the worker saves, and the container exits 143 (75 through
    DTRAIN_PREEMPTED_EXIT_CODE), which restartPolicy ExitCode restarts. The run's own overrides (the
    experiment, the shared volume) are the test's."""
    (job,) = yaml.safe_load_all((ROOT / "launch" / "k8s" / "pytorchjob.yaml").read_text())
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    args = []
    for arg in container["args"]:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)  # Kubernetes' own substitution
        if arg.startswith("+experiment="):
            arg = "train.max_steps=5"
        args.append(arg.replace("/shared/", f"{tmp_path}/"))
    operator = {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
    }
    namespace = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc"]
    probe = run([*namespace, "true"])
    assert probe.returncode == 0, f"this test needs unprivileged user namespaces (unshare): {probe.stdout}"

    def pid_1(process: subprocess.Popen) -> int:
        (child,) = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        return int(child)

    command = [*namespace, *container["command"], *args, "train.log_every=1"]
    run_dir = tmp_path / "runs" / env["RUN_NAME"]
    full_env = {**os.environ, **SLOW, **env, **operator}
    code, output = signal_mid_run(command, ROOT, full_env, run_dir, signal.SIGTERM, target=pid_1)
    assert code == 143, output[-3000:]
    assert "received SIGTERM" in output and "dtrain: preempted: checkpoint saved after step" in output
    assert list((run_dir / "checkpoints").glob("step-*"))
