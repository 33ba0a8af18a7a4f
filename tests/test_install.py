"""A regular (non-editable) install: the wheel carries the configs and assets, so `python -m
dtrain.sft` and `dtrain.estimate` run from any directory, and `--config-dir` adds a user's own
experiments. The fresh virtual environment sees the dev environment's packages (torch and the
rest) through a .pth file, but not its editable dtrain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_metrics, run

pytestmark = pytest.mark.slow  # every test launches processes


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install")
    wheels = root / "wheels"
    build = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:]
    venv = root / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = run([str(python), "-c", "import site; print(site.getsitepackages()[0])"]).stdout.strip()
    dev = [path for path in sys.path if path.endswith("site-packages") and Path(path).is_dir()]
    (Path(own) / "dev_packages.pth").write_text("".join(f"{path}\n" for path in dev))
    wheel = next(wheels.glob("dtrain-*.whl"))
    install = run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", str(wheel)])
    assert install.returncode == 0, install.stdout[-3000:]
    return python


def test_the_installed_package_is_the_wheel(installed, tmp_path):
    result = run([str(installed), "-c", "import dtrain; print(dtrain.__file__)"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert str(installed.parents[1]) in result.stdout and str(ROOT) not in result.stdout


def test_training_with_a_users_experiment_and_planning_from_another_directory(installed, tmp_path):
    """torchrun trains from outside the repo (one rank: what the wheel must carry does not depend on
    the ranks), the run's settings from the user's own experiment (`--config-dir`, beside the packaged
    ones); the planner runs there too."""
    mine = tmp_path / "mine" / "experiment"
    mine.mkdir(parents=True)
    (mine / "short.yaml").write_text("# @package _global_\ntrain:\n  max_steps: 1\n  global_batch_size: 8\n")
    train = [str(installed), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    args = ["-m", "dtrain.sft", "--config-dir", "mine", "+experiment=short", "hydra.run.dir=run"]
    result = run([*train, *args], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    assert [record["step"] for record in read_metrics(tmp_path / "run")] == [1]
    assert "global_batch_size: 8" in (tmp_path / "run" / "config.yaml").read_text()
    plan = run([str(installed), "-m", "dtrain.estimate", "estimate.world_size=2"], cwd=tmp_path)
    assert plan.returncode == 0 and "peak" in plan.stdout, plan.stdout[-4000:]
