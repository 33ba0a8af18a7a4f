"""What every entry point runs (`torchrun -m dtrain.sft`, `dtrain.dpo` ...): an objective
(dtrain/objectives/: its schema, its Hydra config, its embedded default, its loss) from the command line
through Hydra to the trainer.

Every rank runs Hydra. The run folder is named after the command (dtrain.hydra_glue.run_name), so
every rank finds the same one and rerunning the command finds it again and resumes it; only rank 0
writes `.hydra/`, Hydra's log file and `config.yaml`. The config is checked before the process group
exists, so a bad value fails on every rank at once with one message and exit code 2 (and leaves no
folder behind). Then one run holds the folder (dtrain.run_lock) and resumes from the newest
checkpoint that can be read (dtrain.checkpoint.resume).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from submitit.helpers import TorchDistributedEnvironment

from dtrain.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    find_resume_path,
    other_run_in,
    remove_checkpoints,
    resume,
    saved_step,
)
from dtrain.checks import check_config
from dtrain.config import ConfigError, TrainConfig, to_config
from dtrain.distributed import init_distributed, rank_from_env, shutdown, world_size_from_env
from dtrain.hydra_glue import (
    EXIT_CONFIG_ERROR,
    JobFailed,
    check_run_folder,
    fail,
    fit_embedded_default,
    keep_other_ranks_out,
    output_folder,
    pin_run_name,
    register,
    run_folder,
    undo_start,
    with_embedded_defaults,
)
from dtrain.model import load_model_config, resolve_init
from dtrain.objectives import ObjectiveSpec
from dtrain.reliability import (
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    NonFiniteError,
    Preempted,
    RankFailure,
    die_with_launcher,
    scheduler_signals_held,
    write_exit_status,
)
from dtrain.run_lock import LockHeld, check_free, holding
from dtrain.sinks import WANDB_ID

log = logging.getLogger("dtrain")


def default_precision() -> str:
    """bf16 where it is fast (CUDA); fp32 on CPU, where bf16 is slow and the tests need exact numerics."""
    return "bf16" if torch.cuda.is_available() else "fp32"


def run_job(cfg: DictConfig, objective: ObjectiveSpec) -> None:
    """One job (a run, or one of a sweep) of `objective` on every rank (cfg: composed on its schema)."""
    under_submitit = bool(os.environ.get("SUBMITIT_EXECUTOR"))  # hydra/launcher=submitit_*: no torchrun
    if under_submitit:  # a task per device: the rank environment comes from submitit
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    is_rank0 = rank_from_env() == 0
    if not is_rank0:
        quiet_this_rank()
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    end = functools.partial(end_job, sweeping)
    try:
        overrides = list(HydraConfig.get().overrides.task)
        fitted = fit_embedded_default(cfg, world_size_from_env(), overrides, objective.embedded)
        config = to_config(cfg)
        check_model_folder(config.model.name_or_path)
        model_config = load_model_config(config.model)
        shape = check_config(config, world_size_from_env(), model_config)
        config.model.init = resolve_init(config.model)
        run_dir = run_folder(HydraConfig.get().runtime.output_dir)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        resolved["model"]["init"] = config.model.init  # config.yaml shows what ran (auto resolved)
        resolved["parallel"]["loss_impl"] = config.parallel.loss_impl  # likewise (check_config)
        objective.record_resolved(config, resolved)  # likewise (e.g. dpo.reference=auto)
        checkpoints = checkpoint_dir(config.checkpoint, run_dir)
        start_over = config.checkpoint.resume == "never"
        conflict = None if start_over else other_run_in(run_dir, checkpoints, resolved)
        if conflict:
            raise ConfigError(
                f"{conflict}: refusing to mix the two runs (checkpoint.resume=never starts over there, "
                "removing its checkpoints and metrics; or hydra.run.dir=ANOTHER_FOLDER)"
            )
        resume_from = find_resume_path(config.checkpoint, checkpoints)
    except ConfigError as error:
        if not sweeping:
            undo_start()
        end(str(error))
    finished = nothing_to_train(run_dir, resume_from, config.train)
    if finished:
        log.info(finished)
        if not sweeping:
            undo_start()
        return
    if config.train.epochs is None and config.optim.warmup_steps > config.train.max_steps:
        log.warning(
            f"optim.warmup_steps={config.optim.warmup_steps} is longer than the run "
            f"(train.max_steps={config.train.max_steps}): the learning rate never reaches optim.lr"
        )

    from dtrain.trainer import train  # after validation: a bad config should not wait on imports

    device = init_distributed(config.parallel.timeout_s)
    try:
        with holding(run_dir):  # one run per folder: a second one is refused here, on every rank
            if is_rank0:
                if start_over:  # checkpoint.resume=never: the folder's earlier run goes
                    for stale in (run_dir / "metrics.jsonl", run_dir / WANDB_ID):
                        stale.unlink(missing_ok=True)
                    remove_checkpoints(checkpoints)
                (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
            resume(
                config.checkpoint,
                checkpoints,
                resume_from,
                lambda path: log.info(first_line(run_dir, path, start_over, fitted)),
                lambda path: train(config, shape, model_config, device, run_dir, resolved, path),
            )
    except (ConfigError, CheckpointError, RankFailure) as error:  # raised alike on every rank
        if not sweeping:
            undo_start()
        end(str(error))
    except Preempted as preempted:
        fail(str(preempted), EXIT_PREEMPTED, prefix="")  # the whole sweep stops: the machine goes
    except NonFiniteError as error:
        end(str(error), EXIT_NONFINITE)
    except Exception:
        if not sweeping:
            raise
        # Raised on this rank alone: the others may wait in a collective. End the process, so
        # torchrun stops them all, rather than let Hydra start the next job on this rank only.
        log.exception("dtrain: this rank failed")
        fail(f"rank {rank_from_env()} failed (traceback above); the sweep stops", 1)
    finally:
        if under_submitit:
            shutdown()  # each submitit job is its own processes and process group


def first_line(run_dir: Path, resume_from: Path | None, start_over: bool, fitted: str | None = None) -> str:
    """What the run does with its folder: `resuming outputs/NAME at step 22`, or starting; and how
    the embedded default was fitted to the world size (fit_embedded_default), if it was."""
    notes = [fitted] if fitted else []
    if resume_from is None:
        if start_over:
            notes.insert(0, "checkpoint.resume=never: its earlier checkpoints and metrics are removed")
        line = f"starting {shown(run_dir)}"
    else:
        source = "" if resume_from.parent == run_dir / "checkpoints" else f" from {resume_from}"
        line = f"resuming {shown(run_dir)}{source} at step {saved_step(resume_from)}"
    return f"{line} ({'; '.join(notes)})" if notes else line


def nothing_to_train(run_dir: Path, resume_from: Path | None, settings: TrainConfig) -> str | None:
    """Why the run would train no step, in one line (its checkpoint is at train.max_steps or past
    it: a finished run rerun, or with a smaller train.max_steps), or None. Nothing is written then:
    config.yaml keeps describing what the folder holds. (With train.epochs the step count is known
    only once the data are: such a run starts and trains no step.)"""
    if resume_from is None or settings.epochs is not None:
        return None
    try:
        step = saved_step(resume_from)
    except (OSError, ValueError, KeyError):  # unreadable: resume sets it aside and tries the one before
        return None
    if step < settings.max_steps:
        return None
    where = shown(run_dir) if resume_from.parent == run_dir / "checkpoints" else f"checkpoint {resume_from}"
    done = "finished" if step == settings.max_steps else f"past train.max_steps={settings.max_steps}"
    return (
        f"{where} is at step {step}, {done}: nothing to train, and the folder is left as it was "
        "(a larger train.max_steps continues the run; checkpoint.resume=never starts it over)"
    )


def shown(path: Path) -> str:
    """A path as the user named it: relative to the working folder where it is inside it."""
    return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)


def check_model_folder(name_or_path: str | None) -> None:
    """A local folder must be a Hugging Face model folder (else transformers fails, once per rank,
    about `model_type`)."""
    if name_or_path and os.path.isdir(name_or_path) and not os.path.isfile(f"{name_or_path}/config.json"):
        raise ConfigError(
            f"model.name_or_path={name_or_path!r}: no config.json in that folder (a Hugging Face model "
            "folder holds config.json, the tokenizer files and the safetensors weights)"
        )


def end_job(sweeping: bool, message: str, code: int = EXIT_CONFIG_ERROR) -> None:
    """Every rank failed this job alike. A single run ends the process; in a sweep Hydra records
    the job as failed and goes on with the next one (train.sweep_on_failure; see JobStatusCallback)."""
    if sweeping:
        raise JobFailed(message, code)
    fail(message, code)


def quiet_this_rank() -> None:
    """Rank 0 speaks for all: the others log errors only, and not into rank 0's log file (the
    torchrun ranks already ran Hydra without one, see main; submitit tasks did not)."""
    logging.getLogger("dtrain").setLevel(logging.ERROR)
    for handler in list(logging.root.handlers):
        if isinstance(handler, logging.FileHandler):
            logging.root.removeHandler(handler)


def main(entry: Callable[[], None], objective: ObjectiveSpec) -> None:
    """The command line's run (or sweep) of `objective`: `entry`, its entry point's Hydra main, with its
    embedded default added when the command line names no model, no data and no experiment, composed
    on its schema."""
    # Registered here: ConfigStore is one per process, and importing another entry point
    # (dtrain.dpo, dtrain.estimate) replaces the schema this command composes.
    register(objective.schema, default_precision)
    die_with_launcher()  # under torchrun: never outlive it
    with scheduler_signals_held():  # a SIGTERM while starting: save after the first step, exit 75
        run_command(entry, objective)


def run_command(entry: Callable[[], None], objective: ObjectiveSpec) -> None:
    sys.argv[1:] = with_embedded_defaults(sys.argv[1:], objective.embedded)
    sweeping = "--multirun" in sys.argv or "-m" in sys.argv
    try:
        # The run (or sweep) folder's name, from the entry point and the command line: every rank and
        # node computes the same one; pinned now so that submitit's jobs, which run elsewhere, share it.
        pin_run_name(objective.name, sys.argv[1:])
        folder = output_folder(sys.argv[1:])
        check_run_folder(folder)
        if folder is not None:  # a run holding it refuses this one now, before Hydra writes there
            check_free(folder)
    except (ConfigError, LockHeld) as error:
        fail(str(error))
    if rank_from_env() != 0:  # no .hydra/ or Hydra log file; hydra_main quiets the rest (quiet_this_rank)
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
        sys.argv += keep_other_ranks_out(folder, sweeping)  # only rank 0's Hydra makes the run folder
    try:
        entry()
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # done: a launcher that passed on a signal reads it
            write_exit_status(0)
    except KeyboardInterrupt:  # a Ctrl-C before training started (the loop handles its own): no traceback
        fail("interrupted", EXIT_INTERRUPTED, prefix="")
    finally:
        shutdown()
