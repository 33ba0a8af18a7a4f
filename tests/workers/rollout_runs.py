"""Launched by tests/test_rollout.py by run_worker: every rollout scenario for this world size on one
process group. Each builds the policy as the trainer does (tests.helpers.sharded_model) and syncs it
into the engines: the `hf` engine (its generator's tensors, buffers included, and each prompt's
completions) and the `vllm` engine with a recording stand-in for `vllm.LLM` (what reached its
`load_weights`, in order, and the calls around it). Rank 0 saves `<out>/<name>.pt`; the pytest side
compares them with transformers, PEFT, the models' safetensors and each other.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from dtrain.config import LoraConfig, RolloutConfig, SamplingConfig
from dtrain.distributed import init_distributed
from dtrain.model import canonical_name
from dtrain.rollout import Prompt
from dtrain.rollout.hf import HFEngine
from dtrain.rollout.sampling import eos_token_ids
from dtrain.rollout.vllm import VLLMEngine
from tests.helpers import one_backward, parity_config, save_results, sharded_model

SEED = 11
PROMPTS = [[5, 9, 33, 17], [7, 7, 120, 3, 44], [60, 2, 8], [90, 91, 92, 93, 94, 95]]  # one a dp rank at dp 4
# Not TRL's defaults, so that each setting reaches transformers; DEFAULTS: TRL 1.16 GRPOConfig's
SAMPLING = SamplingConfig(
    num_generations=3,
    max_completion_length=8,
    temperature=0.8,
    top_p=0.95,
    top_k=200,
    min_p=0.01,
    repetition_penalty=1.1,
)
DEFAULTS = SamplingConfig(num_generations=3, max_completion_length=8)
TRAIN_STEPS = 2
# name: (model folder, dp, tp, ep, extra settings); each adds a mesh, a family or a source of weights
SCENARIOS = {
    1: {
        "1x1": ("llama", 1, 1, 1, {"train": True, "vllm": True, "defaults": True}),
        "1x1_bf16": ("llama", 1, 1, 1, {"precision": "bf16"}),
    },
    4: {
        "dp4": ("llama", 4, 1, 1, {}),
        "2x2": ("llama", 2, 2, 1, {"train": True, "vllm": True}),  # the vocabulary padded for tp 2
        "2x2_qlora": ("llama", 2, 2, 1, {"lora": "nf4"}),  # NF4 dequantized, merged; the vocabulary padded
        "2x2_phi3_lora": ("phi3", 2, 2, 1, {"lora": "fp32"}),  # split qkv/gate_up, one A per fused module
        "moe_2x2_ep2": ("moe", 2, 2, 2, {"vllm": True}),  # experts over ep, one tensor each for vLLM
    },
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def gather(value: object) -> list:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def generator_tensors(engine: HFEngine) -> dict[str, torch.Tensor]:
    """The generator's parameters and buffers (non-persistent ones too: the rotary frequencies)."""
    tensors = dict(engine.generator.named_parameters(remove_duplicate=False))
    tensors |= dict(engine.generator.named_buffers())
    return {name: tensor.detach().clone() for name, tensor in tensors.items()}


def completions_by_prompt(engine, prompts: list[Prompt], generation: int) -> dict[int, list]:
    """Collective. {prompt index: its completions as (ids, truncated, logprobs)} over every rank."""
    mine = {
        prompt.index: [(c.ids, c.truncated, c.logprobs) for c in completions]
        for prompt, completions in zip(prompts, engine.generate(prompts, generation), strict=True)
    }
    merged: dict[int, list] = {}
    for share in gather(mine):
        for index, completions in share.items():
            assert merged.setdefault(index, completions) == completions, f"prompt {index} differs over ranks"
    return merged


def dp_prompts(parallel_dp: int, dp_rank: int) -> list[Prompt]:
    """This dp rank's share of PROMPTS (every tp rank of it holds the same)."""
    return [
        Prompt(index=i, ids=ids, record=None) for i, ids in enumerate(PROMPTS) if i % parallel_dp == dp_rank
    ]


class RecordingModel:
    """Stands in for vLLM's model: records each load_weights call's (name, tensor) pairs."""

    def __init__(self, events: list) -> None:
        self.events = events

    def load_weights(self, weights) -> None:
        self.events.append(("load", [(name, tensor.detach().clone()) for name, tensor in weights]))


