"""TRL 1.16's GRPOTrainer as dtrain.grpo's reference (no dtrain code): TRL's own run on the CPU (fp32,
one process, one micro-batch per optimizer step, the prompts in file order) with its sampling
replaced by FIXED completions, and every step's logged metrics under TRL's names.

What is replaced, and nothing else (docs/grpo.md's appendix has TRL's semantics with line numbers):
- `GRPOTrainer._generate_single_turn`, the method that samples completion ids (grpo_trainer.py:1763),
  returns the given completions' ids instead. A text becomes ids by TRL's generation rule: what a
  generator emits for it is its tokens then EOS, stopped at `max_completion_length` new tokens, so
  `(tokenizer(text, add_special_tokens=False).input_ids + [eos_token_id])[:max_completion_length]`
  (the HF path keeps the tokens up to and including the first EOS, grpo_trainer.py:1880-1889, of at
  most `max_new_tokens=max_completion_length`, :1156; vLLM returns `output.token_ids`, the EOS that
  stopped it included, generation/vllm_generation.py:732). Token ids are taken as given (at most
  `max_completion_length`, no EOS before the last). TRL's prompt tokenization, decoding for the
  reward functions, rewards, advantages, old and reference log-probs, loss and normalisers run as
  they are.
- `shuffle_sequence_dict`, the random permutation of the generation batch before TRL splits it over
  `steps_per_generation` (grpo_trainer.py:1543), optionally: `shuffle="trl"` keeps TRL's own draw
  (recorded in the result), "identity" keeps the generation batch in order (step k of a generation
  takes its rows k·b ... (k+1)·b - 1), or a list gives the permutation of each generation. At one
  step per generation it only reorders the rows of the one micro-batch.

The fixed completions line up with the prompts TRL uses: with `shuffle_dataset=False` its
RepeatSampler (trainer/utils.py:859) walks the records in file order, B = batch·steps_per_generation /
G prompts per generation, each prompt G times in a row, the chunk repeated num_iterations ·
steps_per_generation times, a last partial chunk dropped and the walk restarted each epoch; each
generation's rows are checked against the records that walk names.

The runs are cached on disk under a hash of everything that shapes them (`cached_run`)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from filelock import FileLock

from tests.tolerance import AdamAllowance

Completion = str | list[int]
TIMING = ("step_time", "train_runtime")  # measured times: not part of what a run computes


def completion_ids(
    tokenizer, completion: Completion, eos_token_ids: Sequence[int], max_length: int
) -> list[int]:
    """The ids TRL trains on for one completion: a text as its generator would have emitted it (its
    tokens, then EOS, cut to max_length new tokens: longer ones end truncated, without EOS), ids as
    given. Raises on what no generator emits: an EOS before the last token, an empty or too long list."""
    if isinstance(completion, str):
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = (list(ids) + [tokenizer.eos_token_id])[:max_length]
    else:
        ids = [int(token) for token in completion]
    if not 0 < len(ids) <= max_length:
        raise ValueError(f"completion {completion!r}: {len(ids)} tokens, expected 1 to {max_length}")
    if any(token in eos_token_ids for token in ids[:-1]):
        raise ValueError(f"completion {completion!r}: an EOS before its last token ({ids})")
    return ids


def trl_args(
    steps: int,
    batch: int,
    lr: float,
    num_generations: int,
    max_completion_length: int,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    schedule: str = "cosine",
    warmup_steps: int = 0,
    seed: int = 0,
    accumulation: int = 1,
    **grpo: Any,
):
    """GRPOConfig of the runs dtrain must reproduce: `batch` completions per optimizer step in one
    micro-batch (per_device_train_batch_size; `accumulation` > 1 splits it into that many
    micro-batches, TRL's own multi-micro-batch behaviour, which dtrain does not reproduce where it
    depends on the split: docs/grpo.md), AdamW (fused, dtrain's), clipping,
    `schedule` after `warmup_steps` (dtrain's defaults), the records in file order, fp32 on the CPU,
    no gradient checkpointing (exact either way, slower). `grpo`: GRPOConfig's own keys (beta,
    loss_type, num_iterations, steps_per_generation, epsilon, epsilon_high, delta,
    importance_sampling_level, scale_rewards, mask_truncated_completions, use_bias_correction_kl,
    reward_weights, temperature, router_aux_loss_coef, ...)."""
    from trl import GRPOConfig

    assert batch % accumulation == 0, f"{batch} completions a step in {accumulation} micro-batches"
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        per_device_train_batch_size=batch // accumulation,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type=schedule,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=eps,
        max_grad_norm=max_grad_norm,
        optim="adamw_torch_fused",
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        shuffle_dataset=False,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=seed,
        disable_tqdm=True,
        **grpo,
    )


def _trainer_class():
    """GRPOTrainer with fixed completions: its sampling method returns them, and the rows, rewards
    and advantages of each generation are recorded on the way (read, not changed)."""
    from trl import GRPOTrainer

    class FixedCompletionsGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            generation = len(self.rollouts)
            rows = self.expected_rows(generation)
            for row, index in zip(inputs, rows, strict=True):
                record = self.records[index]
                if any(row.get(key) != value for key, value in record.items()):
                    raise AssertionError(f"generation {generation}: TRL's row {row} is not record {index}")
            given = [self.completions[index][i % self.num_generations] for i, index in enumerate(rows)]
            self.pending = [
                completion_ids(self._tokenizer, completion, self.eos_token_ids, self.max_completion_length)
                for completion in given
            ]
            self.rollouts.append({"step": self.state.global_step + 1, "rows": rows})
            output = super()._generate_and_score_completions(inputs)
            self.rollouts[-1]["advantages"] = output["advantages"].tolist()
            return output

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations):
            assert len(prompt_ids) == len(self.pending) and num_generations == self.num_generations
            self.rollouts[-1]["prompt_ids"] = [list(ids) for ids in prompt_ids]
            self.rollouts[-1]["completion_ids"] = self.pending
            return self.pending, None  # no sampling log-probs: TRL's HF generation path gives none either

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self.rollouts[-1]["completions"] = completions
            self.rollouts[-1]["rewards"] = rewards.tolist()
            return rewards

        def expected_rows(self, generation: int) -> list[int]:
            """The record of each row of a generation: RepeatSampler's walk with shuffle off."""
            prompts = self.args.generation_batch_size // self.num_generations
            chunk = generation % (len(self.records) // prompts)
            return [
                chunk * prompts + i // self.num_generations for i in range(prompts * self.num_generations)
            ]

    return FixedCompletionsGRPOTrainer


def _shuffle(trainer, shuffle: str | list[list[int]], original: Callable):
    """The generation batch's permutation before TRL splits it over steps_per_generation: TRL's own
    draw (its function, the order read back), the identity, or the given one; recorded."""

    def permute(batch: dict) -> dict:
        size = len(next(value for value in batch.values() if value is not None))
        if shuffle == "trl":
            shuffled = original({**batch, "_order": torch.arange(size)})
            order = shuffled.pop("_order")
        else:
            order = (
                torch.arange(size)
                if shuffle == "identity"
                else torch.tensor(shuffle[len(trainer.rollouts) - 1])
            )
            assert sorted(order.tolist()) == list(range(size)), f"not a permutation of {size}: {order}"

            def apply(value):
                if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
                    return value
                return value[order] if isinstance(value, torch.Tensor) else [value[i] for i in order]

            shuffled = {key: apply(value) for key, value in batch.items()}
        rollout = trainer.rollouts[-1]
        rollout["order"] = order.tolist()
        per_step = size // trainer.args.steps_per_generation
        rollout["steps"] = [
            rollout["order"][k * per_step : (k + 1) * per_step] for k in range(size // per_step)
        ]
        return shuffled

    return permute


def peft_saved_name(name: str) -> str:
    """PEFT's parameter name as its adapter file saves it (no adapter name `default`)."""
    return "base_model.model." + name.removeprefix("base_model.model.").replace(".default", "")


def trl_run(
    model_dir: Path,
    records: list[dict],
    reward_funcs: Callable | list[Callable],
    *,
    steps: int,
    batch: int,
    lr: float,
    num_generations: int,
    max_completion_length: int,
    completions: list[list[Completion]] | None = None,
    peft: dict | None = None,
    adapters: dict[str, torch.Tensor] | None = None,
    adapter: Path | None = None,
    shuffle: str | list[list[int]] = "trl",
    weights: bool = False,
    **settings: Any,
) -> dict:
    """TRL's GRPO run on `model_dir` (fp32) and `records` (TRL's prompt-only format: a `prompt`,
    string or chat messages, and any other columns, which reach the reward functions) with fixed
    completions: `completions[i]` the G completions of record i (texts or token ids), or, when None,
    each record's own "completions" (the file engine's format; left out of the dataset). `batch`:
    completions per optimizer step. `peft`: a LoraConfig's keyword arguments (TRL wraps the model,
    its reference is the adapters off); `adapters`: PEFT saved names → initial LoRA weights copied
    into that adapter (every one of its weights); `adapter`: a PEFT adapter folder to start from
    (PeftModel.from_pretrained; TRL's reference is then a frozen copy of it). `shuffle`: the
    generation batch's order before TRL splits it over steps_per_generation ("trl": TRL's own random
    draw; "identity"; or one permutation a generation). `settings`: trl_args' (optimizer, schedule,
    seed, accumulation and GRPOConfig's keys).

    Returns {"metrics": {TRL's logged name: one value a step, None where that step logged none
    (reward metrics are logged only on the steps that generate)}, "history": each step's log
    entry, "rollouts": one entry a generation: step (its first optimizer step, from 1), rows (the
    record of each generation-batch row), prompt_ids, completion_ids, completions (what the reward
    functions got), rewards (a row a completion, a column a function, NaN for None), advantages,
    order (the permutation before the split) and steps (the generation-batch rows of each of its
    micro-batches: one an optimizer step at accumulation 1), "initial" (the trainable weights TRL
    started from, PEFT saved names for adapters: with `peft` or `adapter`), and with `weights`:
    "params" (the trained trainable weights, the same names) and "allowance" (tests/tolerance.py's
    AdamAllowance of each element)}."""
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if completions is None:
        completions = [record["completions"] for record in records]
        records = [
            {key: value for key, value in record.items() if key != "completions"} for record in records
        ]
    assert len(completions) == len(records) and all(len(c) == num_generations for c in completions)
    assert adapters is None or peft is not None, "adapters: the initial weights of the adapter `peft` makes"
    args = trl_args(steps, batch, lr, num_generations, max_completion_length, **settings)
    model: Any = str(model_dir)
    if adapter is not None:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    trainer = _trainer_class()(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **peft) if peft else None,
    )
    trainer.records, trainer.completions, trainer.rollouts = records, completions, []
    named = {
        (peft_saved_name(name) if peft or adapter else name): param
        for name, param in trainer.model.named_parameters()
        if param.requires_grad
    }
    if adapters is not None:
        assert set(adapters) == set(named), sorted(set(adapters) ^ set(named))
        with torch.no_grad():
            for name, tensor in adapters.items():
                named[name].copy_(tensor)
    initial = {name: param.detach().clone() for name, param in named.items()} if peft or adapter else None

    class Allowance(TrainerCallback):
        """AdamAllowance.step() after each optimizer step, before the schedule's step and zero_grad."""

        allowance: AdamAllowance | None = None

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.allowance = self.allowance or AdamAllowance(trainer.optimizer, named)
            self.allowance.step()

    allowance = Allowance()
    if weights:
        trainer.add_callback(allowance)
    permute = _shuffle(trainer, shuffle, grpo_module.shuffle_sequence_dict)
    with mock.patch.object(grpo_module, "shuffle_sequence_dict", permute):
        trainer.train()
    shutil.rmtree(args.output_dir, ignore_errors=True)  # save_strategy="no": nothing of the run's in it
    history = [
        {key: value for key, value in entry.items() if key not in TIMING}
        for entry in trainer.state.log_history
        if "grad_norm" in entry
    ]
    assert len(history) == steps, trainer.state.log_history
    keys = sorted({key for entry in history for key in entry})
    result = {
        "metrics": {key: [entry.get(key) for entry in history] for key in keys},
        "history": history,
        "rollouts": trainer.rollouts,
        "initial": initial,
    }
    if weights:
        result["params"] = {name: param.detach().clone() for name, param in named.items()}
        result["allowance"] = allowance.allowance.allowance()
    return result


def _source(function: Callable) -> str:
    """A reward function as the cache key sees it: its name and source (a partial: its function and
    arguments; a callable object: its class's source and state)."""
    import functools

    if isinstance(function, functools.partial):
        return f"partial({_source(function.func)}, {function.args!r}, {sorted(function.keywords.items())!r})"
    target = function if inspect.isfunction(function) or inspect.ismethod(function) else type(function)
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = repr(target)
    state = "" if target is function else repr(sorted(vars(function).items()))
    return f"{getattr(target, '__qualname__', '')}\n{source}\n{state}"


def _digest(model_dir: Path, inputs: dict) -> str:
    """A hash of everything a run depends on: the model folder's files (and an adapter folder's),
    the records, completions, reward functions' sources, settings and initial adapters, this
    module's and tests/tolerance.py's source, TRL's version, and the CPU kernels and threads."""
    import trl

    hasher = hashlib.sha256()
    folders = [Path(model_dir)] + ([Path(inputs["adapter"])] if inputs.get("adapter") else [])
    for path in sorted(path for folder in folders for path in folder.iterdir()):
        if path.is_file():
            hasher.update(path.name.encode() + path.read_bytes())
    plain = {
        key: value for key, value in inputs.items() if key not in ("reward_funcs", "adapters", "adapter")
    }
    funcs = inputs["reward_funcs"]
    plain["reward_funcs"] = [_source(f) for f in (funcs if isinstance(funcs, list) else [funcs])]
    hasher.update(json.dumps(plain, sort_keys=True, default=str).encode())
    for name, tensor in sorted((inputs.get("adapters") or {}).items()):
        hasher.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    for module in (_digest, AdamAllowance):
        hasher.update(inspect.getsource(inspect.getmodule(module)).encode())
    kernels = torch.backends.cpu.get_cpu_capability(), os.environ.get("MKL_CBWR"), torch.get_num_threads()
    hasher.update(repr((trl.__version__, kernels)).encode())
    return hasher.hexdigest()[:24]


def cached_run(cache_dir: Path, model_dir: Path, records: list[dict], reward_funcs, **kwargs: Any) -> dict:
    """trl_run(model_dir, records, reward_funcs, **kwargs), computed once per cache folder
    (REFERENCE_CACHE, when set, instead of `cache_dir`): stored under a hash of its inputs
    (`_digest`), written atomically under a file lock, so another pytest-xdist worker waits for the
    first one's result instead of computing it again."""
    cache = Path(os.environ.get("REFERENCE_CACHE", cache_dir))
    cache.mkdir(parents=True, exist_ok=True)
    path = (
        cache
        / f"trl-grpo-{_digest(model_dir, {'records': records, 'reward_funcs': reward_funcs, **kwargs})}.pt"
    )
    with FileLock(f"{path}.lock"):
        if path.exists():
            return torch.load(path)
        result = trl_run(model_dir, records, reward_funcs, **kwargs)
        partial = path.with_suffix(".partial")
        torch.save(result, partial)
        os.replace(partial, path)
        return result
