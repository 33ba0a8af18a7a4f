"""tests/grpo_reference.py is faithful: TRL's GRPOTrainer run there with fixed completions trains on
exactly the given completions, lined up with the prompts TRL draws, and what it logs is what GRPO's
definition gives from them, computed here by hand (design.md §3, docs/grpo.md's appendix): at one
iteration without KL the ratio is 1, so each step's loss is a normaliser applied to the advantages
alone, which come from the rewards of the given completions. Where the ratio moves (num_iterations=2,
beta > 0) the curve must move, the reference must be the one TRL documents (the frozen model, the
adapters off, a copy of a starting adapter), and a mixture of experts must add its router loss."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests import grpo_reference
from tests.grpo_reference import cached_run, completion_ids
from tests.helpers import TOKENIZER, save_tiny_llama, save_tiny_moe
from tests.tolerance import RTOL, assert_scalar_close

G, BATCH, MAX_COMPLETION, LR = 4, 8, 6, 1e-3  # two prompts a step
EOS = 1  # the tiny tokenizer's <|eos|>

# Five prompts: two a generation, so the fifth is dropped and the third step starts the file again.
# Each group mixes lengths, a truncated completion (8 letters > 6 tokens), an empty one (EOS alone)
# and, in the fourth, equal rewards (a group of zero std).
RECORDS = [
    {"prompt": "sort: b a", "target": 3, "letter": "a"},
    {"prompt": "sort: d c e", "target": 4, "letter": "c"},
    {"prompt": "sort: f e", "target": 2, "letter": "e"},
    {"prompt": "sort: h g", "target": 3, "letter": "g"},
    {"prompt": "sort: j i", "target": 3, "letter": "i"},
]
COMPLETIONS = [
    ["a b", "b a", "", "a b c d e f g h"],
    ["c d e", "e d c", "c", [292, 304, 303, 300, 301, 302]],
    ["e f", "e", "f e", "e f g h i j k l"],
    ["g h", "g h", "g h", "g h"],
    ["i j", "j i", "i", "j"],
]


def length_reward(prompts, completions, completion_ids, target, **kwargs):
    """-|tokens - target|: integers, so the group statistics round alike in any order."""
    return [-float(abs(len(ids) - t)) for ids, t in zip(completion_ids, target, strict=True)]


def letter_reward(prompts, completions, completion_ids, letter, **kwargs):
    """1 where the completion holds the record's letter; None (skipped) where it is empty."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if not text.strip() else float(ch in text) for text, ch in zip(texts, letter, strict=True)]


FUNCS, WEIGHTS = [length_reward, letter_reward], [1.0, 0.5]


