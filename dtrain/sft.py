"""`torchrun -m dtrain.sft [+experiment=NAME] [key=value ...]`: the Hydra entry point.

Every rank runs Hydra. The run folder is keyed on an id all ranks share, and only rank 0 writes
`.hydra/`, Hydra's log file and `config.yaml`. The config is checked before the process group
exists, so a bad value fails on every rank at once with one message and exit code 2.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from submitit.helpers import TorchDistributedEnvironment

from dtrain.checkpoint import CheckpointError, checkpoint_dir, find_resume_path, other_run_in
from dtrain.checks import check_config
from dtrain.config import Config, ConfigError, to_config
from dtrain.distributed import init_distributed, rank_from_env, shutdown, world_size_from_env
from dtrain.hydra_glue import (
    CONF,
    EXIT_CONFIG_ERROR,
    JobFailed,
    fail,
    register,
    run_id,
    with_embedded_defaults,
)
from dtrain.model import load_model_config, resolve_init
from dtrain.reliability import EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteError, Preempted, RankFailure

log = logging.getLogger("dtrain")

# bf16 where it is fast (CUDA); fp32 on CPU, where bf16 is slow and the tests need exact numerics.
register(Config, lambda: "bf16" if torch.cuda.is_available() else "fp32")


@hydra.main(version_base=None, config_path=str(CONF), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    under_submitit = bool(os.environ.get("SUBMITIT_EXECUTOR"))  # hydra/launcher=submitit_*: no torchrun
    if under_submitit:  # a task per device: the rank environment comes from submitit
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    is_rank0 = rank_from_env() == 0
    if not is_rank0:
        quiet_this_rank()
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    end = functools.partial(end_job, sweeping)
    try:
        config = to_config(cfg)
        model_config = load_model_config(config.model)
        shape = check_config(config, world_size_from_env(), model_config)
        config.model.init = resolve_init(config.model)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        resolved["model"]["init"] = config.model.init  # config.yaml shows what ran (auto resolved)
        resolved["parallel"]["loss_impl"] = config.parallel.loss_impl  # likewise (check_config)
        checkpoints = checkpoint_dir(config.checkpoint, run_dir)
        conflict = other_run_in(run_dir, checkpoints, resolved)
        if conflict and not config.checkpoint.overwrite:
            raise ConfigError(
                f"{conflict}: refusing to mix the two runs (checkpoint.overwrite=true to replace it)"
            )
        resume_from = None if conflict else find_resume_path(config.checkpoint, checkpoints)
    except ConfigError as error:
        end(str(error))

    from dtrain.trainer import train  # after validation: a bad config should not wait on imports

    device = init_distributed(config.parallel.timeout_s)
    if is_rank0:
        if conflict:  # overwrite=true: the other run's metrics and checkpoints go
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            shutil.rmtree(checkpoints, ignore_errors=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    try:
        train(config, shape, model_config, device, run_dir, resolved, resume_from)
    except (ConfigError, CheckpointError, RankFailure) as error:  # raised alike on every rank
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


def main() -> None:
    try:
        # Pin the run id now, in the process that launches: submitit jobs of a sweep then share it
        # (and the sweep folder) instead of each naming the sweep after its own SLURM job.
        os.environ.setdefault("DTRAIN_RUN_ID", run_id())
    except ConfigError as error:
        fail(str(error))
    sys.argv[1:] = with_embedded_defaults(sys.argv[1:])
    if rank_from_env() != 0:  # no .hydra/ or Hydra log file; hydra_main quiets the rest (quiet_this_rank)
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    try:
        hydra_main()
    finally:
        shutdown()


if __name__ == "__main__":
    main()
