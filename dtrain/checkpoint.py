"""Checkpoints with torch.distributed.checkpoint (DCP): the whole training state, saved by every rank
in parallel under mesh-independent names, so a run resumes exactly on the same mesh or any other.

A checkpoint folder is `step-XXXXXXXX/`. It is written as `.step-XXXXXXXX.partial/`, marked
complete (`complete.json`) and renamed only after every rank finished writing: a crash mid-save
leaves at most a partial folder, never a "latest" that cannot load, and the older ones untouched.
A complete checkpoint that cannot be read later (a file truncated or overwritten on disk) is set
aside as `unreadable-step-XXXXXXXX/` when a run resumes, and the run resumes from the newest one
that loads (`resume`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from dtrain.config import RUN_IDENTITY, CheckpointConfig, Config, ConfigError
from dtrain.faults import Faults
from dtrain.reliability import agreed_error

log = logging.getLogger("dtrain")
T = TypeVar("T")

COMPLETE = "complete.json"
UNREADABLE = "unreadable-"  # the prefix of a checkpoint set aside because it cannot be read
# Frozen parameters (a LoRA run's base) are not saved, so loading skips them too (strict=False:
# check_compatible has already matched every saved tensor to the model).
TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A save that did not complete (the previous checkpoints are untouched), or no checkpoint to
    resume from can be read."""


class UnreadableCheckpoint(RuntimeError):
    """A complete checkpoint whose files cannot be read, raised on every rank alike."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass
class Progress:
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # supervised tokens trained on


def checkpoint_dir(settings: CheckpointConfig, run_dir: Path) -> Path:
    return Path(settings.dir) if settings.dir else run_dir / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def find_resume_path(settings: CheckpointConfig, directory: Path) -> Path | None:
    """The checkpoint to resume from; only reads the filesystem, so it runs before the process group."""
    if settings.resume == "never":
        return None
    if settings.resume == "none":  # the old spelling: one way to say it
        raise ConfigError("checkpoint.resume=none: starting over is checkpoint.resume=never")
    if settings.resume != "auto":
        path = Path(settings.resume)
        if not path.is_dir():
            raise ConfigError(f"checkpoint.resume={settings.resume!r}: no such checkpoint folder")
        if not is_complete(path):
            raise ConfigError(
                f"checkpoint.resume={settings.resume!r}: incomplete checkpoint (no {COMPLETE}); "
                "its save did not finish"
            )
        return path
    if not directory.is_dir():
        return None
    for partial in sorted(directory.glob(f".{PREFIX}*.partial")):
        log.warning(f"skipping incomplete checkpoint {partial} (its save did not finish)")
    for path in sorted(directory.glob(f"{PREFIX}*")):
        if path.is_dir() and not is_complete(path):
            log.warning(f"skipping incomplete checkpoint {path} (no {COMPLETE})")
    newest = newest_complete(directory)
    set_aside = sorted(path.name for path in directory.glob(f"{UNREADABLE}{PREFIX}*"))
    if newest is None and set_aside:  # not a silent start from scratch in a run that has trained
        raise ConfigError(
            f"{directory}: no checkpoint to resume from, only unreadable ones set aside "
            f"({', '.join(set_aside)}); checkpoint.resume=never starts over"
        )
    return newest


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in directory, oldest first."""
    return sorted(p for p in directory.glob(f"{PREFIX}*") if is_complete(p))


def newest_complete(directory: Path) -> Path | None:
    complete = complete_checkpoints(directory)
    return complete[-1] if complete else None


def saved_step(path: Path) -> int:
    """The step a complete checkpoint was saved after."""
    return json.loads((path / COMPLETE).read_text())["step"]


def remove_checkpoints(directory: Path) -> None:
    """Every checkpoint in directory, complete, partial or set aside as unreadable
    (checkpoint.resume=never starts over)."""
    patterns = (f"{PREFIX}*", f".{PREFIX}*.partial", f"{UNREADABLE}{PREFIX}*")
    for path in [path for pattern in patterns for path in directory.glob(pattern)]:
        shutil.rmtree(path, ignore_errors=True)


