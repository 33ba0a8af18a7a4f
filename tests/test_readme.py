"""Every command of the README's ```bash blocks, and of the docs' (DOCUMENTS), runs as a user types
it after the README's set-up, from a folder outside the repo, so an edit that breaks one fails here:
in a shell without the virtual environment (as a new terminal is), after the README's commands that
set the shell up (SHELL_SETUP: `source .venv/bin/activate`), `python`, `torchrun` and the launch
scripts as found there. What a 2-core CPU machine without network cannot run as written is changed
by SUBSTITUTIONS (applied to the block's text, each listed with why), and every run (`dtrain.sft`,
`dtrain.dpo`, `dtrain.grpo`, `./launch/local.sh`) gets TINY_RUN (a step count this machine affords) and a run
folder of its own. Each command must leave what it makes (a run's config and metrics, a sweep's
jobs, an export, a plot, a plan's table). COVERED_ELSEWHERE names the commands another test already
runs as typed; the commands that need a cluster (sbatch, kubectl, submitit_slurm) or take long (the
benchmark, the GPU check) are inline text, not bash blocks, and test_launch.py runs the cluster
ones' local equivalents."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_metrics, save_user_model, write_user_dataset

# Commands another test already runs as typed (so this file does not pay for them twice):
COVERED_ELSEWHERE = {
    "./launch/local.sh",  # test_metrics.py
    "./scripts/test.sh",  # CI itself
    # test_metrics.py's ./launch/local.sh is this torchrun of the embedded default at NPROC=4
    "torchrun --nproc_per_node=4 -m dtrain.sft",
    # test_estimate.py plans this Llama-3-8B experiment through the same CLI (its JSON output)
    "python -m dtrain.estimate +experiment=llama3_8b_seed estimate.world_size=4",
    # test_qlora.py runs the QLoRA line (README, lora.md) on 4 processes, one step, and loads its
    # export in PEFT
    "torchrun --nproc_per_node=4 -m dtrain.sft model.name_or_path=/path/to/hf_folder data.path=my.jsonl "
    "data.input_key=question parallel.tp=2 lora.r=16 lora.base_dtype=nf4 checkpoint.export_hf=true",
}
TINY_RUN = ["train.max_steps=2"]
TRAINING = ("dtrain.sft", "dtrain.dpo", "dtrain.grpo")  # the entry points that train: TINY_RUN each
# A resume (docs/checkpoints.md's, from TINY_RUN's final checkpoint) trains 2 steps more: a run whose
# checkpoint is at train.max_steps has nothing to train (and says so, writing nothing).
RESUMED_RUN = ["train.max_steps=4"]
# A hub model cannot be downloaded here: experiments run on the fixture folder (4 KV heads, so tp=4
# divides them) with a batch and length a CPU affords; the rest keeps the experiment's settings.
EXPERIMENT_ON_FIXTURE = (
    "model.name_or_path={model} data.path={data} data.system_key=null data.max_len=64 "
    "train.global_batch_size=8 train.micro_batch_size=2 train.precision=fp32"
)
SUBSTITUTIONS = [
    ("/path/to/hf_folder", "{model}"),  # the user's folder: the fixture
    ("data.path=my.jsonl", "data.path={data}"),  # the user's data: the fixture
    # 2 cores: half the processes (before 8 -> 4): the 4-process commands' tp is 2 at most, the
    # 8-process ones' 4; test_metrics runs the embedded default on 4 (./launch/local.sh); the launch
    # script's 4 CPU processes: NPROC=2 in the environment (LAUNCH_ENV)
    ("--nproc_per_node=4", "--nproc_per_node=2"),
    ("--nproc_per_node=8", "--nproc_per_node=4"),
    ("step-00000040", "step-00000002"),  # the step TINY_RUN's final save writes
    # torchrun's default rendezvous is port 29500 of this machine, which the suite's other launches
    # (two pytest workers) would meet at: a free port each (the launch script does the same)
    ("torchrun ", "torchrun --standalone "),
    # the commands run outside the checkout (their outputs must not land in it): its paths absolute
    ("source .venv/", "source {venv}/"),
    ("./launch/", "{root}/launch/"),
]
LAUNCH_ENV = {"NPROC": "2"}


# docs/estimate.md's commands plan Llama-3-8B and -70B (minutes of CPU): test_estimate.py runs the
# planner's command line on smaller plans.
NOT_RUN_HERE = {"docs/estimate.md"}
DOCUMENTS = ["README.md"] + [
    path.relative_to(ROOT).as_posix()
    for path in sorted((ROOT / "docs").glob("*.md"))
    if path.relative_to(ROOT).as_posix() not in NOT_RUN_HERE
]


def bash_commands(document: str) -> list[str]:
    """The commands of a document's bash blocks: continuation lines joined, comments dropped."""
    text = (ROOT / document).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


