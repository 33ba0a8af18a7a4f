"""The `vllm` rollout engine (rollout.engine=vllm; GPUs, the optional `dtrain[vllm]` extra): vLLM
colocated with the trainer, as TRL 1.16's GRPOTrainer runs it with `vllm_mode="colocate"`.

- Each rank builds a `vllm.LLM` in its own process (`distributed_executor_backend="external_launcher"`,
  on the process group dtrain already has), with `rollout.vllm_gpu_memory_utilization` of the GPU,
  `rollout.vllm_tensor_parallel_size` ranks (consecutive ones: dtrain's tp ranks first) to each copy,
  `logprobs_mode="processed_logprobs"` (the log-probs of the distribution sampled from: after the
  temperature, as the importance-sampling correction needs them) and, with
  `rollout.vllm_enable_sleep_mode`, sleep mode. Its folder holds only the policy's config.json (no
  weights: `load_format="dummy"`, no tokenizer: prompts go in as ids), so any policy (a hub model, a
  from-scratch config, LoRA, a padded vocabulary) builds the same way.
- `sync(model)`: the policy's weights (dtrain/rollout/weights.py: whole, LoRA merged, padding dropped)
  under the names of the model's checkpoint files (transformers' own reverse conversions, as
  `save_pretrained` writes them: a MoE's experts one tensor per expert), pushed to vLLM's
  `load_weights` one tensor at a time, then the prefix cache reset. In sleep mode the weights are
  woken first; `generate` wakes the KV cache and puts vLLM back to sleep at level 2 after it,
  which discards the weights: sync before every generate (a generate without one is refused).
- `generate`: each completion is its own request (n=1) with its own seed
  (sampling.completion_seed(seed, generation, prompt index, completion number)), stopping at the
  same EOS ids as the `hf` engine; the ranks of a vLLM tensor-parallel group sample all of the
  group's prompts and each keeps its own. `Completion.logprobs`: vLLM's log-prob of each sampled id.

`check(settings)` is what the objective's checks call before launch. The weight-sync logic is tested
on the CPU against a recording stand-in for `vllm.LLM` (tests/workers/rollout_runs.py); the real
engine runs in bench/gpu_rollout_check.py on a GPU.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from dtrain.config import ConfigError, RolloutConfig, SamplingConfig
from dtrain.model import plain_config, save_config
from dtrain.rollout import Completion, Prompt
from dtrain.rollout.sampling import completion_seed, cut
from dtrain.rollout.weights import hf_weights

INSTALL = "pip install 'dtrain[vllm]'"


def check(settings: RolloutConfig, world_size: int | None = None) -> None:
    """rollout.engine=vllm's checks before launch (ConfigError: one line naming the key): vLLM
    importable, a CUDA device, and its tensor-parallel size dividing the world. Nothing for other
    engines."""
    if settings.engine != "vllm":
        return
    try:
        importlib.import_module("vllm")
    except Exception as error:  # not installed, or installed against another torch: either way unusable
        raise ConfigError(
            f"rollout.engine=vllm: vLLM cannot be imported ({type(error).__name__}: {error}); "
            f"install it with `{INSTALL}`, or use rollout.engine=hf"
        ) from None
    if not torch.cuda.is_available():
        raise ConfigError(
            "rollout.engine=vllm: no CUDA device; vLLM generates on GPUs (rollout.engine=hf runs on the CPU)"
        )
    if not 0 < settings.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(
            f"rollout.vllm_gpu_memory_utilization={settings.vllm_gpu_memory_utilization}: must be in (0, 1]"
        )
    size = settings.vllm_tensor_parallel_size
    if size < 1 or (world_size is not None and world_size % size):
        raise ConfigError(
            f"rollout.vllm_tensor_parallel_size={size}: must be >= 1 and divide the world size {world_size}"
        )


def checkpoint_weights(
    model: nn.Module, dtype: torch.dtype, reference: nn.Module
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective. `hf_weights` under the names of the model's checkpoint files: each tensor through
    transformers' reverse conversions (`revert_weight_conversion`, which `save_pretrained` applies;
    `reference`: the policy's architecture as a plain transformers model, on the meta device). One
    in-memory tensor may give several (stacked experts: one per expert), views of it."""
    for name, tensor in hf_weights(model, dtype):
        yield from revert_weight_conversion(reference, {name: tensor}).items()
        del tensor


def meta_reference(model_config: PretrainedConfig) -> nn.Module:
    """The policy's architecture as transformers builds it, on the meta device (no memory): what
    `revert_weight_conversion` reads the family's conversions from."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(plain_config(model_config))


def write_model_folder(model_config: PretrainedConfig, folder: Path, dtype: torch.dtype) -> None:
    """Collective. The folder vLLM builds from: the policy's config.json, written by rank 0."""
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_config(model_config, folder, dtype)
    dist.barrier()


