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
from tests.workers.grpo_runs import GLOBAL_BATCH, LR, MAX_COMPLETION, SCENARIOS, STEPS, WEIGHTS, G

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
HF = ("1x1_hf", "tp2_dp2_hf", "hf_resumed")  # sampled by transformers' generate: TRL cannot take them
COMPARED = sorted(set(ALL) - set(HF))


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
@pytest.mark.parametrize("name", COMPARED)
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


@pytest.mark.slow
def test_the_hf_engine_samples_the_same_completions_on_every_mesh(runs):
    """rollout.engine=hf (transformers' generate on the policy, each prompt's completions seeded by the
    run's seed, the generation and the prompt): 1×1, tp 2 × dp 2, and dp_shard 4 resumed at tp 2 × dp 2
    in the middle of a generation give the same completions at every generation (the second sampled
    from the policy two steps on), and the same curve within the error model. dtrain against dtrain:
    TRL cannot sample dtrain's completions; the curve of given completions is TRL's above."""
    whole = runs["1x1_hf"]
    assert len({line["generation"] for line in whole["rollouts"]}) == 2
    for name in HF[1:]:
        assert [line["completions"] for line in runs[name]["rollouts"]] == [
            line["completions"] for line in whole["rollouts"]
        ], name
        for step, (record, expected) in enumerate(zip(runs[name]["history"], whole["history"], strict=True)):
            for key in ("loss", "grad_norm", "kl"):
                advantages = [a for line in whole["rollouts"] for a in line["advantages"]]
                expected_metrics = {k: [r.get(k) for r in whole["history"]] for k in ("kl", "entropy")}
                atol = noise(key, expected_metrics, step, advantages)
                assert_close(
                    torch.tensor(record[key]),
                    torch.tensor(expected[key]),
                    atol,
                    f"{name} step {step + 1} {key}",
                )


# --- the command line: a replay, and bad inputs ------------------------------------------------------


def raising_reward(prompts, completions, completion_ids, target, **kwargs):
    """Raises on one example's completions (data example 1: target 4)."""
    if 4 in target:
        raise ValueError("no reward for a target of 4")
    return [0.0] * len(completions)


def short_reward(prompts, completions, completion_ids, **kwargs):
    return [0.0] * (len(completions) - 1)


