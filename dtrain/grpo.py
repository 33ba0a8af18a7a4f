"""`torchrun -m dtrain.grpo [+experiment=NAME] [key=value ...]`: online RL with verifiable rewards (the GRPO
family), the Hydra entry point of dtrain.objectives.grpo (its schema `GRPORunConfig`: the training
groups plus `grpo` and `rollout`; its config conf/config_grpo.yaml, with the embedded prompts; the run
itself: dtrain/runner.py). docs/grpo.md."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dtrain import collector

with collector.importing():  # the imports of torch, transformers and datasets (dtrain/collector.py)
    from dtrain import runner
    from dtrain.hydra_glue import CONF
    from dtrain.objectives.grpo import SPEC


@hydra.main(version_base=None, config_path=str(CONF), config_name=SPEC.config_name)
def hydra_main(cfg: DictConfig) -> None:
    runner.run_job(cfg, SPEC)


def main() -> None:
    runner.main(hydra_main, SPEC)


if __name__ == "__main__":
    main()