class VLLMEngine:
    """rollout.engine=vllm (the module docstring). Collective to build (every rank). `folder`: where
    the config vLLM builds from is written (in the run folder); `max_model_len`: the longest prompt
    plus max_completion_length; `llm` and `sampling_params`: stand-ins for `vllm.LLM` (built here when
    None) and `vllm.SamplingParams` (tests)."""

    def __init__(
        self,
        settings: RolloutConfig,
        sampling: SamplingConfig,
        seed: int,
        model_config: PretrainedConfig,
        eos_token_ids: list[int],
        dtype: torch.dtype,
        max_model_len: int,
        folder: Path,
        llm: Any = None,
        sampling_params: Callable[..., Any] | None = None,
    ) -> None:
        self.settings, self.sampling, self.seed, self.dtype = settings, sampling, seed, dtype
        self.eos = list(eos_token_ids)
        self.sleeping = settings.vllm_enable_sleep_mode
        self.synced = False
        self.reference = meta_reference(model_config)
        size = settings.vllm_tensor_parallel_size
        self.group = None
        if size > 1:  # consecutive ranks, as TRL groups them; a collective, on every rank
            world = dist.get_world_size()
            ranks = [list(range(start, start + size)) for start in range(0, world, size)]
            self.group, _ = dist.new_subgroups_by_enumeration(ranks)
        if llm is None:
            write_model_folder(model_config, folder, dtype)
            llm, sampling_params = build_llm(settings, folder, dtype, max_model_len)
        self.llm, self.sampling_params = llm, sampling_params
        if self.sleeping:
            self.llm.sleep(level=2)
        dist.barrier()  # every rank's vLLM is up before any rank goes on (TRL waits alike)

    def runner_model(self) -> Any:
        """vLLM's model in this process (external_launcher: the worker is this process)."""
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    @torch.no_grad()
    def sync(self, model: nn.Module) -> None:
        """Collective: the policy's weights pushed to vLLM one tensor at a time (the module docstring)."""
        if self.sleeping:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # room for the weights vLLM wakes
            self.llm.wake_up(tags=["weights"])
        target = self.runner_model()
        for name, tensor in checkpoint_weights(model, self.dtype, self.reference):
            target.load_weights([(name, tensor)])
            del tensor
        self.llm.reset_prefix_cache()
        self.synced = True

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], generation: int) -> list[list[Completion]]:
        """Each prompt's num_generations completions with vLLM's log-probs (the module docstring)."""
        if not self.synced:
            raise RuntimeError("rollout: vLLM has no current weights: sync(model) before each generate")
        count = self.sampling.num_generations
        shares = self.shares([(prompt.index, list(prompt.ids)) for prompt in prompts])
        first = sum(len(share) for share in shares[: self.group_rank()]) * count  # this rank's first output
        requests = [(index, ids, j) for share in shares for index, ids in share for j in range(count)]
        params = [self.params(completion_seed(self.seed, generation, index, j)) for index, _, j in requests]
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for _, ids, _ in requests], sampling_params=params, use_tqdm=False
        )
        if self.sleeping:
            self.llm.sleep(level=2)  # discards the weights: the next generate needs a sync first
            self.synced = False
        completions = [self.completion(output) for output in outputs[first : first + len(prompts) * count]]
        return [completions[i * count : (i + 1) * count] for i in range(len(prompts))]

    def shares(self, mine: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
        """The prompts (index, ids) of each rank of this rank's vLLM group, in group rank order: the
        group's ranks sample all of them alike (just this rank's at vllm_tensor_parallel_size=1)."""
        if self.group is None:
            return [mine]
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        return gathered

    def group_rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def params(self, seed: int) -> Any:
        """vLLM's sampling settings of one completion: TRL 1.16's colocate ones, with its own seed and
        the hf engine's EOS ids."""
        sampling = self.sampling
        return self.sampling_params(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=0.0 if sampling.min_p is None else sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            max_tokens=sampling.max_completion_length,
            logprobs=0,  # the sampled id's own log-prob only
            seed=seed,
            stop_token_ids=self.eos,
            detokenize=False,  # no tokenizer: ids in, ids out
        )

    def completion(self, output: Any) -> Completion:
        """A vLLM RequestOutput as a Completion: its ids cut at the first EOS, each id's log-prob."""
        sample = output.outputs[0]
        ids = list(sample.token_ids)
        logprobs = [float(entry[token].logprob) for entry, token in zip(sample.logprobs, ids, strict=True)]
        return cut(ids, self.eos, logprobs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_llm(
    settings: RolloutConfig, folder: Path, dtype: torch.dtype, max_model_len: int
) -> tuple[Any, Callable[..., Any]]:
    """`vllm.LLM` colocated on this rank as TRL 1.16 builds it (and `vllm.SamplingParams`)."""
    import vllm

    rank, world = dist.get_rank(), dist.get_world_size()
    # vLLM's external launcher reads torchrun's variables; a one-process `python` run has none
    for key, value in (
        ("RANK", rank),
        ("LOCAL_RANK", rank % torch.cuda.device_count()),
        ("WORLD_SIZE", world),
    ):
        os.environ.setdefault(key, str(value))
    if "MASTER_ADDR" not in os.environ and world == 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    size = settings.vllm_tensor_parallel_size
    llm = vllm.LLM(
        model=str(folder),
        load_format="dummy",  # the weights come from sync
        skip_tokenizer_init=True,
        dtype=dtype,
        tensor_parallel_size=size,
        gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
        max_model_len=max_model_len,
        enable_sleep_mode=settings.vllm_enable_sleep_mode,
        distributed_executor_backend="external_launcher",
        seed=rank // size,  # the same on a group's ranks; each request has its own seed anyway
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
    )
    return llm, vllm.SamplingParams
