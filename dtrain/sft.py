"""`torchrun -m dtrain.sft [+experiment=NAME] [key=value ...]`: the Hydra entry point.

Every rank runs Hydra. The run folder is keyed on an id all ranks share, and only rank 0 writes
`.hydra/`, Hydra's log file and `config.yaml`. The config is checked before the process group
exists, so a bad value fails on every rank at once with one message and exit code 2.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dtrain.checkpoint import CheckpointError, checkpoint_dir, find_resume_path, other_run_in
from dtrain.cli import fail, register
from dtrain.config import Config, ConfigError, check_config, to_config, world_size_from_env
from dtrain.distributed import init_distributed, rank_from_env, shutdown
from dtrain.model import load_model_config
from dtrain.reliability import EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteError, Preempted, RankFailure

# bf16 where it is fast (CUDA); fp32 on CPU, where bf16 is slow and the tests need exact numerics.
register(Config, lambda: "bf16" if torch.cuda.is_available() else "fp32")


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
        fail(str(preempted), EXIT_PREEMPTED, prefix="")
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