class RecordingLLM:
    """Stands in for `vllm.LLM` where VLLMEngine calls it: records every call, and answers
    `generate` with ids and log-probs drawn from each request's own seed (the prompt's last id first,
    so that each output names its prompt)."""

    def __init__(self, eos: int) -> None:
        self.events: list = []
        self.eos = eos
        model = RecordingModel(self.events)
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )

    def sleep(self, level: int) -> None:
        self.events.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.events.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self) -> None:
        self.events.append(("reset_prefix_cache",))

    def generate(self, prompts: list[dict], sampling_params: list[dict], use_tqdm: bool) -> list:
        self.events.append(("generate", [p["prompt_token_ids"] for p in prompts], sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            generator = torch.Generator().manual_seed(params["seed"])
            ids = [
                prompt["prompt_token_ids"][-1],
                *torch.randint(0, 12, (params["max_tokens"] - 1,), generator=generator).tolist(),
            ]
            if self.eos in ids[1:]:  # vLLM stops at the first stop id, which it returns
                ids = ids[: ids.index(self.eos, 1) + 1]
            values = (-torch.rand(len(ids), generator=generator)).tolist()
            logprobs = [
                {token: SimpleNamespace(logprob=value, rank=1)}
                for token, value in zip(ids, values, strict=True)
            ]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outputs


def vllm_run(config, model, eos: list[int], tp_size: int, world_rank: int) -> dict:
    """The vllm engine on the recording stand-in, in sleep mode: one sync and one generate, then a
    generate without a sync (refused), and the prompts by global rank (each rank its own)."""
    settings = RolloutConfig(engine="vllm", vllm_enable_sleep_mode=True, vllm_tensor_parallel_size=tp_size)
    llm = RecordingLLM(eos[0])
    engine = VLLMEngine(
        settings, SAMPLING, SEED, model.config, eos, torch.float32, 64, Path("unused"), llm, dict
    )
    engine.sync(model)
    prompts = [
        Prompt(index=i, ids=ids, record=None)
        for i, ids in enumerate(PROMPTS)
        if i % dist.get_world_size() == world_rank
    ]
    completions = {
        prompt.index: [(c.ids, c.truncated, c.logprobs) for c in group]
        for prompt, group in zip(prompts, engine.generate(prompts, 0), strict=True)
    }
    try:
        engine.generate(prompts, 1)
        refused = False
    except RuntimeError:
        refused = True
    events = [(e[0], e[1]) if e[0] == "load" else e for e in llm.events]
    return {"events": events, "completions": completions, "refused_unsynced": refused}


def run(name: str, kind: str, dp: int, tp: int, ep: int, extra: dict, models: Path, device) -> dict:
    folder = models / kind
    config = parity_config(folder, dp, tp)
    config.parallel.ep = ep
    config.train.precision = extra.get("precision", "fp32")
    if "lora" in extra:
        config.lora = LoraConfig(adapter=str(folder / "adapter"), base_dtype=extra["lora"])
    model = sharded_model(config, device)
    dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = eos_token_ids(tokenizer.eos_token_id, model.config, str(folder))
    engine = HFEngine(model.config, SAMPLING, SEED, eos, tokenizer.pad_token_id, dtype, device)
    engine.sync(model)
    saved: dict = {"eos": eos, "pad": tokenizer.pad_token_id, "synced": generator_tensors(engine)}
    dp_rank = dist.get_rank() // tp  # dp is the outer mesh dimension, tp the inner
    prompts = dp_prompts(dp, dp_rank)
    saved["completions"] = completions_by_prompt(engine, prompts, 0)
    saved["generation_1"] = completions_by_prompt(engine, prompts, 1)
    # batching never changes a prompt's completions: its rank's prompts reversed, and each alone
    reversed_ = {p.index: c for p, c in zip(prompts[::-1], engine.generate(prompts[::-1], 0), strict=True)}
    alone = {p.index: engine.generate([p], 0)[0] for p in prompts}
    together = dict(zip([p.index for p in prompts], engine.generate(prompts, 0), strict=True))
    saved["batching_agrees"] = all(gather(reversed_ == together and alone == together))
    if extra.get("defaults"):
        plain = HFEngine(model.config, DEFAULTS, SEED, eos, tokenizer.pad_token_id, dtype, device)
        plain.sync(model)
        saved["defaults"] = completions_by_prompt(plain, prompts, 0)
        del plain
    if extra.get("vllm"):
        saved["vllm"] = gather(vllm_run(config, model, eos, min(tp * dp, 2), dist.get_rank()))
    if extra.get("train"):  # a few AdamW steps, then the generator against the policy's own tensors
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(TRAIN_STEPS):
            one_backward(model)
            optimizer.step()
            optimizer.zero_grad()
        engine.sync(model)
        saved["trained_synced"] = generator_tensors(engine)
        saved["trained_policy"] = {canonical_name(n): full(p) for n, p in model.named_parameters()}
        saved["vocab_size"] = model.config.vocab_size
    return saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, required=True, help="one folder per model kind")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    results = {}
    for name, scenario in SCENARIOS[dist.get_world_size()].items():
        results[name] = run(name, *scenario, args.models, device)
    save_results(results, args.out)


if __name__ == "__main__":
    main()