def rank_one_reward(prompts, completions, completion_ids, **kwargs):
    """Raises on rank 1 alone: the others must not wait for it."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1's reward server is down")
    return [0.0] * len(completions)


EXPECTED_RANK_ONE = (
    "step 1: rank 1: grpo.reward_funcs[0]=tests.test_grpo:rank_one_reward raised RuntimeError: rank 1's "
    "reward server is down (data example 1)"
)


def base_command(inputs, folder: Path, overrides: dict) -> list[str]:
    """dtrain.grpo's command line for the worker's base settings, `overrides` on top."""
    from tests.workers.grpo_runs import BASE

    items = {**BASE, "rollout.path": str(inputs["completions"]), **overrides}
    args = [f"model.name_or_path={inputs['llama']}", f"data.path={inputs['data']}", f"hydra.run.dir={folder}"]
    args += ["train.precision=fp32", "checkpoint.save_final=false"]
    return args + [
        f"{key}={json.dumps(v) if isinstance(v, list) or v is None else v}" for key, v in items.items()
    ]


def funcs(*names: str) -> list[str]:
    return [f"tests.test_grpo:{name}" for name in names]


BAD = {
    "missing_module": (
        {"grpo.reward_funcs": ["no_such_module:reward"], "grpo.reward_weights": None},
        "grpo.reward_funcs[0]=no_such_module:reward: cannot import 'no_such_module'",
    ),
    "missing_function": (
        {"grpo.reward_funcs": funcs("nowhere"), "grpo.reward_weights": None},
        "module 'tests.test_grpo' has no function 'nowhere'",
    ),
    "raises": (
        {"grpo.reward_funcs": funcs("raising_reward"), "grpo.reward_weights": None},
        "grpo.reward_funcs[0]=tests.test_grpo:raising_reward raised ValueError: no reward for a target of 4 "
        "(data example 1)",
    ),
    "wrong_count": (
        {"grpo.reward_funcs": funcs("short_reward"), "grpo.reward_weights": None},
        "returned 7 rewards for 8 completions",
    ),
    "group_not_dividing": (
        {"train.global_batch_size": 6, "train.micro_batch_size": 6},
        "train.global_batch_size=6 (completions) is not a multiple of grpo.num_generations=4",
    ),
    "group_of_one": ({"grpo.num_generations": 1}, "grpo.num_generations=1: must be >= 2"),
    "prompt_too_long": ({"data.max_len": 8}, "do not fit data.max_len=8"),
    "vllm_on_cpu": ({"rollout.engine": "vllm"}, "rollout.engine=vllm"),
    "file_mismatch": ({"rollout.path": "SHUFFLED"}, "is not the run's prompt 0"),
    "file_count": ({"rollout.path": "SHORT"}, ":2: 3 completions; grpo.num_generations=4 a prompt"),
}


@pytest.fixture(scope="module")
def command_lines(inputs, runs, tmp_path_factory):
    """One interpreter (tests/workers/cli_many): the replay of 1x1_dapo_kl's rollouts.jsonl, then each
    bad input, `python -m dtrain.grpo` each."""
    from tests.helpers import one_interpreter_command

    folder = tmp_path_factory.mktemp("grpo_cli")
    lines = [json.loads(line) for line in inputs["completions"].read_text().splitlines()]
    files = {
        "SHUFFLED": write_jsonl(folder / "shuffled.jsonl", lines[1:] + lines[:1]),
        "SHORT": write_jsonl(
            folder / "short.jsonl", [lines[0], {**lines[1], "completions": lines[1]["completions"][:3]}]
        ),
        "REPLAY": write_jsonl(folder / "replay.jsonl", runs["1x1_dapo_kl"]["rollouts"]),
    }
    settings = {"replay": {**ALL["1x1_dapo_kl"][1], "rollout.path": files["REPLAY"]}}
    for name, (overrides, _) in BAD.items():
        settings[name] = {
            key: files.get(value, value) if key == "rollout.path" else value
            for key, value in overrides.items()
        }
    commands = {name: base_command(inputs, folder / name, overrides) for name, overrides in settings.items()}
    env = {
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29571",
    }
    result = run(
        one_interpreter_command(
            folder / "cli", commands, module="dtrain.grpo", envs=dict.fromkeys(commands, env)
        ),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return folder, json.loads((folder / "cli" / "out.json").read_text())


@pytest.mark.slow
def test_a_runs_rollouts_replay_it(command_lines, runs):
    """rollouts.jsonl is in the file engine's format: a run on it logs the same curve as the run that
    wrote it (dtrain against dtrain: the same completions must give the same run, whose own curve is
    TRL's above)."""
    folder, outcomes = command_lines
    assert outcomes["replay"]["returncode"] == 0, outcomes["replay"]["output"][-3000:]
    replayed = [json.loads(line) for line in (folder / "replay" / "metrics.jsonl").read_text().splitlines()]
    original = runs["1x1_dapo_kl"]["history"]
    assert len(replayed) == len(original) == STEPS
    for record, source in zip(replayed, original, strict=True):
        for key in ("loss", "grad_norm", "reward"):
            assert_close(torch.tensor(record[key]), torch.tensor(source[key]), 0.0, f"replayed {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD)
def test_bad_input_fails_with_one_line_and_exit_code_2(command_lines, name):
    """Each: the one-line message naming what is wrong (the function and the example, the key, the
    file and line), exit code 2."""
    _, outcomes = command_lines
    outcome, message = outcomes[name], BAD[name][1]
    errors = [line for line in outcome["stderr"].splitlines() if line.startswith("dtrain: error:")]
    assert outcome["returncode"] == 2, (name, outcome["output"][-3000:])
    assert len(errors) == 1 and message in errors[0], (name, errors)


@pytest.mark.slow
def test_a_reward_that_fails_on_one_rank_stops_every_rank(inputs, tmp_path):
    """Two ranks, the reward function raising on rank 1 only: every rank stops with the same one line
    naming rank 1, exit code 2, none left waiting in a collective (the launch's timeout would fail)."""
    from tests.helpers import forked_command

    overrides = {"grpo.reward_funcs": funcs("rank_one_reward"), "grpo.reward_weights": None}
    result = run(
        forked_command(2, "dtrain.grpo", *base_command(inputs, tmp_path / "run", overrides)), timeout=300
    )
    errors = [line for line in result.stdout.splitlines() if line.startswith("dtrain: error:")]
    assert result.returncode == 2, result.stdout[-3000:]
    assert len(errors) == 1 and EXPECTED_RANK_ONE in errors[0], errors


# --- the pieces, against TRL's own -----------------------------------------------------------------------


def test_the_file_engine_reads_texts_by_trls_rule(tmp_path):
    """A text completion becomes the ids TRL trains on (tests/grpo_reference.completion_ids: its tokens,
    then EOS, cut at max_completion_length), truncated exactly where no EOS ends it; ids are taken as
    they are; line n answers the n-th prompt drawn, the file read again when it ends."""
    from transformers import AutoTokenizer

    from dtrain.rollout import Prompt
    from dtrain.rollout.file import FileEngine
    from tests.grpo_reference import completion_ids

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    lines = [{"prompt": r["prompt"], "completions": c} for r, c in zip(PROMPTS, GIVEN, strict=True)]
    path = write_jsonl(tmp_path / "completions.jsonl", lines)
    engine = FileEngine(path, tokenizer, G, MAX_COMPLETION, [1], per_generation=2, first=1)
    prompts = [
        Prompt(index=3, ids=[], record=PROMPTS[3]["prompt"])
    ]  # generation 1: prompts 2, 3; this rank's 3
    (completions,) = engine.generate(prompts, generation=1)
    for completion, given in zip(completions, GIVEN[3], strict=True):
        assert completion.ids == completion_ids(tokenizer, given, [1], MAX_COMPLETION)
        assert completion.truncated == (completion.ids[-1] != 1)
    (again,) = engine.generate([Prompt(index=1, ids=[], record=PROMPTS[1]["prompt"])], generation=2)
    assert [c.ids for c in again] == [completion_ids(tokenizer, g, [1], MAX_COMPLETION) for g in GIVEN[1]]
    assert again[3].ids == GIVEN[1][3] and again[3].truncated  # ids as given, no EOS: truncated


@pytest.mark.slow  # imports TRL
def test_the_builtin_rewards_are_trls():
    """`accuracy` and `format` give TRL 1.16's `accuracy_reward` and `think_format_reward` on the same
    completions (chat and plain), None included."""
    from trl.rewards import accuracy_reward, think_format_reward

    from dtrain.rewards import accuracy, think_format

    texts = [r"\boxed{\frac{1}{3}}", r"so $x = 2$", "<think>a</think> 4", "<think>a", r"\boxed{7}", "none"]
    solutions = [r"\frac{1}{3}", "$2$", "4", "4", r"\text{unparseable}}", "3"]
    chat = [[{"role": "assistant", "content": text}] for text in texts]
    assert accuracy(chat, solutions) == accuracy_reward(chat, solutions)
    assert accuracy(texts, solutions) == accuracy_reward(chat, solutions)
    assert think_format(chat) == think_format_reward(chat) == think_format(texts)
    assert 1.0 in accuracy(chat, solutions) and 0.0 in accuracy(chat, solutions)


def test_the_vllm_correction_is_trls_by_hand():
    """vLLM's importance-sampling correction (docs/grpo.md's appendix, §10), written out: δ_t = old −
    sampling (a NaN sampling log-prob adds 0); per token exp(δ_t), or per completion exp(Σ_t δ_t) on
    every token; outside [clip_min, clip_max] 0 (`*_mask`) or clamped (`*_truncate`)."""
    from dtrain.objectives.grpo_generation import importance_ratio

    old = [[-1.0, -2.0, -0.5], [-0.1, -0.2]]
    sampled = [[-1.5, -1.0, float("nan")], [-0.1, -2.0]]
    gaps = [[0.5, -1.0, 0.0], [0.0, 1.8]]
    per_token = [[math.exp(g) for g in gap] for gap in gaps]
    per_sequence = [[math.exp(sum(gap))] * len(gap) for gap in gaps]

    def clipped(ratios, low, high, mask):
        inside = lambda r: (low is None or r >= low) and (high is None or r <= high)  # noqa: E731
        clamp = lambda r: min(max(r, low if low is not None else r), high if high is not None else r)  # noqa: E731
        return [[(r if inside(r) else 0.0) if mask else clamp(r) for r in row] for row in ratios]

    for mode, ratios in (("token", per_token), ("sequence", per_sequence)):
        for kind, low, high in (("mask", None, 3.0), ("truncate", 0.5, 3.0), ("mask", 0.5, 2.0)):
            got = importance_ratio(old, sampled, f"{mode}_{kind}", low, high)
            want = clipped(ratios, low, high, kind == "mask")
            for row, expected in zip(got, want, strict=True):
                assert row == pytest.approx(expected, rel=1e-6), (mode, kind, low, high)
