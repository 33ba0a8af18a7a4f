"""`torchrun -m dtrain.sft [+experiment=NAME] [key=value ...]`: the Hydra entry point.

Every rank runs Hydra. The run folder is keyed on an id all ranks share, and only rank 0 writes
`.hydra/`, Hydra's log file and `config.yaml`. The config is checked before the process group
exists, so a bad value fails on every rank at once with one message and exit code 2.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dtrain.checkpoint import CheckpointError, checkpoint_dir, find_resume_path, other_run_in
from dtrain.config import Config, ConfigError, check_config, to_config, world_size_from_env
from dtrain.distributed import init_distributed, rank_from_env, shutdown
from dtrain.model import load_model_config
from dtrain.reliability import EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteError, Preempted, RankFailure

ASSETS = Path(__file__).parent / "assets"
EXIT_CONFIG_ERROR = 2


def run_id() -> str:
    """An id every rank computes alike without talking to the others."""
    if os.environ.get("DTRAIN_RUN_ID"):
        return os.environ["DTRAIN_RUN_ID"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic == "none":  # torchrun --rdzv-endpoint without --rdzv-id
        raise ConfigError(
            "the ranks share no run id: pass --rdzv-id to torchrun, set DTRAIN_RUN_ID, or set hydra.run.dir"
        )
    if elastic:
        return f"torchrun-{elastic}"
    return time.strftime("%Y%m%d-%H%M%S")


ConfigStore.instance().store(name="dtrain_schema", node=Config)
OmegaConf.register_new_resolver("dtrain_run_id", run_id, use_cache=True)
OmegaConf.register_new_resolver("dtrain_asset", lambda name: str(ASSETS / name))
# bf16 where it is fast (CUDA); fp32 on CPU, where bf16 is slow and the tests need exact numerics.
OmegaConf.register_new_resolver(
    "dtrain_default_precision", lambda: "bf16" if torch.cuda.is_available() else "fp32"
)


def fail(message: str, code: int = EXIT_CONFIG_ERROR) -> None:
    """One message per node (not one per rank), then the same exit code on every rank."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"dtrain: {'error: ' if code != EXIT_PREEMPTED else ''}{message}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    is_rank0 = rank_from_env() == 0
    try:
        config = to_config(cfg)
        model_config = load_model_config(config.model)
        shape = check_config(config, world_size_from_env(), model_config)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        checkpoints = checkpoint_dir(config.checkpoint, run_dir)
        conflict = other_run_in(run_dir, checkpoints, resolved)
        if conflict and not config.checkpoint.overwrite:
            raise ConfigError(
                f"{conflict}: refusing to mix the two runs (checkpoint.overwrite=true to replace it)"
            )
        resume_from = None if conflict else find_resume_path(config.checkpoint, checkpoints)
    except ConfigError as error:
        fail(str(error))

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
        fail(str(error))
    except Preempted as preempted:
        fail(str(preempted), EXIT_PREEMPTED)
    except NonFiniteError as error:
        fail(str(error), EXIT_NONFINITE)


def main() -> None:
    if rank_from_env() != 0:  # quiet unless something is wrong; rank 0 speaks for all
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
        logging.getLogger("dtrain").setLevel(logging.ERROR)
    try:
        hydra_main()
    finally:
        shutdown()


if __name__ == "__main__":
    main()
