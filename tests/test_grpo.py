"""dtrain.grpo against TRL 1.16's GRPOTrainer (tests/grpo_reference.py: no dtrain code) on fixed
completions: the same prompts and completions (TRL's generation replaced by them, dtrain's file engine
reading them), the same reward functions, the same training run (fp32, TRL with one micro-batch
holding the whole step on one process). On 1×1: dapo, bnpo, grpo and dr_grpo, β 0 and 0.04, μ = 2, GSPO
with clip-higher and δ, scale_rewards none and batch, mask_truncated_completions, packed rows, two steps
a generation, LoRA (TRL's reference: the adapters off), the tiny Qwen3-MoE with its aux loss; on 4
ranks: tp 2 × dp 2 with accumulation 2 (the done-when case: dapo, β 0.04), cp 2 × tp 2 on packed rows
(GSPO, μ = 2, β 0.04), dp_replicate 2 × dp_shard 2 with two steps a generation, LoRA at tp 2 × dp 2,
the MoE at ep 2 × tp 2, and a dp_shard 4 run stopped in the middle of a generation and resumed at
tp 2 × dp 2. The mesh runs are one launch per world size (tests/workers/grpo_runs.py); TRL's runs are
computed once and cached.

The error model (tests/tolerance.py): each step's loss, grad norm, aux loss and entropy at RTOL of
TRL's, plus the noise of what a value near zero is summed from: the loss at ratio 1 is a sum of
±advantages that cancels (its noise RTOL × the mean |advantage|); kl is a mean of k3 terms, each
moving by |ref − logp| ≈ sqrt(2·k3) per unit of a log-prob's noise RTOL·|logp| (|logp| about the
entropy at these sizes). Rewards, reward_std, each function's mean and std, frac_reward_zero_std and
the length metrics exactly: the same float32 operations on the same rewards, groups whole on every
rank.

Two steps a generation: TRL shuffles its generation batch with its process's RNG; dtrain with a seeded
permutation of its own, which TRL is given here (`permutation` writes the documented rule out). There
TRL's dapo divides by the generation's tokens / 2 (the average step), dtrain's by the step's own
tokens, which is TRL's bnpo at one micro-batch a step: dtrain's dapo is compared with TRL's bnpo.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.dpo_reference import write_jsonl
from tests.grpo_reference import cached_run
from tests.helpers import TOKENIZER, run, run_worker, save_tiny_llama, save_tiny_moe
from tests.test_grpo_reference import COMPLETIONS, FUNCS, RECORDS, reference_cache_dir
from tests.tolerance import RTOL, assert_close
from tests.workers.grpo_runs import G, GLOBAL_BATCH, LR, MAX_COMPLETION, SCENARIOS, STEPS, WEIGHTS

# Four prompts, two a generation at one step a generation: the file twice in three steps, no prompt left
# over at an epoch's end (TRL drops a partial last chunk each epoch; dtrain's stream goes on across
# epochs).
PROMPTS = RECORDS[:4]
GIVEN = COMPLETIONS[:4]
EXACT = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length")
EXACT += ("completions/min_length", "completions/clipped_ratio", "completions/mean_terminated_length")
EXACT += tuple(f"rewards/{f.__name__}/{stat}" for f in FUNCS for stat in ("mean", "std"))
CLOSE = ("loss", "grad_norm", "kl", "aux_loss", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean")
CLOSE += ("clip_ratio/region_mean",)
ALL = {**SCENARIOS[1], **SCENARIOS[4]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    lines = [{"prompt": r["prompt"], "completions": c} for r, c in zip(PROMPTS, GIVEN, strict=True)]
    return {
        "llama": save_tiny_llama(root / "llama", tied=False),
        "moe": save_tiny_moe(root / "moe"),
        "data": write_jsonl(root / "prompts.jsonl", PROMPTS),
        "completions": write_jsonl(root / "completions.jsonl", lines),
    }


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_runs")
    args = ["--out", str(out)]
    for name in ("llama", "moe", "data", "completions"):
        args += [f"--{name}", str(inputs[name])]
    # while developing: DTRAIN_GRPO_ONLY=1x1_dapo_kl,resumed runs only those (the other tests then fail)
    only = os.environ.get("DTRAIN_GRPO_ONLY", "")
    for nproc in (1, 4):
        if only and not set(only.split(",")) & set(SCENARIOS[nproc]):
            continue
        result = run_worker(nproc, "grpo_runs", *args, "--only", only, timeout=900)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


TRL_KEYS = ("beta", "loss_type", "num_iterations", "importance_sampling_level", "epsilon_high", "delta")
TRL_KEYS += ("scale_rewards", "mask_truncated_completions", "steps_per_generation")
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def permutation(size: int, seed: int, generation: int) -> list[int]:
    """docs/grpo.md's rule for the order a generation of several steps is cut in, written out."""
    return torch.randperm(
        size, generator=torch.Generator().manual_seed(seed * 1_000_003 + generation)
    ).tolist()


