"""`torchrun -m dtrain.distill [+experiment=NAME] [key=value ...]`: distillation from a frozen teacher, the
Hydra entry point of dtrain.objectives.distill (its schema `DistillationConfig`: the training groups plus
`distill` and `rollout`; its config conf/config_distill.yaml; the run itself: dtrain/runner.py).
docs/distill.md."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dtrain import collector

with collector.importing():  # the imports of torch, transformers and datasets (dtrain/collector.py)
    from dtrain import runner
    from dtrain.hydra_glue import CONF
    from dtrain.objectives.distill import SPEC


@hydra.main(version_base=None, config_path=str(CONF), config_name=SPEC.config_name)
def hydra_main(cfg: DictConfig) -> None:
    runner.run_job(cfg, SPEC)


def main() -> None:
    runner.main(hydra_main, SPEC)


if __name__ == "__main__":
    main()
