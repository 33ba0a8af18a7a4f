"""Every command of the README's ```bash blocks, and of the docs' (DOCUMENTS), runs as a user types
it, from a folder outside the repo, so an edit that breaks one fails here. What a 2-core CPU
machine without network cannot run as written is changed by SUBSTITUTIONS (applied to the block's
text, each listed with why), and every `dtrain.sft` run gets TINY_RUN (a step count this machine
affords) and a run folder of its own. `./launch/local.sh` and `./scripts/test.sh` are run by
test_cli.py and by CI; the commands that need a cluster (sbatch, kubectl, submitit_slurm) or take
long (the benchmark, the GPU check) are inline text, not bash blocks, and test_launch.py runs the
cluster ones' local equivalents."""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from tests.helpers import ROOT, run, save_user_model, write_user_dataset

COVERED_ELSEWHERE = {"./launch/local.sh", "./scripts/test.sh"}
TINY_RUN = ["train.max_steps=2"]
# A hub model cannot be downloaded here: experiments run on the fixture folder (4 KV heads, so tp=4
# divides them) with a batch and length a CPU affords; the rest keeps the experiment's settings.
EXPERIMENT_ON_FIXTURE = (
    "model.name_or_path={model} data.path={data} data.system_key=null data.max_len=64 "
    "train.global_batch_size=8 train.micro_batch_size=2 train.precision=fp32"
)
SUBSTITUTIONS = [
    ("/path/to/hf_folder", "{model}"),  # the user's folder: the fixture
    ("data.path=my.jsonl", "data.path={data}"),  # the user's data: the fixture
    ("--nproc_per_node=8", "--nproc_per_node=4"),  # 2 cores: 4 processes at most
    ("step-00000040", "step-00000002"),  # the step TINY_RUN's final save writes
]


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
RUNNABLE = [
    command for document in DOCUMENTS for command in COMMANDS[document] if command not in COVERED_ELSEWHERE
]


def test_the_docs_have_their_commands():
    assert COVERED_ELSEWHERE <= set(COMMANDS["README.md"])
    assert any("model.name_or_path=/path/to/hf_folder" in command for command in COMMANDS["README.md"])
    assert len(COMMANDS["README.md"]) >= 9, COMMANDS["README.md"]  # set-up, Use and the sweep
    assert any("dtrain.export" in command for command in COMMANDS["docs/checkpoints.md"])
    assert len(RUNNABLE) >= 10, RUNNABLE  # Use, sweep, checkpoint: save, resume, export


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder outside the repo, with the fixtures; the commands run in it one after the other
    (the resume and the export use the first run's checkpoint)."""
    folder = tmp_path_factory.mktemp("readme")
    model = save_user_model(folder / "fixture_model", num_key_value_heads=4)
    data = write_user_dataset(folder / "fixture.jsonl")
    return folder, {"model": str(model), "data": str(data)}


def run_id(index: int) -> str:
    """Each command's DTRAIN_RUN_ID, so that sweeps get folders of their own."""
    return f"readme-{index}"


def as_run_here(command: str, index: int, fixtures: dict[str, str]) -> list[str]:
    command = command.replace(
        "<run id>", run_id(index - 1)
    )  # `dtrain.plot multirun/<run id>`: the sweep before
    for old, new in SUBSTITUTIONS:
        command = command.replace(old, new)
    args = shlex.split(command.format(**fixtures))
    if "dtrain.sft" in args:
        args += TINY_RUN
        if any(arg.startswith("+experiment=") for arg in args):
            args += EXPERIMENT_ON_FIXTURE.format(**fixtures).split()
        if not any(arg.startswith(("hydra.run.dir=", "--multirun")) for arg in args):
            args.append(f"hydra.run.dir=outputs/command-{index}")
    if args[0] == "python":
        args[0] = sys.executable
    elif args[0] == "torchrun":
        args[:1] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUNNABLE)), ids=[c[:60] for c in RUNNABLE])
def test_readme_command_runs(workdir, index):
    folder, fixtures = workdir
    args = as_run_here(RUNNABLE[index], index, fixtures)
    result = run(args, timeout=300, cwd=folder, env={"DTRAIN_RUN_ID": run_id(index)})
    assert result.returncode == 0, f"{shlex.join(args)}\n{result.stdout[-5000:]}"
    assert os.path.isdir(folder)
