"""The small experiments the planner is checked against a real gloo run on (4 ranks; SINGLE's on
one process, 1x1: no TP, no FSDP, a bf16 run and QLoRA's): the embedded
default (tiny Llama, shipped data) with accumulation, with and without activation checkpointing, with
the fused loss, with a large vocabulary, with context parallel on packed rows, LoRA on a frozen
bf16 base and on an NF4 one (QLoRA) in a bf16 run, dtrain.dpo's step on the embedded pairs (a
live reference; LoRA with its adapters bypassed), and dtrain.grpo's on the embedded prompts (a frozen
reference, old log-probs, the hf engine's generator). The same overrides go to the planner and to the
real run; each names its loss (`parallel.loss_impl`), so a change of the default changes none. One
scenario accumulates 4 micro-batches (the planner tracks 2 of any accumulation: this checks that two
stand for more); the others 2, which is all the planner runs, to keep the real run short.

`python -m tests.estimate_scenarios [NAME ...]` prints, by name, the planner's JSON (as `python -m
dtrain.estimate ... estimate.format=json` does) of each scenario NAME (default: all), planned with the
attention kernel the real CPU run takes: sdpa with a dense mask (the command line plans CUDA's, flex
attention with a block mask).
Without a mask (rows neither packed nor split over cp) both take sdpa's causal kernel.

Without NAMEs it prints {"scenarios": those, "docs": the plans the docs quote (DOC_PLANS), as `python
-m dtrain.estimate ARGS` plans them (CUDA's kernel; no suggestions), each {"json": the JSON object,
"table": the printed table}}, for test_estimate to hold the docs' figures to them."""

import json
import sys

