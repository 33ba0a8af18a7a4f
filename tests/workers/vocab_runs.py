"""Launched by tests/test_vocab.py by run_worker (4 processes): tiny Llamas whose vocabulary tp=2
does not divide, trained on a 2x2 mesh (untied with the plain loss, tied with the chunked loss),
resumed from the padded checkpoint on 4x1, exported at the end of training and from a checkpoint.
Rank 0 saves `<out>/<name>.pt` with the history, the trained parameters and the trained model's
logits."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from dtrain.checks import check_config
from dtrain.distributed import init_distributed
from dtrain.export import export_checkpoint
from dtrain.model import canonical_name, load_model_config
from dtrain.trainer import train
from tests.helpers import full, full_logits, parity_config, save_results, worker_args

STEPS, CHECKPOINT = 5, 3  # (the suite's time budget) a checkpoint halfway, resumed on another mesh


def run(
    name: str,
    out: Path,
    model_dir: Path,
    dp: int,
    tp: int,
    device,
    resume_from=None,
    export=False,
    **overrides,
):
    config = parity_config(model_dir, dp, tp)
    config.train.max_steps = STEPS
    config.checkpoint.dir = str(out / name / "checkpoints")
    config.checkpoint.export_hf, config.checkpoint.export_dtype = export, "fp32"
    for key, value in overrides.items():
        group, field = key.split("__")
        setattr(getattr(config, group), field, value)
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    result = train(config, shape, model_config, device, out / name, resolved, resume_from)
    params = {canonical_name(n): full(p) for n, p in result.model.named_parameters()}
    tied = result.model.lm_head.weight is result.model.model.embed_tokens.weight
    return {"history": result.history, "params": params, "logits": full_logits(result.model), "tied": tied}


def main() -> None:
    args = worker_args()
    out = args.out
    device = init_distributed(timeout_s=300)
    results = {
        "pad": run(
            "pad",
            out,
            args.untied,
            2,
            2,
            device,
            export=True,
            checkpoint__every=CHECKPOINT,
            checkpoint__save_final=True,
        ),
        # tied and the chunked loss in one run (the suite's time budget); 16 local positions, 2 chunks
        "pad_tied_chunk": run(
            "pad_tied_chunk",
            out,
            args.tied,
            2,
            2,
            device,
            export=True,
            parallel__loss_impl="chunked",
            parallel__loss_chunk=8,
        ),
    }
    # The padded (2x2) checkpoint resumed on tp=1, which keeps its padded rows.
    checkpoints = out / "pad" / "checkpoints"
    results["resume_4x1"] = run(
        "resume_4x1", out, args.untied, 4, 1, device, checkpoints / f"step-{CHECKPOINT:08d}"
    )
    # The final padded checkpoint exported over 4 ranks of plain FSDP (1026 rows do not split in 4).
    export_checkpoint(checkpoints / f"step-{STEPS:08d}", out / "hf_checkpoint", "fp32")
    save_results(results, out)


if __name__ == "__main__":
    main()
