"""The run that motivated dtrain, planned: Llama-3-8B on 4 ranks at tp=2 and tp=4, max_len 2048,
micro batch 4, full activation checkpointing, bf16; DeepSpeed's layouts beside it (analytic).
Prints a Markdown table (GB = 1e9 bytes, as in the design notes) for docs/estimate.md.

    python bench/plan_motivating_run.py [--gpu-memory-gib 80]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.estimate.app import compose  # noqa: E402
from dtrain.estimate.planner import plan  # noqa: E402
from dtrain.estimate.report import comparisons, verdict  # noqa: E402

WORLD = 4
GB = 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    args = parser.parse_args()
    print(
        "| layout | tp × dp | model state | of it embedding + lm_head | logits (one micro-batch) "
        "| peak (dtrain: measured) |"
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
        planned = plan(compose(overrides), WORLD)
        v = verdict(planned.step.peak, args.gpu_memory_gib)
        for layout in comparisons(planned):
            key = (layout.name, layout.tp)
            if key in seen or (layout.name.startswith("ZeRO-") and "AutoTP" not in layout.name and tp != 4):
                continue  # the plain ZeRO rows do not depend on tp: print them once
            seen.add(key)
            measured = layout.name.startswith("dtrain")
            peak = (
                f"{planned.step.peak / GB:.1f} GB ({'fits' if v['fits'] else 'does not fit'} in "
                f"{args.gpu_memory_gib:g} GiB; {planned.step.peak_phase}; planned in {planned.seconds:.0f} s)"
                if measured
                else "(analytic: model state + logits only)"
            )
            print(
                f"| {layout.name} | {layout.tp} × {layout.dp} | {layout.model_state / GB:.1f} GB "
                f"| {layout.embedding_and_head / GB:.1f} GB | {layout.logits / GB:.2f} GB | {peak} |"
            )


if __name__ == "__main__":
    main()