def unreadable(path: Path) -> str | None:
    """Why a complete checkpoint's marker or DCP metadata cannot be read, or None. Reading its
    tensors is load's (dcp.load checks every byte it reads)."""
    try:
        saved_step(path)
        dcp.FileSystemReader(str(path)).read_metadata()
    except (OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def resume(
    settings: CheckpointConfig,
    directory: Path,
    chosen: Path | None,
    announce: Callable[[Path | None], None],
    attempt: Callable[[Path | None], T],
) -> T:
    """`attempt(checkpoint)` (a run resuming from it) from `chosen` (rank 0's find_resume_path, which
    every rank uses), `announce`d once. A checkpoint that cannot be read on any rank (all ranks check
    together) is set aside by rank 0 as `unreadable-step-XXXXXXXX` (renamed, never deleted), said in
    one line, and the newest complete checkpoint left is tried next; an explicit checkpoint.resume
    path, or none left, is a CheckpointError."""
    path = _rank0s((chosen,))[0]
    announced = False
    while True:
        reason = agreed_error(unreadable(path)) if path is not None else None
        if reason is None:
            if not announced:
                announce(path)
                announced = True
            try:
                return attempt(path)
            except UnreadableCheckpoint as error:
                reason = error.reason
        assert path is not None
        if settings.resume != "auto":
            raise CheckpointError(f"checkpoint.resume={settings.resume!r} cannot be read ({reason})")
        aside, path = _rank0s(_set_aside(path, directory) if dist.get_rank() == 0 else (None, None))
        if path is None:
            raise CheckpointError(
                f"no checkpoint in {directory} can be read: the last one tried failed ({reason}) and is "
                f"set aside as {aside}; checkpoint.resume=never starts over"
            )
        log.warning(f"checkpoint {aside} cannot be read ({reason}): set aside; resuming from {path} instead")


def _set_aside(path: Path, directory: Path) -> tuple[Path, Path | None]:
    """Rename an unreadable checkpoint out of the way (`unreadable-` before its name; a number after
    it if the same step failed before); the newest complete checkpoint left."""
    aside = path.with_name(f"{UNREADABLE}{path.name}")
    number = 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{UNREADABLE}{path.name}-{number}")
    os.rename(path, aside)
    return aside, newest_complete(directory)


def _rank0s(values: tuple) -> tuple:
    """Rank 0's values on every rank (the ranks list the same folder, but a shared filesystem may
    show a rename late)."""
    shared = list(values)
    dist.broadcast_object_list(shared, src=0)
    return tuple(shared)


def saved_config(path: Path) -> dict[str, Any]:
    """The resolved config a complete checkpoint was saved with."""
    return json.loads((path / COMPLETE).read_text())["config"]


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    picked = {}
    for key in RUN_IDENTITY:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        picked[key] = value
    return picked


def other_run_in(run_dir: Path, directory: Path, resolved: dict[str, Any]) -> str | None:
    """Describe the first sign that run_dir or the checkpoint folder belongs to a different run
    (whose metrics would be appended to, or whose checkpoints resume=auto would load), or None."""
    mine = _identity(resolved)
    shared = {group.name for group in fields(Config)}  # every entry point's groups
    previous = []
    if (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file():
        from omegaconf import OmegaConf

        previous.append(
            (run_dir / "config.yaml", OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
        )
    newest = newest_complete(directory) if directory.is_dir() else None
    if newest is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):  # unreadable: resume sets it aside
            previous.append((newest, saved_config(newest)))
    for source, config in previous:
        theirs = _identity(config)
        for key in RUN_IDENTITY:  # an objective's own group (dpo) in one alone: another entry point's run
            group = key.split(".")[0]
            if group not in shared and (theirs[key] is None) != (mine[key] is None):
                has = "has" if mine[key] is None else "has no"
                return f"{source} is from another entry point's run (it {has} the {group} group)"
        for key in RUN_IDENTITY:
            if theirs[key] != mine[key]:
                return f"{source} is from a run with a different {key}"
    return None


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: Any,
    progress: Progress,
    objective: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds. Model and optimizer states are DTensors keyed by parameter name;
    frozen parameters (a LoRA run's base) are left out: the model's files hold them. `objective`: the
    objective's own state, if it has one (Objective.state_dict: DPO's TR-DPO reference, GRPO's
    generation), as `saved_objective` writes it."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINABLE)
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "data": data.state_dict(),
        "progress": {"step": progress.step, "tokens_seen": progress.tokens_seen},
        "rng": {"cpu": torch.get_rng_state()},
    }
    return state | ({"objective": saved_objective(objective)} if objective else {})


def holds_tensors(value: Any) -> bool:
    if isinstance(value, dict):
        return any(holds_tensors(v) for v in value.values())
    return isinstance(value, torch.Tensor)


def saved_objective(state: dict[str, Any]) -> dict[str, Any]:
    """An objective's state as DCP writes it: tensors (DTensors resharded on load, as the model's)
    as they are, any other value pickled whole (DCP would flatten a Python dict's entries into keys
    that a load must know in advance; such values are the same on every rank, rank 0's written)."""
    return {key: value if holds_tensors(value) else pickle.dumps(value) for key, value in state.items()}


def load_objective(path: Path, objective: Any) -> None:
    """The objective's own state (Objective.state_dict, tensors filled in place), if it has one:
    read after `load`, once the objective is built on the restored run."""
    fresh = objective.state_dict()
    if not fresh:
        return
    state = saved_objective(fresh)
    error = None
    try:
        dcp.load({"objective": state}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as caught:
        cause = root_cause(caught)
        error = f"{type(cause).__name__}: {str(cause).split('. ')[0]}"
    error = agreed_error(error)
    if error:
        raise UnreadableCheckpoint(path, error)
    objective.load_state_dict(
        {key: value if holds_tensors(fresh[key]) else pickle.loads(value) for key, value in state.items()}
    )


def check_compatible(path: Path, model_state: dict[str, Any]) -> None:
    """A checkpoint of another architecture fails with the first mismatched tensor, not deep in DCP."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model_state.items():
        key = f"model.{name}"
        if key not in saved:
            raise ConfigError(f"checkpoint {path} has no tensor {name!r}: it is from another model")
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != tuple(tensor.shape):
            raise ConfigError(
                f"checkpoint {path}: tensor {name!r} has shape {saved_shape} there and "
                f"{tuple(tensor.shape)} in this model: it is from another architecture"
            )


def load(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, data: Any
) -> Progress:
    """Restore everything in place, resharding to this run's mesh."""
    state = training_state(model, optimizer, scheduler, data, Progress())
    check_compatible(path, state["model"])
    error = None
    try:  # DCP raises the first failing rank's error on every rank; agreed again to be sure
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as caught:
        cause = root_cause(caught)
        error = f"{type(cause).__name__}: {str(cause).split('. ')[0]}"  # torch's advice is long
    error = agreed_error(error)
    if error:
        raise UnreadableCheckpoint(path, error)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=TRAINABLE,
    )
    scheduler.load_state_dict(state["scheduler"])
    data.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["cpu"])
    progress = Progress(**state["progress"])
    log.info(f"resumed from {path} at step {progress.step}")
    return progress


