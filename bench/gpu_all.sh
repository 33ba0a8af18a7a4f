#!/usr/bin/env bash
# Every GPU check, in one command for a lent device (issue 32):
#
#   bench/gpu_all.sh              # on the GPU machine; figures under $OUT (else a new temporary folder)
#   bench/gpu_all.sh --dry-run    # the same steps on the CPU with tiny shapes (tests/test_gpu_scripts.py)
#
# 1. `pip install -e .` against the machine's own CUDA torch: a constraint pins torch to the version
#    already installed, so pip can never replace it (and the script stops if torch changed anyway).
# 2. Each check under its own `timeout`, writing its output and figures under $OUT:
#    - estimate: bench/gpu_estimate_check.py, the planned peak against torch.cuda.max_memory_allocated
#      (exits 1 outside 10 %);
#    - sft: a 20-step `torchrun --nproc_per_node=1 -m dtrain.sft` of the embedded default (tp=1), bf16
#      (nccl on CUDA, gloo on the CPU: dtrain picks the backend from the device);
#    - cuda_tests: the test files that hold CUDA_ONLY below, the suite's one way to skip a test
#      without a GPU (found by grep, so a new one is picked up); none exist today, and the row says so;
#    - gpu_check: bench/gpu_check.py, dtrain 1x1 against the plain loop on the Llama-3.2-1B shape
#      (eager and compiled, packed and unpacked, dense and fused; LoRA and QLoRA against PEFT), last:
#      it is the longest, and a timeout there leaves the other figures in place.
#    - lora: a `torchrun --nproc_per_node=1 -m dtrain.sft +experiment=llama3_8b_lora` of 10 steps
#      (issue 30): Llama-3-8B's shape from its shipped config.json, random init (no weights are
#      downloaded), the frozen base in bf16, r=16 on every projection, packed rows of the shipped
#      dataset at 2048 tokens; its metrics.jsonl gives tokens/s, MFU (forward + activation
#      gradients over the base, weight gradients for the adapters only) and peak memory. The dry run
#      trains the embedded tiny Llama with lora.r=16 for 2 steps instead.
#    - moe: `torchrun -m dtrain.sft +experiment=qwen3_moe_30b_a3b_ep8` (issue 42) on every GPU of the
#      machine with parallel.ep = their count (1 on a one-GPU machine: no all-to-all then, the
#      grouped GEMMs, router and aux loss all the same), 4 of its 48 layers (128 experts, top-8; a
#      layer's experts 0.6 B parameters), random init, bf16, the router's aux loss on (its default
#      scope, micro_step), packed rows of 2048 tokens, 10 steps; metrics.jsonl gives tokens/s, MFU
#      (FLOPs of the top-8 experts a token uses) and peak memory. The dry run: 2 gloo processes,
#      ep = 2, the same experiment shrunk to a tiny width, 2 steps.
#    - qlora: `+experiment=llama3_70b_qlora_tp2` (issue 44) on one GPU, at tp=1 and with 2 of
#      Llama-3-70B's 80 decoder layers: its widths (hidden 8192, MLP 28672) in NF4, quantized from a
#      random init on the GPU, dequantized after each all-gather; packed rows at 2048 tokens, 10
#      steps. Its metrics.jsonl gives a 70B-shaped layer's step time, MFU and peak memory, to set next
#      to the plan (docs/lora.md). The dry run: the tiny Llama with lora.base_dtype=nf4, 2 steps.
#    - dpo: a `torchrun --nproc_per_node=1 -m dtrain.dpo +experiment=llama3_8b_dpo_lora` of 10 steps
#      (issue 41): Llama-3-8B's shape, random init, LoRA r=16 on a bf16 base, the reference the same
#      model with its adapters bypassed, 32 shipped pairs a micro-batch packed into rows of 1024; its
#      metrics.jsonl gives tokens/s, MFU, peak memory and the rewards. The dry run trains the
#      embedded DPO default with lora.r=16 for 2 steps instead.
#    - grpo: a `torchrun --nproc_per_node=1 -m dtrain.grpo` of the embedded default (issue 49: the tiny
#      Llama on the shipped prompts, tp=1, bf16) for 10 steps, its rollouts by vLLM colocated
#      (rollout.engine=vllm) where vLLM imports, else by transformers' generate on the GPU (hf): the
#      engine is in its log and config.yaml; metrics.jsonl gives the time split (rollout, sync,
#      train), tokens generated per second and the mean reward. The dry run: hf, 2 steps.
#    - rollout: bench/gpu_rollout_check.py (issue 49), the `vllm` rollout engine: `pip install
#      dtrain[vllm]` first (T_VLLM_INSTALL; torch and transformers pinned to the installed ones, so
#      it installs a vLLM that fits them or nothing), then a small Llama synced into the real
#      vLLM colocated in sleep mode, vLLM's log-probs of its sampled completions against the
#      trainer's within bf16's tolerance (the script's docstring), a stale sync caught. Where vLLM
#      cannot be installed or imported (these machines reach no package index) the row says
#      "no-vllm", which is not a failure. The dry run: the script's --dry-run (a transformers
#      stand-in for vllm.LLM on the CPU), no install.
# 3. A short table: each check's status, seconds and figures file ($OUT/summary.txt too).
#
# Exit status: 0 when every check passed (a "no-vllm" row included), 1 otherwise. Per-check limits
# (seconds) come from T_ESTIMATE, T_SFT, T_LORA, T_QLORA, T_DPO, T_GRPO, T_TESTS, T_MOE, T_GPU_CHECK,
# T_VLLM_INSTALL and T_ROLLOUT; on the GPU the first nine sum to 11 minutes (most end far sooner), one device
# command (a check cut at its limit is marked, and the others still run). Without a package index the
# rollout row ends within seconds; where vLLM installs, it needs up to T_VLLM_INSTALL + T_ROLLOUT
# (5 minutes) more: then run it as its own command, `GPU_CHECKS=rollout bench/gpu_all.sh`
# (GPU_CHECKS: the checks to run, by name, space-separated; default all). The dry run allows each
# check 5 minutes (a shared CPU is slow, and it times nothing).
set -uo pipefail

