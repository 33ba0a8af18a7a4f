"""The `hf` rollout engine (rollout.engine=hf, the default; CPU and GPU): transformers' `generate` on a
plain copy of the policy.

Each rank holds the policy as a plain transformers model (no DTensor, unsharded, in the compute dtype
of train.precision, on the rank's device), built once on the meta device and filled by `sync`, one
HF parameter at a time (dtrain/rollout/weights.py). `generate` samples each of this rank's prompts'
G completions in one `generate` call of G copies of the prompt, under a forked RNG seeded from (the
run's seed, the generation, the prompt's index) (dtrain/rollout/sampling.py): a prompt's completions
are the same whichever rank samples them, whichever other prompts that rank has, on any mesh.
Settings are TRL 1.16's GRPOTrainer's (`do_sample`, temperature, top_p, top_k with 0 = none, min_p,
repetition_penalty, `max_new_tokens` = max_completion_length, every EOS id stopping), with the KV
cache on. The generator's log-probs are not returned: the objective computes the policy's own.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from dtrain.config import SamplingConfig
from dtrain.model import allocate, plain_config
from dtrain.rollout import Completion, Prompt
from dtrain.rollout.sampling import completion_seed, cut
from dtrain.rollout.weights import hf_weights


def generation_config(sampling: SamplingConfig, eos: list[int], pad_token_id: int | None) -> GenerationConfig:
    """transformers' settings for sampling as TRL 1.16's GRPOTrainer samples without vLLM."""
    return GenerationConfig(
        max_new_tokens=sampling.max_completion_length,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        eos_token_id=eos,
        pad_token_id=eos[0] if pad_token_id is None else pad_token_id,
        use_cache=True,
        disable_compile=True,
    )


def build_generator(model_config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The policy's architecture as a plain transformers model on `device` in `dtype`, allocated but
    not filled (`HFEngine.sync` fills it); eval mode, no gradients."""
    config = plain_config(model_config)
    with torch.device("meta"):
        generator = AutoModelForCausalLM.from_config(config, dtype=dtype)
    allocate(generator, device)  # the rotary buffers, which no sync carries, computed as in training
    generator.tie_weights()  # to_empty gives tied parameters one storage each: one again
    generator.requires_grad_(False)
    return generator.eval()


class HFEngine:
    """rollout.engine=hf (the module docstring). `model_config`: the policy's config (its `model.config`;
    dtrain's attention and experts settings are dropped); `eos_token_ids`: sampling.eos_token_ids;
    `dtype`: the compute dtype (train.precision)."""

    def __init__(
        self,
        model_config: PretrainedConfig,
        sampling: SamplingConfig,
        seed: int,
        eos_token_ids: list[int],
        pad_token_id: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.sampling, self.seed, self.eos = sampling, seed, list(eos_token_ids)
        self.dtype, self.device = dtype, device
        self.generator = build_generator(model_config, dtype, device)
        self.config = generation_config(sampling, self.eos, pad_token_id)
        self.generator.generation_config = self.config
        self.synced = False

    @torch.no_grad()
    def sync(self, model: nn.Module) -> None:
        """Collective: the policy's weights copied into the generator, a parameter at a time; every
        generator weight must arrive (the tied lm_head with its embedding)."""
        targets = self.generator.state_dict(keep_vars=True)
        if self.generator.config.tie_word_embeddings:
            targets.pop("lm_head.weight", None)
        arrived = set()
        for name, tensor in hf_weights(model, self.dtype):
            if name not in targets:
                raise RuntimeError(f"rollout sync: the policy's {name} has no place in the generator")
            targets[name].copy_(tensor)
            arrived.add(name)
        missing = sorted(set(targets) - arrived)
        if missing:
            raise RuntimeError(f"rollout sync: the policy sent no {', '.join(missing)}")
        self.synced = True

    @torch.inference_mode()
    def generate(self, prompts: list[Prompt], generation: int) -> list[list[Completion]]:
        """Each prompt's num_generations completions (see the module docstring)."""
        if not self.synced:
            raise RuntimeError("rollout: generate before the first sync(model)")
        return [self.complete(prompt, generation) for prompt in prompts]

    def complete(self, prompt: Prompt, generation: int) -> list[Completion]:
        """One prompt's completions: G copies of it sampled in one call, from the prompt's own seed."""
        count = self.sampling.num_generations
        ids = torch.tensor([prompt.ids] * count, dtype=torch.long, device=self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(completion_seed(self.seed, generation, prompt.index))
            out = self.generator.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=self.config
            )
        sampled = out[:, ids.shape[1] :].tolist()
        del out, ids
        return [cut(row, self.eos) for row in sampled]