@dataclass
class _Save:
    """A save whose files are being written (in the background with async_save)."""

    progress: Progress
    partial: Path
    final: Path
    started: float
    future: Any = None  # dcp.async_save's Future, or None once written
    size: int = 0  # the checkpoint's bytes (every rank's shards), for the message of a failed save


class Checkpointer:
    """Saves every `every` steps and at the end, keeps the newest `keep`. With async_save the
    state is staged to CPU memory and written while the next steps run; at most one save is in
    flight, and it is finished (marked complete and renamed) by the next save or by `wait()`."""

    def __init__(
        self,
        settings: CheckpointConfig,
        directory: Path,
        resolved_config: dict[str, Any],
        faults: Faults | None = None,
    ) -> None:
        self.settings = settings
        self.faults = faults
        self.directory = directory
        self.resolved_config = resolved_config
        self.is_rank0 = dist.get_rank() == 0
        self.in_flight: _Save | None = None
        self.clock = faults.clock if faults else time.monotonic  # the tests' clock, or the wall clock
        self.last_save = self.clock()  # every_minutes counts from the start and from each save
        # The background writer's collectives must not share a group with training's.
        self.async_group = dist.new_group(backend="gloo") if settings.async_save else None

    def due(self, step: int, max_steps: int) -> bool:
        """Whether `step` is saved by step count: every `every` steps, and the last one."""
        every = self.settings.every
        return (every > 0 and step % every == 0) or (step == max_steps and self.settings.save_final)

    def due_by_time(self) -> bool:
        """Whether every_minutes passed since the last save (asked on rank 0 only: StepGuard agrees)."""
        minutes = self.settings.every_minutes
        return minutes > 0 and self.clock() - self.last_save >= 60 * minutes

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        data: Any,
        progress: Progress,
        objective: dict[str, Any] | None = None,
    ) -> None:
        self.wait()
        self.last_save = self.clock()
        name = f"{PREFIX}{progress.step:08d}"
        partial = self.directory / f".{name}.partial"
        save = _Save(progress, partial, self.directory / name, time.perf_counter())
        if self.is_rank0:
            if save.partial.exists():  # left by an earlier crash at this step
                shutil.rmtree(save.partial)
            save.partial.mkdir(parents=True)
        dist.barrier()
        state = training_state(model, optimizer, scheduler, data, progress, objective)
        save.size = state_bytes(state)
        with self._failures(save):
            if self.async_group is None:
                dcp.save(state, checkpoint_id=str(save.partial))
            else:
                save.future = dcp.async_save(
                    state, checkpoint_id=str(save.partial), process_group=self.async_group
                )
        self.in_flight = save
        if save.future is None:
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight, if any: every rank's files on disk, then mark and rename."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return
        with self._failures(save):
            if save.future is not None:
                save.future.result()
            if self.faults:
                self.faults.after_save_written(save.progress.step, save.partial)
        dist.barrier()
        if self.is_rank0:
            progress = save.progress
            marker = {"step": progress.step, "tokens": progress.tokens_seen, "config": self.resolved_config}
            _write_synced(save.partial / COMPLETE, json.dumps(marker, indent=1))
            if save.final.exists():  # the same step saved again after a resume: replace it
                shutil.rmtree(save.final)
            os.replace(save.partial, save.final)
            self._prune()
            log.info(f"saved checkpoint {save.final} in {time.perf_counter() - save.started:.1f} s")
        dist.barrier()

    @contextlib.contextmanager
    def _failures(self, save: _Save) -> Iterator[None]:
        """DCP raises the first failing rank's error on every rank (as a CheckpointException, which
        derives from BaseException): clean up and say in one line what failed."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            if self.is_rank0:
                shutil.rmtree(save.partial, ignore_errors=True)
            cause = root_cause(error)
            size = f" ({save.size / 2**20:,.1f} MiB)" if save.size else ""
            disk = ""
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.directory).free
                disk = f"; {free / 2**20:,.1f} MiB free there"
            raise CheckpointError(
                f"saving the step-{save.progress.step} checkpoint{size} to {self.directory} failed: "
                f"{type(cause).__name__}: {cause}{disk}. The newest complete checkpoint is still "
                f"{newest_complete(self.directory) or 'none'}"
            ) from None

    def _prune(self) -> None:
        complete = complete_checkpoints(self.directory)
        for old in complete[: max(0, len(complete) - self.settings.keep)]:
            shutil.rmtree(old)


def root_cause(error: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (its lowest failing rank's), else error itself."""
    if isinstance(error, CheckpointException) and error.failures:
        cause, _ = error.failures[min(error.failures)]
        return root_cause(cause)
    return error


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) state dict; a DTensor counts whole (all its shards)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
