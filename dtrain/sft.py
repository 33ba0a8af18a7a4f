"""`torchrun -m dtrain.sft [+experiment=NAME] [key=value ...]`: the Hydra entry point.

Every rank runs Hydra. The run folder is keyed on an id all ranks share, and only rank 0 writes
`.hydra/`, Hydra's log file and `config.yaml`. The config is checked before the process group
exists, so a bad value fails on every rank at once with one message and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dtrain.checkpoint import CheckpointError, checkpoint_dir, find_resume_path
from dtrain.cli import fail, register
from dtrain.config import Config, ConfigError, check_config, to_config, world_size_from_env
from dtrain.distributed import init_distributed, rank_from_env, shutdown
from dtrain.model import load_model_config

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
        resume_from = find_resume_path(config.checkpoint, checkpoint_dir(config.checkpoint, run_dir))
    except ConfigError as error:
        fail(str(error))

    from dtrain.trainer import train  # after validation: a bad config should not wait on imports

    device = init_distributed(config.parallel.timeout_s)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if is_rank0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    try:
        train(config, shape, model_config, device, run_dir, resolved, resume_from)
    except (ConfigError, CheckpointError) as error:  # raised alike on every rank
        fail(str(error))


def main() -> None:
    if rank_from_env() != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    try:
        hydra_main()
    finally:
        shutdown()


if __name__ == "__main__":
    main()