COMMANDS = {document: bash_commands(document) for document in DOCUMENTS}
# What the set-up leaves the user's shell with, replayed before every command: the README's commands
# that change the shell itself, not a process.
SHELL_SETUP = [command for command in COMMANDS["README.md"] if command.split()[0] in ("source", "export")]
# Each command once, in the order of its first appearance (README's sweep and its plot are also
# docs/launching.md's: the same text, run once).
RUNNABLE = list(
    dict.fromkeys(
        command
        for document in DOCUMENTS
        for command in COMMANDS[document]
        if command not in COVERED_ELSEWHERE and command not in SHELL_SETUP
    )
)
VENV = Path(sys.prefix)  # the environment scripts/venv.sh made (.venv, or DTRAIN_VENV's)


def test_the_docs_have_their_commands():
    assert COVERED_ELSEWHERE <= set(COMMANDS["README.md"])
    assert any("model.name_or_path=/path/to/hf_folder" in command for command in COMMANDS["README.md"])
    assert len(COMMANDS["README.md"]) >= 9, COMMANDS["README.md"]  # set-up, Use and the sweep
    assert any("dtrain.export" in command for command in COMMANDS["docs/checkpoints.md"])
    assert len(RUNNABLE) >= 8, RUNNABLE  # Use, sweep and its plot, checkpoint: save, resume, export
    # the set-up's commands: the launch script first (it makes .venv), then the shell's
    assert COMMANDS["README.md"][0] == "./launch/local.sh" and SHELL_SETUP, COMMANDS["README.md"][:3]


def shell_without_the_venv() -> dict[str, str]:
    """The environment of a new terminal: this one's, without the virtual environment on PATH."""
    bins = {(VENV / "bin").resolve(), Path(sys.executable).parent.resolve()}
    entries = os.environ["PATH"].split(os.pathsep)
    path = [entry for entry in entries if entry and Path(entry).resolve() not in bins]
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    return {**env, "PATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder outside the repo, with the fixtures; the commands run in it one after the other
    (the resume and the export use the first run's checkpoint)."""
    folder = tmp_path_factory.mktemp("readme")
    model = save_user_model(folder / "fixture_model", num_key_value_heads=4)
    data = write_user_dataset(folder / "fixture.jsonl")
    return folder, {"model": str(model), "data": str(data)}


def substituted(command: str, fixtures: dict[str, str]) -> str:
    for old, new in SUBSTITUTIONS:
        command = command.replace(old, new)
    return command.format(**fixtures, root=ROOT, venv=VENV)


def trains(args: list[str]) -> bool:
    return any(entry in args for entry in TRAINING) or args[0].endswith("launch/local.sh")


def as_run_here(command: str, index: int, fixtures: dict[str, str]) -> list[str]:
    args = shlex.split(substituted(command, fixtures))
    if trains(args):
        args += RESUMED_RUN if any(arg.startswith("checkpoint.resume=") for arg in args) else TINY_RUN
        if any(arg.startswith("+experiment=") for arg in args):
            args += EXPERIMENT_ON_FIXTURE.format(**fixtures).split()
        if not any(arg.startswith(("hydra.run.dir=", "--multirun")) for arg in args):
            args.append(f"hydra.run.dir=outputs/command-{index}")
    return args


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUNNABLE)), ids=[c[:60] for c in RUNNABLE])
def test_readme_command_runs(workdir, index):
    folder, fixtures = workdir
    args = as_run_here(RUNNABLE[index], index, fixtures)
    script = " && ".join([*(substituted(line, fixtures) for line in SHELL_SETUP), shlex.join(args)])
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=folder,
        env={**shell_without_the_venv(), **LAUNCH_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{script}\n{result.stdout[-5000:]}"
    assert_made_its_outputs(args, folder, index, result.stdout)


def assert_made_its_outputs(args: list[str], folder: Path, index: int, stdout: str) -> None:
    """What each kind of command leaves: a run's config.yaml and its metrics up to TINY_RUN's step (a
    resume: RESUMED_RUN's), every sweep job's metrics, an
    export's config.json and weights, a plot's PNG, a plan's table."""
    if trains(args):
        if "--multirun" in args:
            # the sweep's folder is named by its overrides; the README's plot command names it, and
            # the plot's test checks that name
            (jobs,) = [len(a.split("=", 1)[1].split(",")) for a in args if "=" in a and "," in a]
            (sweep,) = [path for path in (folder / "multirun").glob("*/*") if path.is_dir()]
            for job in range(jobs):
                assert read_metrics(sweep / str(job))[-1]["step"] == 2, job
            return
        (run_dir,) = [folder / a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
        assert (run_dir / "config.yaml").is_file(), run_dir
        resumed = any(a.startswith("checkpoint.resume=") for a in args)
        assert read_metrics(run_dir)[-1]["step"] == (4 if resumed else 2)
    elif "dtrain.export" in args:
        out = folder / args[args.index("dtrain.export") + 2]
        assert (out / "config.json").is_file() and list(out.glob("*.safetensors")), sorted(out.iterdir())
    elif "dtrain.plot" in args:
        assert (folder / args[args.index("dtrain.plot") + 1] / "curves.png").is_file()
    elif "dtrain.estimate" in args:
        assert "peak" in stdout, stdout[-3000:]
    else:
        raise AssertionError(f"no expected output for {shlex.join(args)}: add its kind here")
