"""`python bench/gpu_rollout_check.py`: the `vllm` rollout engine (dtrain/rollout/vllm.py) on one GPU,
run by bench/gpu_all.sh (its `rollout` row, after it tries `pip install dtrain[vllm]`).

A policy built as the trainer builds it (a small Llama, random init, bf16 compute), the real
`vllm.LLM` colocated in sleep mode, and three comparisons of log-probs of the same tokens:
1. after a sync, vLLM's log-probs of its sampled completions (processed: after the temperature)
   against the trainer's, `log_softmax(logits / T)` of its bf16 forward on prompt + completion;
2. the control: those vLLM log-probs against the trainer's after the policy changed (its final norm
   scaled by 1.25) without a sync, which must be far outside the tolerance (a stale sync shows);
3. after the sync of the changed policy (sleep mode had discarded vLLM's weights), 1 again;
and each completion of 1 ends with its EOS id (kept in the ids, as TRL counts it) or is
max_completion_length ids long (the EOS row of lm_head is scaled up, so that some end early).

The tolerance is bf16's effect on this model and these tokens, measured in the same run: the same
policy's fp32 forward (its fp32 master weights) is the exact value; `E` is the largest gap between
the trainer's bf16 log-probs and it. vLLM computes from the same bf16 weights, rounding the same
activations to bf16 in its own kernels, so its own gap to the exact value is of that size, and by
the triangle inequality its gap to the trainer's is at most about 2E; 3E (plus 2^-8, one bf16
unit at 1, for a run whose E is tiny) leaves room for vLLM rounding in places the trainer does not.
E includes the rounding of the weights to bf16, which both sides share: the bound is loose, not
tight. The figures: tokens compared, each gap's mean and max, E, the control's gap, the
importance-sampling ratios exp(trainer - vLLM) that TRL's correction would see, and vLLM's tokens/s.

Exit status: 0 when 1-3 hold, 1 when one does not, 3 when vLLM cannot be imported (gpu_all.sh
reports its absence, not a failure). `--dry-run` runs the same steps on the CPU with a stand-in for
`vllm.LLM` built on transformers (the same calls, sleep mode's rules enforced), so the script's
logic is checked where no GPU is lent; its figures are not vLLM's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dtrain.checks import check_config  # noqa: E402
from dtrain.config import (  # noqa: E402
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    SamplingConfig,
    TrainConfig,
)
from dtrain.distributed import build_parallel, init_distributed, shutdown  # noqa: E402
from dtrain.model import build_model, load_model_config, plain_config  # noqa: E402
from dtrain.parallel.parallelize import reshard  # noqa: E402
from dtrain.rollout import Prompt  # noqa: E402
from dtrain.rollout.vllm import VLLMEngine, check  # noqa: E402

TOKENIZER = ROOT / "dtrain" / "assets" / "tiny_llama"
EOS = 1  # the tiny tokenizer's
# Head dim 64 (vLLM's attention kernels' sizes); initializer_range 0.05 gives peaked enough
# distributions (entropy about 6.3 nats of 6.9) that a stale weight moves the log-probs
MODEL = dict(
    model_type="llama",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    initializer_range=0.05,
    bos_token_id=0,
    eos_token_id=EOS,
    pad_token_id=2,
)
SAMPLING = SamplingConfig(num_generations=4, max_completion_length=32, temperature=0.7)
PROMPTS = 8
PROMPT_LEN = 16
# The dry run's: the stand-in samples each completion alone, in bf16, on a shared CPU
DRY_SAMPLING = SamplingConfig(num_generations=2, max_completion_length=8, temperature=0.7)
DRY_PROMPTS = 2
BF16_UNIT = 2.0**-8
MARGIN = 3.0
NORM_SCALE = 1.25
EOS_BOOST = 6.0


def policy(precision: str, device: torch.device) -> torch.nn.Module:
    """The policy as the trainer builds it on this process group (random init, seeded: the fp32 and
    bf16 runs start from the same fp32 weights)."""
    config = Config(
        model=ModelConfig(config=dict(MODEL), init="random", tokenizer=str(TOKENIZER)),
        data=DataConfig(path=str(ROOT / "dtrain" / "assets" / "sft_tiny.jsonl"), max_len=PROMPT_LEN),
        parallel=ParallelConfig(tp=1, dp_shard=-1),
        train=TrainConfig(precision=precision, seed=3),
    )
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    return build_model(model_config, config, build_parallel(shape, device), device).eval()


@torch.no_grad()
def trainer_logprobs(
    model: torch.nn.Module, prompts: list[Prompt], completions, device, temperature: float
) -> list[float]:
    """log_softmax(logits / T) of each completion id from the policy's own forward on prompt +
    completion (the log-probs the GRPO loss computes), in completion order."""
    values: list[float] = []
    for prompt, group in zip(prompts, completions, strict=True):
        for completion in group:
            ids = torch.tensor([prompt.ids + completion.ids], device=device)
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None]).logits
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            scored = logits[0, len(prompt.ids) - 1 : -1].float() / temperature
            targets = torch.tensor(completion.ids, device=device)
            values += torch.log_softmax(scored, dim=-1).gather(1, targets[:, None])[:, 0].tolist()
    return values


def vllm_logprobs(completions) -> list[float]:
    return [value for group in completions for completion in group for value in completion.logprobs]


@torch.no_grad()
def boost_eos(model: torch.nn.Module) -> None:
    """The EOS row of lm_head times EOS_BOOST, so that some completions end before
    max_completion_length (each row of the whole matrix on this one-rank mesh)."""
    reshard(model)
    weight = model.lm_head.weight
    (weight.to_local() if isinstance(weight, DTensor) else weight)[EOS].mul_(EOS_BOOST)


def ends(completions, eos: int, length: int) -> dict[str, int]:
    """How the completions ended: `stopped` (the EOS their last id), `cut` (max_completion_length ids
    without an EOS) and `bad` (neither: an engine that dropped the EOS or stopped early)."""
    flat = [c for group in completions for c in group]
    stopped = sum(not c.truncated and c.ids[-1] == eos for c in flat)
    cut = sum(c.truncated and len(c.ids) == length and eos not in c.ids for c in flat)
    return {"stopped": stopped, "cut": cut, "bad": len(flat) - stopped - cut}


@torch.no_grad()
def scale_final_norm(model: torch.nn.Module) -> None:
    """Change the policy in place, alike on every rank: its final norm's weight times NORM_SCALE, in
    the optimizer's (sharded) parameter: FSDP keeps the root's gathered copy after a forward."""
    reshard(model)
    weight = model.model.norm.weight
    (weight.to_local() if isinstance(weight, DTensor) else weight).mul_(NORM_SCALE)


def gaps(a: list[float], b: list[float]) -> dict[str, float]:
    difference = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return {"mean": difference.abs().mean().item(), "max": difference.abs().max().item()}


def compare(bf16, fp32, prompts, completions, device, temperature: float, label: str) -> dict:
    """One comparison: vLLM's log-probs against the bf16 trainer's, within MARGIN·E + BF16_UNIT."""
    ours = vllm_logprobs(completions)
    trainer = trainer_logprobs(bf16, prompts, completions, device, temperature)
    exact = trainer_logprobs(fp32, prompts, completions, device, temperature)
    bf16_error = gaps(trainer, exact)["max"]
    tolerance = MARGIN * bf16_error + BF16_UNIT
    gap = gaps(ours, trainer)
    ratios = torch.tensor(trainer, dtype=torch.float64).sub(torch.tensor(ours, dtype=torch.float64)).exp()
    result = {
        "tokens": len(ours),
        "vllm_vs_trainer": gap,
        "vllm_vs_fp32": gaps(ours, exact),
        "trainer_bf16_vs_fp32_max": bf16_error,
        "tolerance": tolerance,
        "is_ratio_min": ratios.min().item(),
        "is_ratio_max": ratios.max().item(),
        "ok": gap["max"] <= tolerance,
    }
    print(
        f"{label}: {len(ours)} tokens, |vLLM - trainer| mean {gap['mean']:.2e} max {gap['max']:.2e} "
        f"(tolerance {tolerance:.2e} = {MARGIN} x bf16's {bf16_error:.2e} + 2^-8), importance ratios "
        f"{ratios.min().item():.4f}..{ratios.max().item():.4f}: {'within' if result['ok'] else 'OUTSIDE'}"
    )
    return result


def prompts_of(generator: torch.Generator, count: int) -> list[Prompt]:
    return [
        Prompt(
            index=i,
            ids=[0, *torch.randint(3, MODEL["vocab_size"], (PROMPT_LEN - 1,), generator=generator).tolist()],
            record=None,
        )
        for i in range(count)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, a transformers stand-in for vllm.LLM")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    settings = RolloutConfig(engine="vllm", vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=True)
    if not args.dry_run:
        try:
            check(settings)
        except Exception as error:  # ConfigError: no vLLM, or no GPU
            print(f"gpu_rollout_check: {error}")
            if args.json:
                args.json.write_text(json.dumps({"vllm": None, "reason": str(error)}, indent=1))
            raise SystemExit(3 if "cannot be imported" in str(error) else 1) from None
    device = init_distributed(timeout_s=600)
    sampling = DRY_SAMPLING if args.dry_run else SAMPLING
    bf16, fp32 = policy("bf16", device), policy("fp32", device)
    boost_eos(bf16), boost_eos(fp32)
    folder = Path(tempfile.mkdtemp(prefix="dtrain-vllm-"))
    llm = StandInLLM(bf16.config, torch.bfloat16) if args.dry_run else None
    params = StandInParams if args.dry_run else None
    max_len = PROMPT_LEN + sampling.max_completion_length
    start = time.perf_counter()
    engine = VLLMEngine(
        settings, sampling, 5, bf16.config, [EOS], torch.bfloat16, max_len, folder, llm, params
    )
    built = time.perf_counter() - start
    prompts = prompts_of(torch.Generator().manual_seed(0), DRY_PROMPTS if args.dry_run else PROMPTS)
    temperature = sampling.temperature
    results: dict = {"vllm": "stand-in (dry run)" if args.dry_run else vllm_version(), "build_s": built}

    engine.sync(bf16)
    start = time.perf_counter()
    completions = engine.generate(prompts, 0)
    seconds = time.perf_counter() - start
    results["tokens_per_s"] = sum(len(c.ids) for group in completions for c in group) / seconds
    results["synced"] = compare(bf16, fp32, prompts, completions, device, temperature, "1. synced")
    results["ends"] = ends(completions, EOS, sampling.max_completion_length)
    print(f"   completions {results['ends']}: each ends with its EOS or is max_completion_length long")

    scale_final_norm(bf16), scale_final_norm(fp32)
    results["stale"] = compare(
        bf16, fp32, prompts, completions, device, temperature, "2. control, not synced"
    )
    results["stale"]["ok"] = not results["stale"]["ok"]  # it must fail: a stale sync would show
    verdict = "ok" if results["stale"]["ok"] else "FAIL, stale weights would pass"
    print(f"   the control must be outside: {verdict}")

    engine.sync(bf16)
    again = engine.generate(prompts, 1)
    results["resynced"] = compare(bf16, fp32, prompts, again, device, temperature, "3. synced again")
    failed = [name for name in ("synced", "stale", "resynced") if not results[name]["ok"]]
    failed += ["ends"] if results["ends"]["bad"] else []
    results["failed"] = failed
    print(
        f"vLLM {results['vllm']}: {results['tokens_per_s']:.0f} tokens/s; "
        + (f"FAILED {failed}" if failed else "all ok")
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    shutdown()
    raise SystemExit(1 if failed else 0)


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def StandInParams(**settings) -> SimpleNamespace:  # noqa: N802 (stands in for a class)
    return SimpleNamespace(**settings)


class StandInLLM:
    """The dry run's `vllm.LLM`: the calls VLLMEngine makes, on a plain transformers model in the
    engine's dtype. Sleep mode's rules as vLLM's: level 2 discards the weights, loading needs them
    awake, generating needs the KV cache awake. Log-probs are the processed ones (the scores after
    the temperature), as `logprobs_mode="processed_logprobs"` gives them."""

    def __init__(self, model_config, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(plain_config(model_config), dtype=dtype).eval()
        self.awake = {"weights": True, "kv_cache": True}
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self.load_weights))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )

    def sleep(self, level: int) -> None:
        assert level == 2
        self.awake = {"weights": False, "kv_cache": False}
        with torch.no_grad():
            for param in self.model.parameters():
                param.fill_(float("nan"))  # discarded: a generate without a new sync would show

    def wake_up(self, tags: list[str]) -> None:
        for tag in tags:
            self.awake[tag] = True

    def reset_prefix_cache(self) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        assert self.awake["weights"], "load_weights while vLLM's weights sleep"
        state = self.model.state_dict()
        for name, tensor in weights:
            state[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[dict], sampling_params: list, use_tqdm: bool) -> list:
        from transformers import GenerationConfig

        assert self.awake["kv_cache"] and self.awake["weights"], "generate while vLLM sleeps"
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            config = GenerationConfig(
                max_new_tokens=params.max_tokens,
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                eos_token_id=params.stop_token_ids,
                pad_token_id=params.stop_token_ids[0],
                output_scores=True,  # the processed scores: after the temperature
                return_dict_in_generate=True,
            )
            torch.manual_seed(params.seed)
            ids = torch.tensor([prompt["prompt_token_ids"]])
            out = self.model.generate(input_ids=ids, generation_config=config)
            tokens = out.sequences[0, ids.shape[1] :].tolist()
            logprobs = [
                {
                    token: SimpleNamespace(
                        logprob=torch.log_softmax(score[0].float(), -1)[token].item(), rank=1
                    )
                }
                for token, score in zip(tokens, out.scores, strict=True)
            ]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)]))
        return outputs


if __name__ == "__main__":
    main()
