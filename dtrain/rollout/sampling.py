"""The sampling rules every engine shares: which ids end a completion, where a completion stops, and
the seed of each prompt's completions.

- End of a completion (TRL 1.16's GRPOTrainer): the tokenizer's EOS and every EOS id the model's
  generation config declares (an end-of-turn token). A completion is its ids up to and including the
  first of them (terminated), or `max_completion_length` ids without one (truncated): TRL's
  completion mask, `sequence_indices <= eos_idx`, kept as the ids themselves.
- Seeds: a prompt's completions are drawn from a seed of (the run's seed, the generation's count,
  the prompt's index in the data), so that they do not depend on the mesh, on which rank samples
  them or on the other prompts sampled beside them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformers import GenerationConfig, PretrainedConfig

from dtrain.rollout import Completion


def eos_token_ids(
    tokenizer_eos: int | None, model_config: PretrainedConfig, folder: str | None = None
) -> list[int]:
    """The ids that end a completion, as TRL 1.16 collects them: the model's generation config's
    `eos_token_id` (its folder's generation_config.json where there is one, else the model config's),
    with the tokenizer's EOS first when it is not among them."""
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        declared = GenerationConfig.from_pretrained(folder).eos_token_id
    else:
        declared = GenerationConfig.from_model_config(model_config).eos_token_id
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids = [tokenizer_eos, *ids]
    if not ids:
        raise ValueError("no EOS id: neither the tokenizer nor the model's generation config declares one")
    return ids


def cut(ids: list[int], eos: list[int], logprobs: list[float] | None = None) -> Completion:
    """A sampled sequence as a completion: up to and including its first EOS id (terminated), or all
    of it without one (truncated: the sampler stopped at max_completion_length); `logprobs`, one per
    sampled id, cut alike."""
    stops = set(eos)
    end = next((i + 1 for i, token in enumerate(ids) if token in stops), None)
    kept = ids if end is None else ids[:end]
    return Completion(
        ids=list(kept),
        truncated=end is None,
        logprobs=None if logprobs is None else list(logprobs[: len(kept)]),
    )


def completion_seed(seed: int, generation: int, index: int, completion: int | None = None) -> int:
    """The seed of prompt `index`'s completions in generation `generation` of a run seeded `seed`
    (of its completion number `completion` alone, for an engine that seeds each one): the first 8
    bytes, little-endian, of the SHA-256 of `"{seed}/{generation}/{index}"` (`.../{completion}`),
    its top bit cleared (a non-negative int64, which every sampler takes)."""
    key = f"{seed}/{generation}/{index}" + ("" if completion is None else f"/{completion}")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)
