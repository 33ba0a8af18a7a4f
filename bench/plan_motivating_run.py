"""The run that motivated dtrain, planned: Llama-3-8B on 4 ranks at tp=2 and tp=4, max_len 2048,
micro batch 4, full activation checkpointing, bf16; dtrain with the dense loss and with
parallel.loss_impl=fused (default loss_chunk; what loss_impl=auto picks for Llama); DeepSpeed's
layouts beside it (analytic: dtrain/estimate/deepspeed.py's buffers).
Prints a Markdown table (GB = 1e9 bytes, as in the design notes) for docs/estimate.md.

    python bench/plan_motivating_run.py [--gpu-memory-gib 80]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.estimate.app import compose  # noqa: E402
from dtrain.estimate.deepspeed import Layout  # noqa: E402
from dtrain.estimate.planner import Plan, plan  # noqa: E402
from dtrain.estimate.report import DtrainRow, comparisons, dtrain_row, verdict  # noqa: E402

WORLD = 4
GB = 1e9


def planned_peak(planned: Plan, gpu_memory_gib: float) -> str:
    v = verdict(planned.step.peak, gpu_memory_gib)
    phase = planned.step.peak_phase.split(" (")[0]  # "loss", "optimizer step", "backward of NAME"
    return (
        f"{planned.step.peak / GB:.1f} GB ({'fits' if v['fits'] else 'does not fit'} in "
        f"{gpu_memory_gib:g} GiB; in the {phase.replace('LlamaForCausalLM.model.', '')})"
    )


def row(name: str, layout: Layout | DtrainRow, logits: str, peak: str) -> str:
    return (
        f"| {name} | {layout.tp} × {layout.dp} | {layout.model_state / GB:.1f} GB "
        f"| {layout.embedding_and_head / GB:.1f} GB | {logits} | {peak} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    args = parser.parse_args()
    print(
        "| layout | tp × dp | model state | of it embedding + lm_head | logits (one micro-batch) "
        "| peak (dtrain: planned) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    seen = set()
    for tp in (2, 4):
        overrides = [
            "+experiment=llama3_tp4",
            f"parallel.tp={tp}",
            "train.micro_batch_size=4",
            "data.max_len=2048",
            "parallel.activation_checkpointing=full",
            "train.precision=bf16",
            f"estimate.world_size={WORLD}",
        ]
        planned = plan(compose([*overrides, "parallel.loss_impl=dense"]), WORLD)
        fused = plan(compose([*overrides, "parallel.loss_impl=fused"]), WORLD)
        dense_row = dtrain_row(planned)
        print(row("dtrain, dense loss (planned)", dense_row, f"{dense_row.logits / GB:.2f} GB",
                  planned_peak(planned, args.gpu_memory_gib)))  # fmt: skip
        chunk = f"none; one chunk's temporaries {fused.step.loss_temporaries / GB:.2f} GB"
        print(row("dtrain, loss_impl=fused (planned; auto's choice)", dtrain_row(fused), chunk,
                  planned_peak(fused, args.gpu_memory_gib)))  # fmt: skip
        for layout in comparisons(planned):
            key = (layout.name, layout.tp)
            if key in seen or ("AutoTP" not in layout.name and tp != 4):
                continue  # the plain ZeRO rows do not depend on tp: print them once
            seen.add(key)
            logits = f"{layout.logits_and_loss / GB:.2f} GB (with the loss's fp32 copies)"
            print(row(layout.name, layout, logits, "(analytic: model state after step 1, from its buffers)"))


if __name__ == "__main__":
    main()
