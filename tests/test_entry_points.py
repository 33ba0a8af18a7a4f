"""Every objective (dtrain/objectives/: OBJECTIVES) is an entry point wherever a user meets one: the
package's description names it, the launch scripts take it, its runs have folders of their own, and
its own group names them.
Each rule reads OBJECTIVES, so an objective added there (dtrain.grpo, dtrain.distill) fails here until
it is everywhere."""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import fields

import yaml

from dtrain.checkpoint import other_run_in
from dtrain.config import RUN_IDENTITY
from dtrain.hydra_glue import output_folder, pin_run_name
from dtrain.objectives import OBJECTIVES
from tests.helpers import ROOT


def test_the_package_description_names_every_objective():
    (description,) = re.findall(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    missing = [name for name in OBJECTIVES if name not in description.lower()]
    assert not missing, f"pyproject.toml's description does not name {missing}: {description!r}"


def test_each_entry_point_names_its_own_run_folders(monkeypatch):
    """The same command line under two entry points names two folders (an SFT run no longer lands in
    the DPO run's folder, refused there as "a different data"), as runner.main pins the name."""
    folders = {}
    monkeypatch.setenv("DTRAIN_RUN_NAME", "")  # recorded, so that monkeypatch unsets it after the test
    for name in OBJECTIVES:
        monkeypatch.delenv("DTRAIN_RUN_NAME")
        overrides = ["model.name_or_path=/models/llama", "optim.lr=1e-5"]
        pin_run_name(name, overrides)
        folders[name] = output_folder(overrides)
        assert folders[name].parts[:2] == ("outputs", name), folders[name]
        monkeypatch.delenv("DTRAIN_RUN_NAME")
        pin_run_name(name, [*overrides, "--multirun"])
        assert output_folder([*overrides, "--multirun"]).parts[:2] == ("multirun", name)
    assert len(set(folders.values())) == len(OBJECTIVES), folders


def test_a_run_folder_of_another_entry_point_is_refused_saying_so(tmp_path):
    """hydra.run.dir naming another entry point's run: refused naming that, not a difference of data."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    preference = {"model": {"name_or_path": "m"}, "data": {"path": "pairs.jsonl"}, "dpo": {"beta": 0.1}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(preference))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    supervised = {"model": {"name_or_path": "m"}, "data": {"path": "rows.jsonl"}}
    message = other_run_in(run_dir, run_dir / "checkpoints", supervised)
    assert message == f"{run_dir / 'config.yaml'} is from another entry point's run (it has the dpo group)"


def test_what_names_a_run_folder_is_one_list_that_the_docs_give():
    """docs/launching.md's list of the keys that name a run folder is config.RUN_IDENTITY, which holds
    the shared groups of what is trained and each objective's own group (dtrain.dpo's `dpo`)."""
    readme = " ".join((ROOT / "docs" / "launching.md").read_text().split())
    (listed,) = re.findall(r"overrides of what is trained \(([^()]*?): `RUN_IDENTITY`", readme)
    assert re.findall(r"`([^`]+)`", listed) == list(RUN_IDENTITY)
    for spec in OBJECTIVES.values():
        if spec.name in {group.name for group in fields(spec.schema)}:
            assert spec.name in RUN_IDENTITY, f"{spec.name}'s own group does not name its run folders"


def entry_point_of(*args: str) -> subprocess.CompletedProcess:
    """What the launch scripts make of their arguments (launch/entry_point.sh): MODULE and the rest."""
    script = f'ROOT={shlex.quote(str(ROOT))}; source "$ROOT/launch/entry_point.sh"; echo "$MODULE" "$@"'
    return subprocess.run(["bash", "-c", script, "launch", *args], capture_output=True, text=True)


def test_the_launch_scripts_take_every_entry_point_and_refuse_other_words():
    """`./launch/local.sh NAME overrides` runs dtrain.NAME for every objective, dtrain.sft without a
    NAME; a word that is no entry point is refused in one line naming them all (exit 2)."""
    for name in OBJECTIVES:
        assert entry_point_of(name, "optim.lr=1e-4").stdout == f"dtrain.{name} optim.lr=1e-4\n"
    assert entry_point_of("optim.lr=1e-4").stdout == "dtrain.sft optim.lr=1e-4\n"
    assert entry_point_of("+experiment=embedded_dpo").stdout == "dtrain.sft +experiment=embedded_dpo\n"
    refused = entry_point_of("estimate", "optim.lr=1e-4")
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr == (
        "dtrain: error: estimate is not an entry point: the first argument, if not an override "
        f"(KEY=VALUE), is one of {', '.join(sorted(OBJECTIVES))}\n"
    )
