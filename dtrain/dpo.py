"""`torchrun -m dtrain.dpo [+experiment=NAME] [key=value ...]`: preference tuning (DPO), the Hydra
entry point.

dtrain.sft's machinery (dtrain/sft.py: the run folder named after the command, resume by rerunning
it, signals, exports, sweeps, W&B, the checks before any process group) with dtrain.dpo's schema,
`PreferenceConfig` (the training groups plus `dpo`), its config (conf/config_dpo.yaml: the embedded
preference data) and its embedded default (conf/experiment/embedded_dpo.yaml). The data are
preference pairs (data.format=preference) and the loop optimizes DPO's pair loss
(dtrain.objective.PairLoss; docs/dpo.md).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dtrain import sft
from dtrain.config import PreferenceConfig
from dtrain.hydra_glue import CONF, EMBEDDED_DPO, register

register(PreferenceConfig, sft.default_precision)


@hydra.main(version_base=None, config_path=str(CONF), config_name="config_dpo")
def hydra_main(cfg: DictConfig) -> None:
    sft.run_job(cfg, preference=True)


def main() -> None:
    sft.main(hydra_main, EMBEDDED_DPO, PreferenceConfig)


if __name__ == "__main__":
    main()