WORLD = 4
_COMMON = [f"estimate.world_size={WORLD}", "estimate.format=json"]
SCENARIOS = {
    "tp2_checkpointed": [
        *_COMMON,
        "parallel.tp=2",
        "parallel.activation_checkpointing=full",
        "train.micro_batch_size=4",
        "parallel.loss_impl=dense",
    ],
    "tp4_plain": [
        *_COMMON,
        "parallel.tp=4",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "parallel.loss_impl=dense",
    ],
    "tp2_fused": [
        *_COMMON,
        "parallel.tp=2",
        "train.micro_batch_size=8",
        "parallel.loss_impl=fused",
        "parallel.loss_chunk=16",
    ],
    # a vocabulary 16x the tiny Llama's: the logits and their loss temporaries are a large part of
    # the peak, so a plan that dropped them would miss the real count by more than 10 %
    "tp2_large_vocab": [
        *_COMMON,
        "parallel.tp=2",
        "train.micro_batch_size=8",
        "parallel.loss_impl=dense",
        "+model.config.vocab_size=16384",
    ],
    "cp2_tp2_packed": [
        *_COMMON,
        "parallel.cp=2",
        "parallel.tp=2",
        "data.packing=true",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "parallel.loss_impl=dense",
    ],
    # LoRA (rank 8 on every projection): the base frozen (no gradients, no AdamW state) and kept in
    # bf16, the adapters fp32, FSDP gathering bf16 (train.precision=bf16 runs on a CPU too)
    "lora_bf16_tp2": [
        *_COMMON,
        "parallel.tp=2",
        "train.micro_batch_size=8",
        "train.precision=bf16",
        "lora.r=8",
        "lora.base_dtype=bf16",
        "parallel.loss_impl=dense",
    ],
    # QLoRA: the same with the adapted weights in NF4 (a rank's rows of 4-bit codes and 8-bit scale
    # codes, uint8), FSDP gathering those bytes and dequantizing them to bf16 after the gather
    "lora_nf4_tp2": [
        *_COMMON,
        "parallel.tp=2",
        "train.micro_batch_size=8",
        "train.precision=bf16",
        "lora.r=8",
        "lora.base_dtype=nf4",
        "parallel.loss_impl=dense",
    ],
    # one process (1x1): no TP, no FSDP (plain tensors; bf16 under autocast from fp32 master weights),
    # the real run a 1-process launch of its own (SINGLE)
    "1x1_bf16": [
        "estimate.world_size=1",
        "estimate.format=json",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "train.precision=bf16",
        "parallel.loss_impl=dense",
    ],
    # QLoRA on one process: the NF4 base stays NF4 (no FSDP to gather it), dequantized per matmul
    "1x1_lora_nf4": [
        "estimate.world_size=1",
        "estimate.format=json",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "train.precision=bf16",
        "lora.r=8",
        "lora.base_dtype=nf4",
        "parallel.loss_impl=dense",
    ],
    # dtrain.dpo on the embedded pairs: micro-batches of 4 pairs (8 rows), the live reference (a
    # frozen copy of the policy, sharded like it) run before the step's first gradient
    "dpo_tp2_live": [
        *_COMMON,
        "data=tiny_dpo",
        "data.max_len=32",
        "parallel.tp=2",
        "train.micro_batch_size=4",
        "train.global_batch_size=16",
        "dpo.reference=live",
        "parallel.loss_impl=fused",
        "parallel.loss_chunk=16",
    ],
    # dtrain.dpo with LoRA on a frozen bf16 base: the reference is the same model with its adapters
    # bypassed (dpo.reference=auto: adapters_off), no second model
    "lora_dpo_bf16_tp2": [
        *_COMMON,
        "data=tiny_dpo",
        "data.max_len=32",
        "parallel.tp=2",
        "train.micro_batch_size=4",
        "train.global_batch_size=16",
        "train.precision=bf16",
        "lora.r=8",
        "lora.base_dtype=bf16",
        "parallel.loss_impl=fused",
        "parallel.loss_chunk=16",
    ],
    # dtrain.grpo on the embedded prompts: micro-batches of 8 completions (a prompt and a whole
    # completion a row), beta 0.04 (a frozen copy of the policy as the reference) and two passes over a
    # generation (old log-probs in the micro-batches), the hf engine's generator copy beside the step
    "grpo_tp2_kl": [
        *_COMMON,
        "data=tiny_grpo",
        "data.max_len=32",
        "parallel.tp=2",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "grpo.num_generations=8",
        "grpo.max_completion_length=8",
        "grpo.beta=0.04",
        "grpo.num_iterations=2",
        "rollout.engine=hf",
        "moe.aux_scope=global_batch",
        "parallel.loss_impl=fused",
        "parallel.loss_chunk=16",
    ],
}
SINGLE = ("1x1_bf16", "1x1_lora_nf4")  # run on 1 process; the others on WORLD
REAL_RUN_ATTENTION = "sdpa"  # dtrain.attention.backend_for on a CPU
# The plans README.md, docs/models.md, docs/architecture.md and docs/estimate.md quote (the LoRA one
# also docs/lora.md's experiment): each the command the docs give, without suggestions.
LLAMA3_32K = ["+experiment=llama3_8b_32k", "estimate.world_size=8", "parallel.loss_impl=dense"]
DOC_PLANS = {
    "32k_cp2": LLAMA3_32K,
    "32k_cp1": [*LLAMA3_32K, "parallel.cp=1"],
    "lora_8b": ["+experiment=llama3_8b_lora", "estimate.world_size=1"],
}


def planned(name: str) -> dict:
    from dtrain.estimate.app import compose
    from dtrain.estimate.planner import plan
    from dtrain.estimate.report import to_json

    config = compose(SCENARIOS[name])
    settings = config.estimate
    result = plan(config, settings.world_size, attention_backend=REAL_RUN_ATTENTION)
    return to_json(result, settings.gpu_memory_gib, [], settings.top_modules)


def planned_for_docs(name: str) -> dict:
    from dtrain.estimate.app import compose
    from dtrain.estimate.planner import plan
    from dtrain.estimate.report import to_json, to_table

    config = compose([*DOC_PLANS[name], "estimate.suggestions=false"])
    settings = config.estimate
    result = plan(config, settings.world_size)
    return {
        "json": to_json(result, settings.gpu_memory_gib, [], settings.top_modules),
        "table": to_table(result, settings.gpu_memory_gib, [], settings.top_modules),
    }


if __name__ == "__main__":  # one process plans them all: an interpreter's start-up is most of a plan
    if sys.argv[1:]:
        print(json.dumps({name: planned(name) for name in sys.argv[1:]}))
    else:
        scenarios = {name: planned(name) for name in SCENARIOS}
        print(
            json.dumps({"scenarios": scenarios, "docs": {name: planned_for_docs(name) for name in DOC_PLANS}})
        )
