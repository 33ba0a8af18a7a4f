"""Launched by tests/test_checkpoint.py under torchrun (4 processes, then 1): an uninterrupted run
that checkpoints at step 4, resumes of that checkpoint on other meshes, exports, and a load of the
checkpoint into another architecture. Rank 0 saves `<out>/<name>.pt`."""

from __future__ import annotations

import torch.distributed as dist
from omegaconf import OmegaConf

from dtrain.checks import check_config
from dtrain.config import ConfigError
from dtrain.data.formats import load_tokenizer
from dtrain.distributed import init_distributed
from dtrain.export import export_hf
from dtrain.model import load_model_config
from dtrain.trainer import train
from tests.helpers import full_logits, parity_config, save_results, sharded_model, worker_args

STEPS = 8


def run(name, out, model_dir, dp, tp, device, resume_from=None, every=0, steps=STEPS, **model_overrides):
    config = parity_config(model_dir, dp, tp)
    config.train.max_steps = steps
    config.checkpoint.every = every
    config.checkpoint.dir = str(out / "checkpoints")
    config.model.config.update(model_overrides)
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    return train(config, shape, model_config, device, out / name, resolved, resume_from)


def main() -> None:
    args = worker_args()
    out = args.out
    device = init_distributed(timeout_s=300)
    step4 = out / "checkpoints" / "step-00000004"
    results = {}
    if dist.get_world_size() == 4:
        full = run("full", out, args.untied, 2, 2, device, every=4)
        results["full"] = {"history": full.history, "logits": full_logits(full.model)}
        export_hf(full.model, load_tokenizer(str(args.untied)), out / "hf_untied", "fp32")
        for name, (dp, tp) in {"resume_2x2": (2, 2), "resume_1x4": (1, 4), "resume_4x1": (4, 1)}.items():
            results[name] = {"history": run(name, out / name, args.untied, dp, tp, device, step4).history}
        tied = run("tied", out / "tied", args.tied, 2, 2, device, steps=3)
        results["tied"] = {"logits": full_logits(tied.model)}
        export_hf(tied.model, load_tokenizer(str(args.tied)), out / "hf_tied", "fp32")
        results["sharded_import"] = {
            "logits": full_logits(sharded_model(parity_config(out / "sharded", 2, 2), device))
        }
        try:
            run("other_arch", out / "other", None, 2, 2, device, step4, intermediate_size=96)
            results["other_arch"] = {"error": None}
        except ConfigError as error:
            results["other_arch"] = {"error": str(error)}
    else:
        results["resume_1x1"] = {
            "history": run("resume_1x1", out / "r1", args.untied, 1, 1, device, step4).history
        }
    save_results(results, out)


if __name__ == "__main__":
    main()
