"""What the Hydra entry points (dtrain.sft, dtrain.dpo, dtrain.estimate) share: the schema registered as
`dtrain_schema` (which conf/config.yaml names), the resolvers conf/ uses, and how a bad config ends.

Each entry point registers its own schema: dtrain.sft the training `Config`, dtrain.dpo
`PreferenceConfig` (the same plus the `dpo` group), dtrain.estimate `PlanConfig` (that plus the
`estimate` group), so each rejects the keys it does not take.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dtrain.config import RUN_IDENTITY, Config, ConfigError
from dtrain.distributed import rank_from_env
from dtrain.reliability import write_exit_status

ASSETS = Path(__file__).parent / "assets"
CONF = Path(__file__).parent / "conf"  # shipped inside the package; add your own with --config-dir
EXIT_CONFIG_ERROR = 2
# An objective's embedded default (its tuned settings, e.g. conf/experiment/embedded.yaml) applies to a
# command line that names none of these: a model, a dataset or an experiment of its own gets the
# schema's defaults.
_GROUPS = ("model", "data", "experiment")
_SOURCES = ("model.name_or_path", "data.path", "data.mix")
FAIL_GRACE_S = 5.0
PROBE_BYTES = 1 << 16  # what a run writes before its first step (Hydra's files, config.yaml) fits


# What names a run folder: the entry point (its objective: sft, dpo, ...), the experiment and the
# overrides of what is trained (RUN_IDENTITY: the model, the data, the optimizer, LoRA, the
# objective's own group, the seed, the global batch). The rest (the mesh, the step count, logging,
# checkpoints) changes how a run goes, not which run it is: rerunning with other values of those
# finds the same folder and resumes it. One name for every rank and node, computed from the command
# line alone: never from a launcher's random id.
_RUN_NAME = "DTRAIN_RUN_NAME"  # set by runner.main for the resolver; not a user setting
_SAFE_NAME = re.compile(r"[\w.,=+-]{1,100}")


def run_name(overrides: list[str]) -> str:
    """The run folder's name for a command line's overrides (after the program name): the experiment
    (or the model folder's name) alone, or followed by the sorted identity overrides, or by a hash of
    them where they are too long or hold characters a folder name should not (`/`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    base, picked = None, []
    for text in overrides:
        if text.startswith("-") or "=" not in text:  # --multirun, --config-dir DIR ...
            continue
        try:
            override = parser.parse_override(text)
        except Exception:  # a malformed override: Hydra reports it with its own message
            continue
        key = override.key_or_group
        if key == "experiment":
            base = str(override.value())
        elif key in ("model", "model.name_or_path") and base is None:
            base = Path(str(override.value())).name
        if key == "experiment" or key.startswith("hydra"):
            continue
        if any(key == name or key.startswith(f"{name}.") for name in RUN_IDENTITY):
            picked.append(text.lstrip("+~"))
    base = base if base and _SAFE_NAME.fullmatch(base) else "run"
    if not picked:
        return base
    readable = f"{base}_{','.join(sorted(picked))}"
    if _SAFE_NAME.fullmatch(readable):
        return readable
    return f"{base}-{hashlib.sha1(' '.join(sorted(picked)).encode()).hexdigest()[:8]}"


def pin_run_name(entry: str, overrides: list[str]) -> None:
    """Compute the run folder's name once, in the process that launches (submitit's jobs inherit it):
    `ENTRY/NAME`, the entry point (dtrain.ENTRY) then run_name, so two entry points given the same
    overrides never share a folder."""
    os.environ.setdefault(_RUN_NAME, f"{entry}/{run_name(overrides)}")


def pinned_run_name() -> str:
    """The pinned name (runner.main pins it), else this process's command line's."""
    return os.environ.get(_RUN_NAME) or run_name(sys.argv[1:])


def output_folder(overrides: list[str]) -> Path | None:
    """The run folder (the sweep folder with --multirun) the command line asks for, as conf/config.yaml
    names it unless hydra.run.dir (hydra.sweep.dir) is given; None when that holds an interpolation."""
    sweeping = "--multirun" in overrides or "-m" in overrides
    key = "hydra.sweep.dir=" if sweeping else "hydra.run.dir="
    given = [text.removeprefix(key) for text in overrides if text.startswith(key)]
    if given:
        return None if "${" in given[-1] else Path(given[-1])
    return Path("multirun" if sweeping else "outputs") / pinned_run_name()


def override_keys(overrides: list[str]) -> list[str]:
    """The keys (or groups) a command line's overrides set, in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys = []
    for text in overrides:
        if text.startswith("-") or "=" not in text:  # --multirun, --config-dir DIR ...
            continue
        try:
            keys.append(parser.parse_override(text).key_or_group)
        except Exception:  # a malformed override: Hydra reports it with its own message
            continue
    return keys


def with_embedded_defaults(overrides: list[str], embedded: str) -> list[str]:
    """`overrides` (a command line after the program name) plus `embedded` (an objective's embedded
    default, e.g. `+experiment=embedded`) if they name no model, no dataset and no experiment."""
    if any(key in _GROUPS or key.startswith(_SOURCES) for key in override_keys(overrides)):
        return overrides
    return [*overrides, embedded]


def fit_embedded_default(cfg: DictConfig, world_size: int, overrides: list[str], embedded: str) -> str | None:
    """The embedded default (`embedded`, the objective's, if among Hydra's `overrides`) on any world
    size: its experiment's
    tp (2) where it divides the ranks, else 1; its global batch (32) where dp divides it, else the
    largest multiple of dp below it; the largest micro batch up to the experiment's (16) that divides
    each dp rank's share. Only what the command line does not set itself, in `cfg` (so config.yaml
    holds what runs). Returns what changed, for the run's first line, or None."""
    if embedded not in overrides:
        return None
    given = set(override_keys(overrides))
    parallel, train = cfg.parallel, cfg.train
    shard = 1 if parallel.dp_shard == -1 else parallel.dp_shard
    others = parallel.cp * parallel.dp_replicate * shard
    if world_size % others:  # check_config refuses it, naming the keys
        return None
    changed: dict[str, int] = {}
    if "parallel.tp" not in given and (world_size // others) % parallel.tp:
        changed["parallel.tp"] = 1
    tp = changed.get("parallel.tp", parallel.tp)
    if world_size % (others * tp):
        return None
    dp = world_size // (tp * parallel.cp)
    batch = train.global_batch_size
    if "train.global_batch_size" not in given and batch % dp:
        batch = changed["train.global_batch_size"] = max(dp, batch // dp * dp)
    if "train.micro_batch_size" not in given and batch % dp == 0:
        share = batch // dp
        micro = max(m for m in range(1, min(train.micro_batch_size, share) + 1) if share % m == 0)
        if micro != train.micro_batch_size:
            changed["train.micro_batch_size"] = micro
    for key, value in changed.items():
        OmegaConf.update(cfg, key, value)
    if not changed:
        return None
    settings = ", ".join(f"{key}={value}" for key, value in changed.items())
    return f"the embedded default fitted to {world_size} rank{'s' if world_size > 1 else ''}: {settings}"


@dataclass
class FolderBefore:
    """The run folder as this rank found it before its Hydra ran (check_run_folder), for undo_start."""

    folder: Path | None = None
    made: list[Path] = field(default_factory=list)  # the folders it needed that did not exist, it first
    names: set[str] | None = None  # what it held (None: it was not there)
    record: dict[str, bytes] = field(default_factory=dict)  # its .hydra/ files (Hydra rewrites them)


# Only rank 0 writes in the run folder before training: run_command runs the other ranks' Hydra in
# the working folder, so that no rank makes the run folder before rank 0 has looked (rank 0 would
# find it made and leave its own start's files: a refused 4-rank launch left config.yaml and dpo.log
# behind whenever another rank's Hydra came first).
_before = FolderBefore()
# The run folder on the ranks whose Hydra runs in the working folder (a single run's ranks > 0).
_run_folder_elsewhere: Path | None = None
# What a start writes in the run folder: Hydra's (rank 0's) .hydra/ and log file, then config.yaml.
_START_FILES = (".hydra", "config.yaml")


def check_run_folder(folder: Path | None) -> None:
    """The run folder can be written (else Hydra fails with a traceback per rank): a probe of
    PROBE_BYTES written where it is, or, not made yet, in the nearest folder above it (which also
    catches a full disk). Remembers how it was (undo_start)."""
    global _before
    _before = FolderBefore(folder)
    if folder is None:
        return
    if folder.is_dir():
        _before.names = {path.name for path in folder.iterdir()}
        hydra = folder / ".hydra"
        _before.record = {path.name: path.read_bytes() for path in hydra.glob("*") if path.is_file()}
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        _before.made.append(existing)
        existing = existing.parent
    probe = existing / f".dtrain-write-test-{rank_from_env()}"
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a folder")
        with probe.open("wb") as file:
            file.write(bytes(PROBE_BYTES))
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        free = ""
        if error.errno == errno.ENOSPC:
            free = f"; {shutil.disk_usage(existing).free / 2**20:,.1f} MiB free there"
        raise ConfigError(
            f"{folder}: the run folder cannot be written ({error.strerror or error}{free})"
        ) from None
    finally:
        probe.unlink(missing_ok=True)


def keep_other_ranks_out(folder: Path | None, sweeping: bool) -> list[str]:
    """Hydra's overrides for a rank > 0 of a single run whose folder is known: run in the working
    folder (Hydra makes its run folder on every rank: only rank 0's may), the run folder being
    `folder` all the same (run_folder)."""
    global _run_folder_elsewhere
    _run_folder_elsewhere = None if folder is None or sweeping else Path(os.path.abspath(folder))
    return [] if _run_folder_elsewhere is None else ["hydra.run.dir=."]


def run_folder(hydra_output_dir: str) -> Path:
    """This job's run folder, on every rank: Hydra's output folder (`hydra_output_dir`), or where
    rank 0's Hydra makes it on the ranks keep_other_ranks_out kept out."""
    return _run_folder_elsewhere or Path(hydra_output_dir)


def undo_start() -> None:
    """A command that trains nothing (refused before its first step, or finding nothing left to
    train) leaves the run folder as it found it: rank 0 puts back Hydra's record (`.hydra/`) where
    it was there, and removes what its start added (`.hydra/`, Hydra's log file, `config.yaml`) where
    nothing else is new (never metrics or checkpoints), then the folders it made, where empty. The
    other ranks wrote nothing there (keep_other_ranks_out)."""
    folder = _before.folder
    if rank_from_env() != 0 or folder is None or not folder.is_dir():
        return
    if _before.record:
        hydra = folder / ".hydra"
        for path in hydra.glob("*"):
            if path.name not in _before.record:
                path.unlink(missing_ok=True)
        for name, content in _before.record.items():
            (hydra / name).write_bytes(content)
    new = {path.name for path in folder.iterdir()} - (_before.names or set())
    if new <= set(_START_FILES) | {name for name in new if name.endswith(".log")}:
        if ".hydra" in new:
            shutil.rmtree(folder / ".hydra", ignore_errors=True)
        for name in new - {".hydra"}:
            (folder / name).unlink(missing_ok=True)
    for made in _before.made:
        try:
            made.rmdir()
        except OSError:  # not empty: something else is there now
            break


def register(schema: type[Config], default_precision: Callable[[], str]) -> None:
    """Store `schema` as dtrain_schema and register the resolvers (replacing an earlier entry point's)."""
    ConfigStore.instance().store(name="dtrain_schema", node=schema)
    OmegaConf.register_new_resolver("dtrain_run_name", pinned_run_name, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("dtrain_asset", lambda name: str(ASSETS / name), replace=True)
    OmegaConf.register_new_resolver("dtrain_default_precision", default_precision, replace=True)


def fail(message: str, code: int = EXIT_CONFIG_ERROR, prefix: str = "error: ") -> None:
    """One message per node (not one per rank), then the same exit code on every rank. The other
    ranks linger a moment: torchrun stops every worker once one exits, and local rank 0 must have
    printed by then."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"dtrain: {prefix}{message}", file=sys.stderr, flush=True)
        write_exit_status(code)
    else:
        time.sleep(FAIL_GRACE_S)
    sys.exit(code)


class JobFailed(Exception):
    """A sweep job that failed alike on every rank: Hydra records it and goes on (or see below)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class JobStatusCallback(Callback):
    """Hydra's verdict on each job, written by rank 0 to JOB_DIR/job_status.yaml (status,
    overrides, error). With train.sweep_on_failure=stop a failed job ends the sweep here, once
    its status is on disk."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: object) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:  # a single run (or dtrain.estimate) has no sweep to record
            return
        error = job_return._return_value if job_return.status == JobStatus.FAILED else None
        if rank_from_env() == 0:
            status = {
                "status": job_return.status.name,
                "job": config.hydra.job.get("num"),
                "overrides": list(job_return.overrides or []),
                "error": None if error is None else f"{type(error).__name__}: {error}",
            }
            out = Path(config.hydra.runtime.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "job_status.yaml").write_text(OmegaConf.to_yaml(status))
            if error is not None:
                logging.getLogger("dtrain").error(
                    f"job {status['job']} ({' '.join(status['overrides'])}) failed: {error}"
                )
        stop = OmegaConf.select(config, "train.sweep_on_failure", default="continue") == "stop"
        if error is not None and stop:
            fail(f"{error} (train.sweep_on_failure=stop: the sweep ends here)", getattr(error, "code", 1))