def reference_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the pytest session, its xdist workers included (as test_parity's)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hf-references"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return reference_cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("grpo-models")
    return {"llama": save_tiny_llama(folder / "llama", tied=False), "moe": save_tiny_moe(folder / "moe")}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def run(cache: Path, model: Path, steps: int = 3, records=RECORDS, completions=COMPLETIONS, **settings):
    return cached_run(
        cache,
        model,
        records,
        FUNCS,
        completions=completions,
        steps=steps,
        batch=BATCH,
        lr=LR,
        num_generations=G,
        max_completion_length=MAX_COMPLETION,
        reward_weights=WEIGHTS,
        **settings,
    )


def given_ids(tokenizer, completion) -> list[int]:
    """The rule the brief states, written out: a text's tokens then EOS, cut to the maximum length."""
    if isinstance(completion, list):
        return completion
    return (tokenizer(completion, add_special_tokens=False)["input_ids"] + [EOS])[:MAX_COMPLETION]


def generation(step: int, prompts_per_generation: int) -> list[int]:
    """The records of a generation's rows: the file in order, whole chunks, each prompt G times."""
    chunk = step % (len(RECORDS) // prompts_per_generation)
    return [chunk * prompts_per_generation + i // G for i in range(prompts_per_generation * G)]


def by_hand(tokenizer, rows: list[int], chat: bool = False, scale: str = "group") -> dict:
    """GRPO's quantities of one generation from the given completions, in float64: ids, decoded
    texts (special tokens skipped), weighted rewards (a function's None left out of the sum),
    advantages (group mean; unbiased std + 1e-4 over the group, the batch, or none)."""
    ids = [given_ids(tokenizer, COMPLETIONS[r][i % G]) for i, r in enumerate(rows)]
    texts = [tokenizer.decode(x, skip_special_tokens=True) for x in ids]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    columns = {key: [RECORDS[r][key] for r in rows] for key in ("target", "letter")}
    prompts = [RECORDS[r]["prompt"] for r in rows]
    per_func = torch.tensor(
        [[math.nan if v is None else v for v in f(prompts, completions, ids, **columns)] for f in FUNCS],
        dtype=torch.float64,
    ).T
    rewards = (per_func * torch.tensor(WEIGHTS, dtype=torch.float64)).nansum(1)
    groups = rewards.view(-1, G)
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    std = {"group": groups.std(1).repeat_interleave(G), "batch": rewards.std().expand(len(rewards))}
    advantages = centred if scale == "none" else centred / (std[scale] + 1e-4)
    truncated = torch.tensor([x[-1] != EOS for x in ids])
    return dict(
        ids=ids,
        texts=texts,
        per_func=per_func,
        rewards=rewards,
        advantages=advantages,
        lengths=torch.tensor([len(x) for x in ids], dtype=torch.float64),
        truncated=truncated,
        zero_std=groups.std(1) == 0,
    )


def loss_by_hand(hand: dict, loss_type: str, mask_truncated: bool = False, normaliser: float | None = None):
    """The loss at ratio 1 and beta 0: every token of completion i costs -A_i; each loss type's
    normaliser over one micro-batch (dapo: `normaliser` tokens when given, TRL's generation count
    over steps_per_generation)."""
    lengths = hand["lengths"] * ~hand["truncated"] if mask_truncated else hand["lengths"]
    summed = -(hand["advantages"] * lengths).sum().item()
    if loss_type == "grpo":  # mean over completions of each one's token mean; a masked one counts as 0
        return -(hand["advantages"] * (lengths > 0)).mean().item()
    if loss_type == "dr_grpo":
        return summed / (len(lengths) * MAX_COMPLETION)
    return summed / (normaliser or lengths.sum().item())  # bnpo, dapo


def test_a_text_is_its_tokens_then_eos_cut_at_the_maximum(tokenizer):
    rule = lambda c: completion_ids(tokenizer, c, [EOS], MAX_COMPLETION)  # noqa: E731
    assert rule("a b") == tokenizer("a b", add_special_tokens=False)["input_ids"] + [EOS]
    assert rule("") == [EOS]
    five = "a b c d e"  # five tokens: EOS fits
    assert rule(five)[-1] == EOS and len(rule(five)) == MAX_COMPLETION
    six = "a b c d e f"  # six tokens: no room for EOS, truncated
    assert rule(six) == tokenizer(six, add_special_tokens=False)["input_ids"] and EOS not in rule(six)
    assert rule([5, 6, EOS]) == [5, 6, EOS] and rule([5, 6]) == [5, 6]
    for bad in ([], [5, EOS, 6], list(range(10, 10 + MAX_COMPLETION + 1)), "a <|eos|> b"):
        with pytest.raises(ValueError):
            rule(bad)


CASES = {
    "dapo": dict(loss_type="dapo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo_masked": dict(loss_type="dr_grpo", mask_truncated_completions=True),
    "grpo_batch_masked_gspo": dict(
        loss_type="grpo",
        scale_rewards="batch",
        mask_truncated_completions=True,
        importance_sampling_level="sequence",
    ),
    "dapo_unscaled_masked": dict(loss_type="dapo", scale_rewards="none", mask_truncated_completions=True),
}


@pytest.mark.slow  # a TRL run each
@pytest.mark.parametrize("case", CASES)
def test_every_step_is_the_formula_on_the_given_completions(cache, models, tokenizer, case):
    """beta 0, one iteration, one micro-batch: every step's loss is the loss type's normaliser on
    the advantages of the given completions' rewards; reward, reward_std, each function's mean and
    std (None left out), frac_reward_zero_std and the length metrics are theirs too."""
    settings = CASES[case]
    result = run(cache, models["llama"], **settings)
    metrics = result["metrics"]
    scale = settings.get("scale_rewards", "group")
    for step in range(3):
        rows = generation(step, BATCH // G)
        hand = by_hand(tokenizer, rows, scale=scale)
        rollout = result["rollouts"][step]
        assert rollout["rows"] == rows and rollout["step"] == step + 1
        assert sorted(rollout["order"]) == list(range(BATCH)) and rollout["steps"] == [rollout["order"]]
        assert rollout["completion_ids"] == hand["ids"] and rollout["completions"] == hand["texts"]
        assert rollout["prompt_ids"] == [tokenizer(RECORDS[r]["prompt"])["input_ids"] for r in rows]
        expected = loss_by_hand(
            hand, settings["loss_type"], settings.get("mask_truncated_completions", False)
        )
        assert_scalar_close(metrics["loss"][step], expected, f"{case} step {step + 1} loss")
        assert_scalar_close(metrics["reward"][step], hand["rewards"].mean().item(), "reward")
        assert_scalar_close(metrics["reward_std"][step], hand["rewards"].std().item(), "reward_std")
        for index, f in enumerate(FUNCS):
            column = hand["per_func"][:, index]
            for stat, value in (("mean", column.nanmean()), ("std", column[~column.isnan()].std())):
                name = f"rewards/{f.__name__}/{stat}"
                assert_scalar_close(metrics[name][step], value.item(), name)
        zero = hand["zero_std"].double().mean() if scale != "batch" else float(hand["rewards"].std() == 0)
        assert metrics["frac_reward_zero_std"][step] == zero
        lengths, truncated = hand["lengths"], hand["truncated"]
        assert metrics["completions/mean_length"][step] == pytest.approx(lengths.mean().item(), rel=RTOL)
        assert metrics["completions/max_length"][step] == lengths.max().item()
        assert metrics["completions/clipped_ratio"][step] == pytest.approx(truncated.double().mean().item())
        terminated = lengths[~truncated].mean().item()
        assert metrics["completions/mean_terminated_length"][step] == pytest.approx(terminated, rel=RTOL)
    assert truncated.any() and any(by_hand(tokenizer, generation(1, 2))["zero_std"])  # the cases they are for


@pytest.mark.slow
def test_chat_prompts_use_the_template_with_the_generation_prompt(cache, models, tokenizer):
    """Messages: TRL tokenizes the prompt with the tokenizer's chat template and the generation
    prompt, the reward functions get each completion as one assistant message, the loss is the same
    formula. The completions come inside the records, as the file engine writes them."""
    chat = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in RECORDS]
    rollouts = [{**r, "completions": c} for r, c in zip(chat, COMPLETIONS, strict=True)]  # the file format
    result = run(cache, models["llama"], steps=1, records=rollouts, completions=None)
    rows = generation(0, 2)
    rollout, hand = result["rollouts"][0], by_hand(tokenizer, rows, chat=True)
    template = [
        tokenizer.apply_chat_template(
            chat[r]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for r in rows
    ]
    assert rollout["prompt_ids"] == template and template[0][-1] == tokenizer.convert_tokens_to_ids(
        "<|assistant|>"
    )
    assert rollout["completions"][0] == [{"role": "assistant", "content": hand["texts"][0]}]
    assert_scalar_close(result["metrics"]["loss"][0], loss_by_hand(hand, "dapo"), "chat loss")


CURVES = {
    "dapo": dict(loss_type="dapo"),
    "gspo_clip_higher": dict(
        loss_type="grpo", importance_sampling_level="sequence", epsilon_high=0.28, delta=1.5
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CURVES)
def test_the_curve_moves_with_kl_and_two_iterations(cache, models, tokenizer, case):
    """beta 0.04, num_iterations 2, two steps a generation in a given order: one generation feeds
    four steps (its two halves, twice); step 1 is the formula (dapo's normaliser: the generation's
    tokens over steps_per_generation; grpo's: the step's completions) at KL 0; afterwards the KL to
    the frozen model grows, the same rows give another loss, and the weights have moved."""
    order = [9, 2, 14, 7, 0, 11, 5, 12, 3, 8, 15, 1, 6, 13, 4, 10]
    loss_type = CURVES[case]["loss_type"]
    result = run(
        cache,
        models["llama"],
        steps=4,
        beta=0.04,
        num_iterations=2,
        steps_per_generation=2,
        shuffle=[order],
        weights=True,
        **CURVES[case],
    )
    metrics, (rollout,) = result["metrics"], result["rollouts"]
    assert rollout["order"] == order and rollout["steps"] == [order[:8], order[8:]]
    hand = by_hand(tokenizer, generation(0, 4))
    step_one = {
        key: value[order[:8]] if torch.is_tensor(value) else [value[i] for i in order[:8]]
        for key, value in hand.items()
        if key not in ("zero_std",)
    }
    expected = loss_by_hand(step_one, loss_type, normaliser=hand["lengths"].sum().item() / 2)
    assert_scalar_close(metrics["loss"][0], expected, "step 1 loss")
    assert metrics["kl"][0] < 1e-9 < min(metrics["kl"][1:])
    assert metrics["reward"][1:] == [None] * 3  # logged on the generating step only
    assert abs(metrics["loss"][2] - metrics["loss"][0]) > 1e-3  # the same rows, the policy moved
    initial = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).state_dict()
    moved = [name for name, param in result["params"].items() if not torch.equal(param, initial[name])]
    assert len(moved) == len(result["params"]) and all(a.max() > 0 for a in result["allowance"].values())


def lora_adapters(seed: int) -> dict[str, torch.Tensor]:
    """Non-zero A and B for q_proj and v_proj (PEFT saved names): a policy unlike its base."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"lora_A": (4, 64), "lora_B": (64, 4)}
    return {
        f"base_model.model.model.layers.{layer}.self_attn.{proj}.{part}.weight": 0.1
        * torch.randn(shape, generator=generator)
        for layer in range(2)
        for proj in ("q_proj", "v_proj")
        for part, shape in shapes.items()
    }


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.mark.slow
def test_lora_starts_from_the_given_adapters_and_its_reference_is_the_base(cache, models):
    """A fresh adapter (peft) with given weights: TRL starts from them and its reference is the
    model with the adapters off, so the KL is not 0 at step 1 when B is not 0."""
    adapters = lora_adapters(0)
    result = run(cache, models["llama"], steps=2, beta=0.04, peft=LORA, adapters=adapters, weights=True)
    assert set(result["initial"]) == set(adapters) == set(result["params"])
    assert all(torch.equal(result["initial"][name], tensor) for name, tensor in adapters.items())
    assert result["metrics"]["kl"][0] > 1e-6


@pytest.mark.slow
def test_a_starting_adapter_folder_is_its_own_reference(cache, models, tmp_path):
    """A PEFT folder to start from: TRL's reference is a frozen copy of that adapter, KL 0 at step 1."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))
    adapters = lora_adapters(1)
    model.load_state_dict(
        {k.replace(".weight", ".default.weight"): v for k, v in adapters.items()}, strict=False
    )
    model.save_pretrained(tmp_path / "adapter")
    result = run(cache, models["llama"], steps=2, beta=0.04, adapter=tmp_path / "adapter")
    assert all(torch.equal(result["initial"][name], tensor) for name, tensor in adapters.items())
    assert result["metrics"]["kl"][0] < 1e-9 < result["metrics"]["kl"][1]


@pytest.mark.slow
def test_a_mixture_of_experts_adds_its_router_loss(cache, models, tokenizer):
    """Qwen3-MoE (router_aux_loss_coef 0.05): each step's loss is the formula plus 0.05 × the
    logged aux_loss (HF's load-balancing loss over the micro-batch's prompt and completion tokens)."""
    result = run(cache, models["moe"], steps=2)
    metrics = result["metrics"]
    for step in range(2):
        hand = by_hand(tokenizer, generation(step, 2))
        expected = loss_by_hand(hand, "dapo") + 0.05 * metrics["aux_loss"][step]
        assert metrics["aux_loss"][step] > 0.5
        assert_scalar_close(metrics["loss"][step], expected, f"moe step {step + 1} loss")


@pytest.mark.slow
def test_runs_are_cached_under_their_inputs(cache, models, monkeypatch):
    """A second call with the same inputs reads the first one's result; other inputs compute."""
    first = run(cache, models["llama"], steps=1)

    def computing(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(grpo_reference, "trl_run", computing)
    second = run(cache, models["llama"], steps=1)
    assert second["metrics"] == first["metrics"]
    with pytest.raises(AssertionError, match="computed again"):
        run(cache, models["llama"], steps=1, beta=0.01)


@pytest.mark.slow
def test_trl_bnpo_depends_on_the_micro_batches_and_dapo_does_not(cache, models, tokenizer):
    """TRL's own accumulation (two micro-batches of 4, in order): dapo's normaliser is the step's
    token count, so its loss is the one-micro-batch loss; bnpo's is each micro-batch's own count,
    averaged over the micro-batches: another value (what dtrain defines over the whole step instead)."""
    rows = generation(0, 2)
    hand = by_hand(tokenizer, rows)
    halves = [
        {key: hand[key][half] for key in ("advantages", "lengths", "truncated")}
        for half in (slice(0, 4), slice(4, 8))
    ]
    for loss_type in ("dapo", "bnpo"):
        one = run(cache, models["llama"], loss_type=loss_type)["metrics"]["loss"][0]
        two = run(cache, models["llama"], steps=1, loss_type=loss_type, accumulation=2, shuffle="identity")
        assert_scalar_close(one, loss_by_hand(hand, "dapo"), f"{loss_type} one micro-batch")
        expected = one if loss_type == "dapo" else sum(loss_by_hand(h, "bnpo") for h in halves) / 2
        assert_scalar_close(two["metrics"]["loss"][0], expected, f"{loss_type} two micro-batches")
        assert two["rollouts"][0]["steps"] == [list(range(4)), list(range(4, 8))]
    assert abs(expected - one) > 1e-3 * abs(one)
