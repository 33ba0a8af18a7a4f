"""The planner's answer as one JSON object (bytes) or as a table (GiB)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from dtrain.estimate.deepspeed import Layout, layouts
from dtrain.estimate.planner import Plan, Suggestion

GIB = 2**30
AT_PEAK_LABELS = {
    "params": "sharded parameters + buffers",
    "grads": "sharded gradients",
    "optimizer": "optimizer state",
    "unsharded_params": "unsharded (all-gathered) parameters",
    "activations": "activations (+ inputs)",
    "temporaries": "temporaries (backward, reduce-scatter)",
}


def _model_state(plan: Plan) -> int:
    return plan.step.params + plan.step.grads + plan.step.optimizer


def comparisons(plan: Plan) -> list[Layout]:
    """dtrain (measured) first, then DeepSpeed's layouts of the same model and batch (analytic)."""
    layers = plan.layers
    head = layers["embedding"]["local"] + (0 if plan.tied else layers["lm_head"]["local"])
    head_share = head / plan.step.params
    dtrain = Layout(
        "dtrain (measured)",
        plan.shape.tp,
        plan.shape.world // plan.shape.tp,  # the states are sharded over dp × cp
        _model_state(plan),
        round(_model_state(plan) * head_share),  # params, grads and AdamW states share one layout
        plan.step.logits,
    )
    analytic = layouts(
        plan.census, plan.shape.world, plan.shape.tp, plan.micro_batch_size, plan.max_len, plan.precision
    )
    return [dtrain, *analytic]


def verdict(peak: int, gpu_memory_gib: float) -> dict[str, Any]:
    budget = round(gpu_memory_gib * GIB)
    return {
        "gpu_memory_bytes": budget,
        "fits": peak <= budget,
        "headroom_bytes": budget - peak,
        "headroom_fraction": (budget - peak) / budget,
    }


def to_json(plan: Plan, gpu_memory_gib: float, suggestions: list[Suggestion], top: int) -> dict[str, Any]:
    step = asdict(plan.step)
    modules = step.pop("modules")[:top]
    return {
        "experiment": {
            "model_type": plan.model_type,
            "num_params": plan.num_params,
            "world_size": plan.shape.world,
            "mesh": plan.shape.degrees(),
            "micro_batch_size": plan.micro_batch_size,
            "max_len": plan.max_len,
            "precision": plan.precision,
            "activation_checkpointing": plan.activation_checkpointing,
            "attention": plan.attention,
            "accumulation": plan.accumulation,
        },
        "per_rank": step,
        "layers": plan.layers,
        "top_modules": modules,
        "verdict": verdict(plan.step.peak, gpu_memory_gib),
        "comparisons": [{**asdict(c), "analytic": i > 0} for i, c in enumerate(comparisons(plan))],
        "suggestions": [
            {"change": s.change, "peak": s.plan.step.peak, "fits": s.fits, "per_rank": asdict(s.plan.step)}
            for s in suggestions
        ],
        "seconds": plan.seconds,
    }


def _unit(plan: Plan) -> tuple[str, int]:
    """GiB for real models, MiB for small ones (whose figures would all read 0.00 GiB)."""
    return ("GiB", GIB) if plan.step.peak >= GIB else ("MiB", 2**20)


def to_table(plan: Plan, gpu_memory_gib: float, suggestions: list[Suggestion], top: int) -> str:
    step, shape = plan.step, plan.shape
    unit, divisor = _unit(plan)

    def num(value: float) -> str:
        return f"{value / divisor:9.2f}"

    def row(label: str, value: float) -> str:
        return f"  {label:<52}{num(value)}"

    v = verdict(step.peak, gpu_memory_gib)
    axes = " × ".join(
        f"{axis} {degree}"
        for axis, degree in shape.degrees().items()
        if degree > 1 or axis in ("dp_shard", "tp")
    )
    lines = [
        f"dtrain plan: {plan.model_type}, {plan.num_params / 1e9:.3g} B parameters | world "
        f"{shape.world} = {axes} | micro batch "
        f"{plan.micro_batch_size} × max_len {plan.max_len} | {plan.precision} | activation checkpointing "
        f"{plan.activation_checkpointing} | attention {plan.attention} | {plan.accumulation} micro-batches "
        f"per step (tracked {step.micro_batches}) | planned in {plan.seconds:.0f} s",
        "",
        f"per rank, {unit} (measured: FSDPMemTracker on fake tensors, one step after a warm-up step)",
        row("model state between steps", _model_state(plan)),
        row("  sharded parameters (fp32) + buffers", step.params),
        row("  sharded gradients (fp32)", step.grads),
        row("  AdamW state", step.optimizer),
        f"  at the peak, in the {step.peak_phase}:",
        *(row("  " + AT_PEAK_LABELS[k], value) for k, value in step.at_peak.items()),
        row("peak", step.peak),
        *(
            [row("logits of one micro-batch (lm_head output shard)", step.logits)]
            if step.loss_temporaries is None
            else [row("fused loss: temporaries (one chunk's logits at a time)", step.loss_temporaries)]
        ),
        "",
        f"verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} in {gpu_memory_gib:g} GiB, headroom "
        f"{v['headroom_bytes'] / GIB:.2f} GiB ({v['headroom_fraction']:.0%})",
        "  (not counted: CUDA context, NCCL buffers, allocator fragmentation)",
        "",
        f"embedding and lm_head weights, {unit}: "
        + ", ".join(
            f"{name} {num(b['local']).strip()} per rank of {num(b['total']).strip()}"
            for name, b in plan.layers.items()
        )
        + (" (tied: one tensor)" if plan.tied else ""),
        "",
        f"top {top} modules, {unit} in use while each ran, and the activations its forward kept",
        f"  {'module':<44}{'forward':>9}{'backward':>9}{'kept':>9}",
        *(
            f"  {m.name[-44:]:<44}{num(m.peak_forward)}{num(m.peak_backward)}{num(m.activations)}"
            for m in step.modules[:top]
        ),
        "",
        f"the same model and batch under DeepSpeed, {unit} per rank "
        "(analytic: ZeRO paper formulas, AutoTP's layout)",
        f"  {'layout':<22}{'tp':>4}{'dp':>4}{'model state':>13}{'emb+head':>10}{'logits':>9}",
        *(
            f"  {c.name:<22}{c.tp:>4}{c.dp:>4}{num(c.model_state):>13}{num(c.embedding_and_head):>10}"
            f"{num(c.logits)}"
            for c in comparisons(plan)
        ),
        "  AutoTP keeps embedding, lm_head and norms whole on every tp rank, ZeRO partitions over dp",
        "  only, and every DeepSpeed rank computes full-vocabulary logits; dtrain shards all over (dp, tp).",
    ]
    if suggestions:
        lines += ["", "what would fit (each planned in full, one change at a time):"]
        lines += [
            f"  {s.change:<40} peak {num(s.plan.step.peak).strip()} {unit}  "
            + ("fits" if s.fits else "still does not fit")
            for s in suggestions
        ]
    return "\n".join(lines)