# One function, parsed whole before it runs: editing this file during a run cannot break that run.
main() {
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$ROOT"
  DRY=0
  [ "${1:-}" = "--dry-run" ] && DRY=1
  OUT="${OUT:-$(mktemp -d -t dtrain-gpu-XXXX)}"  # the device tool sets OUT: what it writes there comes back
  mkdir -p "$OUT"
  PYTHON="${PYTHON:-python3}"
  ROWS=()
  FAILED=0

  # selected NAME: whether GPU_CHECKS (default: every check) names NAME
  selected() {
    [ -z "${GPU_CHECKS:-}" ] || [[ " $GPU_CHECKS " == *" $1 "* ]]
  }

  # check NAME SECONDS FIGURES COMMAND...: run COMMAND under `timeout`, output in $OUT/NAME.log; an
  # exit status of 3 from the rollout check means vLLM is absent: reported, not a failure
  check() {
    local name="$1" limit="$2" figures="$3"
    shift 3
    selected "$name" || return 0
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS status
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    case $rc in
      0) status="ok" ;;
      3) [ "$name" = rollout ] && status="no-vllm" || status="FAIL($rc)" ;;
      124 | 137) status="TIMEOUT" ;;
      *) status="FAIL($rc)" ;;
    esac
    [ "$status" = "ok" ] || [ "$status" = "no-vllm" ] || FAILED=1
    tail -n 15 "$OUT/$name.log"
    ROWS+=("$(printf '%-12s %-10s %6ss  %s' "$name" "$status" "$((SECONDS - start))" "$figures")")
  }

  TORCH_BEFORE="$("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)')" || {
    echo "gpu_all: no torch importable by $PYTHON"
    exit 1
  }
  echo "torch $TORCH_BEFORE; dry run: $DRY; figures under $OUT"
  if [ "$DRY" = 1 ]; then
    echo "dry run: dtrain is already installed in this environment; no pip install"
    DRY_FLAG=(--dry-run)
    SFT_STEPS=2
    : "${T_ESTIMATE:=300}" "${T_SFT:=300}" "${T_LORA:=300}" "${T_QLORA:=300}" "${T_DPO:=300}" "${T_TESTS:=300}"
    : "${T_GRPO:=300}"
    : "${T_MOE:=300}" "${T_GPU_CHECK:=300}" "${T_ROLLOUT:=300}"
    LORA_RUN=(lora.r=16 train.max_steps=2 parallel.tp=1 train.precision=bf16)
    QLORA_RUN=(lora.r=16 lora.base_dtype=nf4 train.max_steps=2 parallel.tp=1 train.precision=bf16)
    DPO_RUN=(lora.r=16 train.max_steps=2 parallel.tp=1 train.precision=bf16)
    GRPO_RUN=(rollout.engine=hf train.max_steps=2 parallel.tp=1 train.precision=bf16)
    MOE_PROCS=2
    MOE_SHAPE=(model.tokenizer=dtrain/assets/tiny_llama data=tiny_sft data.max_samples=64 data.max_len=64 train.max_steps=2
      train.global_batch_size=4 +model.config.vocab_size=1024 +model.config.hidden_size=64
      +model.config.moe_intermediate_size=32 +model.config.num_attention_heads=4
      +model.config.num_key_value_heads=2 +model.config.head_dim=16 +model.config.num_experts=8
      +model.config.num_experts_per_tok=2 +model.config.num_hidden_layers=2)
  else
    echo "torch==${TORCH_BEFORE%% *}" >"$OUT/constraints.txt"
    "$PYTHON" -m pip install -q -e "$ROOT" -c "$OUT/constraints.txt" >"$OUT/install.log" 2>&1 || {
      tail -n 20 "$OUT/install.log"
      echo "gpu_all: pip install -e . failed (log: $OUT/install.log)"
      exit 1
    }
    TORCH_AFTER="$("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
    [ "$TORCH_AFTER" = "$TORCH_BEFORE" ] || {
      echo "gpu_all: torch changed from $TORCH_BEFORE to $TORCH_AFTER"
      exit 1
    }
    DRY_FLAG=()
    SFT_STEPS=20
    LORA_RUN=(+experiment=llama3_8b_lora model.init=random model.tokenizer=dtrain/assets/tiny_llama data=tiny_sft
      data.packing=true data.max_len=2048 train.max_steps=10 train.global_batch_size=8)
    MOE_PROCS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
    MOE_SHAPE=(model.tokenizer=dtrain/assets/tiny_llama data=tiny_sft data.packing=true data.max_len=2048
      train.max_steps=10 "train.global_batch_size=$((8 * MOE_PROCS))" +model.config.num_hidden_layers=4)
    QLORA_RUN=(+experiment=llama3_70b_qlora_tp2 parallel.tp=1 +model.config.num_hidden_layers=2 model.init=random
      model.tokenizer=dtrain/assets/tiny_llama data=tiny_sft data.packing=true data.max_len=2048
      train.max_steps=10 train.global_batch_size=8)
    DPO_RUN=(+experiment=llama3_8b_dpo_lora model.init=random model.tokenizer=dtrain/assets/tiny_llama
      data=tiny_dpo data.packing=true data.max_len=1024 train.max_steps=10 train.global_batch_size=64
      train.micro_batch_size=32)
    GRPO_ENGINE=hf
    "$PYTHON" -c 'import vllm' >/dev/null 2>&1 && GRPO_ENGINE=vllm
    GRPO_RUN=("rollout.engine=$GRPO_ENGINE" train.max_steps=10 train.log_every=1 parallel.tp=1 train.precision=bf16)
  fi
  # the architecture dtrain ships (a local folder: nothing is downloaded), random init
  MOE_RUN=(+experiment=qwen3_moe_30b_a3b_ep8 model.name_or_path=dtrain/assets/architectures/Qwen/Qwen3-30B-A3B
    model.init=random "parallel.ep=$MOE_PROCS" +model.config.output_router_logits=true "${MOE_SHAPE[@]}")

  check estimate "${T_ESTIMATE:-60}" "$OUT/estimate.json" \
    "$PYTHON" bench/gpu_estimate_check.py "${DRY_FLAG[@]}" --json "$OUT/estimate.json"

  check sft "${T_SFT:-75}" "$OUT/sft/metrics.jsonl" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 -m dtrain.sft \
    "train.max_steps=$SFT_STEPS" parallel.tp=1 train.precision=bf16 checkpoint.save_final=false \
    "hydra.run.dir=$OUT/sft"

  check lora "${T_LORA:-60}" "$OUT/lora/metrics.jsonl" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 -m dtrain.sft \
    "${LORA_RUN[@]}" checkpoint.save_final=false "hydra.run.dir=$OUT/lora"

  check qlora "${T_QLORA:-60}" "$OUT/qlora/metrics.jsonl" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 -m dtrain.sft \
    "${QLORA_RUN[@]}" checkpoint.save_final=false "hydra.run.dir=$OUT/qlora"

  check dpo "${T_DPO:-60}" "$OUT/dpo/metrics.jsonl" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 -m dtrain.dpo \
    "${DPO_RUN[@]}" checkpoint.save_final=false "hydra.run.dir=$OUT/dpo"

  check grpo "${T_GRPO:-45}" "$OUT/grpo/metrics.jsonl" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 -m dtrain.grpo \
    "${GRPO_RUN[@]}" checkpoint.save_final=false "hydra.run.dir=$OUT/grpo"

  CUDA_ONLY='skipif(not torch.cuda.is_available(), reason="needs a GPU")'
  mapfile -t CUDA_TESTS < <(grep -lF "$CUDA_ONLY" tests/test_*.py 2>/dev/null)
  if ! selected cuda_tests; then
    :
  elif [ "${#CUDA_TESTS[@]}" -gt 0 ]; then
    check cuda_tests "${T_TESTS:-30}" "$OUT/cuda_tests.log" \
      "$PYTHON" -m pytest -p no:cacheprovider -q -rs "${CUDA_TESTS[@]}"
  else
    ROWS+=("$(printf '%-12s %-10s %6ss  %s' cuda_tests "none" 0 "no test file holds $CUDA_ONLY")")
  fi

  check moe "${T_MOE:-60}" "$OUT/moe/metrics.jsonl" \
    "$PYTHON" -m torch.distributed.run --standalone "--nproc_per_node=$MOE_PROCS" -m dtrain.sft \
    "${MOE_RUN[@]}" checkpoint.save_final=false "hydra.run.dir=$OUT/moe"

  check gpu_check "${T_GPU_CHECK:-210}" "$OUT/gpu_check.json" \
    "$PYTHON" bench/gpu_check.py "${DRY_FLAG[@]}" --json "$OUT/gpu_check.json"

  # last: its install may add packages (never another torch or transformers: both pinned)
  if [ "$DRY" = 0 ] && selected rollout; then
    "$PYTHON" -c 'import transformers; print(f"transformers=={transformers.__version__}")' >>"$OUT/constraints.txt"
    echo "=== vllm install (limit ${T_VLLM_INSTALL:-120}s)"
    timeout --kill-after=10 "${T_VLLM_INSTALL:-120}" "$PYTHON" -m pip install -q --retries 0 --timeout 15 \
      -e "$ROOT[vllm]" -c "$OUT/constraints.txt" >"$OUT/vllm_install.log" 2>&1 ||
      echo "gpu_all: vLLM not installed (rc $?; $OUT/vllm_install.log): the rollout row will say so"
  fi
  # one process without torchrun, whose launcher would turn the script's exit status 3 into 1
  check rollout "${T_ROLLOUT:-180}" "$OUT/rollout.json" \
    "$PYTHON" bench/gpu_rollout_check.py "${DRY_FLAG[@]}" --json "$OUT/rollout.json"

  {
    echo "check        status      time  figures"
    printf '%s\n' "${ROWS[@]}"
  } | tee "$OUT/summary.txt"
  return $FAILED
}

main "$@"
exit $?