def trl_settings(overrides: dict) -> dict:
    """GRPOConfig's keywords of a scenario (two steps a generation: TRL's bnpo is dtrain's dapo, and
    TRL takes dtrain's permutation of each generation)."""
    settings = {key: overrides[f"grpo.{key}"] for key in TRL_KEYS if f"grpo.{key}" in overrides}
    spg = settings.get("steps_per_generation", 1)
    settings["shuffle"] = "identity"
    if spg > 1:
        size = GLOBAL_BATCH * spg
        generations = -(-STEPS // (spg * settings.get("num_iterations", 1)))
        settings["shuffle"] = [permutation(size, 0, g) for g in range(generations)]
        if settings.get("loss_type", "dapo") == "dapo":
            settings["loss_type"] = "bnpo"
    return settings


def reference(inputs, runs, name: str, cache: Path) -> dict:
    """TRL's run of the scenario `name`: its model and settings; LoRA from dtrain's initial adapters."""
    model, overrides = ALL[name]
    peft = adapters = None
    if "lora.r" in overrides:
        peft = dict(r=overrides["lora.r"], lora_alpha=overrides["lora.alpha"], target_modules=ALL_PROJECTIONS)
        adapters = runs[name]["adapters"]
    return cached_run(
        cache,
        inputs[model],
        PROMPTS,
        FUNCS,
        completions=GIVEN,
        steps=STEPS,
        batch=GLOBAL_BATCH,
        lr=overrides.get("optim.lr", LR),
        num_generations=G,
        max_completion_length=MAX_COMPLETION,
        reward_weights=WEIGHTS,
        peft=peft,
        adapters=adapters,
        **trl_settings(overrides),
    )


def noise(key: str, expected: dict, step: int, advantages: list[float]) -> float:
    """The absolute part of the error model for `key` at `step` (the module's docstring)."""
    if key == "loss":
        return RTOL * sum(abs(a) for a in advantages) / len(advantages)
    if key == "kl":
        kl, entropy = expected["kl"][step], expected["entropy"][step]
        return RTOL * entropy * math.sqrt(2 * max(kl, 0.0))
    return 0.0


def assert_step_matches(record: dict, expected: dict, step: int, advantages: list[float], what: str) -> None:
    """One step: CLOSE at the error model's tolerance, EXACT exactly (None where TRL logged none: reward
    metrics exist on the steps that generate)."""
    for key in CLOSE:
        want = expected.get(key, [None] * (step + 1))[step]
        if want is None:
            assert record.get(key) is None, f"{what} step {step + 1}: {key} {record.get(key)}, TRL none"
            continue
        assert_close(
            torch.tensor(record[key], dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            noise(key, expected, step, advantages),
            f"{what} step {step + 1} {key}",
        )
    for key in EXACT:
        assert record.get(key) == expected[key][step], f"{what} step {step + 1} {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALL))
def test_every_step_matches_trl(inputs, runs, tmp_path_factory, name):
    """Every step's loss, grad norm and kl within the error model of TRL's, its rewards and length
    metrics exactly; TRL's curve moves (not a vacuous match); the rollouts.jsonl written holds TRL's
    completions and advantages, each generation once (the resumed run's too)."""
    ref = reference(inputs, runs, name, reference_cache_dir(tmp_path_factory))
    history = runs[name]["history"]
    assert [record["step"] for record in history] == list(range(1, STEPS + 1))
    grads = ref["metrics"]["grad_norm"]
    assert max(abs(g - grads[0]) for g in grads) > 1e-3 * grads[0], grads
    written = runs[name]["rollouts"]
    assert [line["step"] for line in written] == [r["step"] for r in ref["rollouts"] for _ in r["rows"][::G]]
    for rollout in ref["rollouts"]:
        lines = [line for line in written if line["step"] == rollout["step"]]
        assert [ids for line in lines for ids in line["completions"]] == rollout["completion_ids"], name
        assert [a for line in lines for a in line["advantages"]] == rollout["advantages"], name
    for step, record in enumerate(history):
        generation = max((r for r in ref["rollouts"] if r["step"] <= step + 1), key=lambda r: r["step"])
        assert_step_matches(record, ref["metrics"], step, generation["advantages"], name)


# --- the rollouts file and the file engine ------------------------------------------------------------


@pytest.mark.slow
def test_a_runs_rollouts_replay_it(inputs, runs, tmp_path):
    """rollouts.jsonl is in the file engine's format: a run on it (dtrain.grpo's command line, one
    process) logs the same curve as the run that wrote it (dtrain against dtrain: the same completions
    must give the same run, whose own curve is TRL's above)."""
    source = runs["1x1_dapo_kl"]
    replay = tmp_path / "rollouts.jsonl"
    write_jsonl(replay, source["rollouts"])
    overrides = dict(ALL["1x1_dapo_kl"][1])
    command = [f"model.name_or_path={inputs['llama']}", f"data.path={inputs['data']}"]
    command += [f"rollout.path={replay}", f"hydra.run.dir={tmp_path / 'run'}", "train.precision=fp32"]
    command += grpo_command(overrides)
    result = run(one_process("dtrain.grpo", command), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    replayed = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record, original in zip(replayed, source["history"], strict=True):
        for key in ("loss", "grad_norm"):
            assert_close(torch.tensor(record[key]), torch.tensor(original[key]), 0.0, f"replayed {key}")


def grpo_command(overrides: dict) -> list[str]:
    """The worker's base settings and `overrides` as command-line overrides."""
    from tests.workers.grpo_runs import BASE

    items = {**BASE, **overrides}
    items.pop("rollout.path", None)
    return [
        f"{key}={json.dumps(value) if isinstance(value, list) else value}" for key, value in items.items()
    ]


def one_process(module: str, args: list[str]) -> list[str]:
    import sys

    return [sys.executable, "-m", module, *args]


TOKENIZER_DIR = TOKENIZER
