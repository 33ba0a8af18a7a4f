"""dtrain.dpo against TRL 1.16's DPOTrainer (tests/dpo_reference.py: no dtrain code): the same
records tokenized token for token, and the same training run (fp32, TRL with one micro-batch holding
the whole global batch on one process) on every mesh: 1×1 (every loss type, RPO, a weighted mix,
packed rows, the live reference, LoRA from a non-zero PEFT adapter: TRL's reference is a frozen copy
of it, dtrain's dpo.reference=auto precomputes the starting policy), dp_shard 4, tp 2 × dp 2
(sequence parallel), cp 2 × tp 2 on packed pairs, dp_replicate 2 × dp_shard 2, LoRA at tp 2 × dp 2
with adapters_off (TRL with a peft_config), a tiny Qwen3-MoE at ep 2 × tp 2 with its aux loss; each
with sigmoid and ipo. The mesh runs are one
launch per world size (tests/workers/dpo_runs.py), the TRL runs computed once and cached.

Tolerance (the error model's RTOL, tests/tolerance.py, per step on loss, grad norm and rewards): fp32
throughout, both sides compute the same sums in another order (TRL pads a batch of rows, dtrain shards
and packs them): a per-token log-probability's rounding is a few ulp of the log-sum-exp (~7, about
1e-6), a sequence's sum of at most 32 of them about 1e-5 absolute at worst, which β = 0.1 shrinks to
1e-6 in the loss's argument (~1e-6 relative of a loss near ln 2, whose slope is 1/2); gradients carry
the same relative noise, and two AdamW updates at lr 3e-3 pass on ~lr × 1e-6 per weight. An accuracy is
a count of strictly positive margins, exact unless a margin is within that noise of 0: at step 1 every
margin is exactly 0 on both sides (the reference is the policy, computed in the same micro-batch), after
it they are far from it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dtrain.config import DataConfig
from dtrain.data.loader import SFTLoader
from dtrain.data.pairs import NO_SEQUENCE, Pairs
from dtrain.data.pipeline import prepare
from tests.dpo_reference import (
    ADAM_EPS,
    EVAL_METRICS,
    cached,
    preference_records,
    trl_run,
    trl_tokenized,
    write_jsonl,
)
from tests.helpers import TOKENIZER, run, run_worker, save_tiny_llama, save_tiny_moe
from tests.reference import best_fit_decreasing
from tests.test_lora import save_peft_adapter
from tests.test_parity import reference_cache_dir
from tests.tolerance import RTOL, assert_close
from tests.workers.dpo_runs import EVAL_EVERY, GLOBAL_BATCH, LR, MAX_LEN, SCENARIOS, STEPS

LN2 = float(torch.tensor(math.log(2.0)))  # -log σ(0) in fp32: each pair's loss at step 1
PAIRS = STEPS * GLOBAL_BATCH + 1  # a step's pairs each step, and one dropped (its prompt fills max_len)
EVAL_PAIRS = 8
FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins")
FIGURES += ("logps/chosen", "logps/rejected")
ALL = {**SCENARIOS[1], **SCENARIOS[4]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    records = {
        "pairs": preference_records(PAIRS),
        "full": preference_records(PAIRS, seed=1, long=True),
        "test": preference_records(EVAL_PAIRS, seed=3, overlong=False),  # held out: the eval scenarios'
    }
    llama = save_tiny_llama(root / "llama", tied=False)
    save_peft_adapter(llama)  # llama/adapter: non-zero A and B on every projection, written by PEFT
    split = root / "split"  # a folder of two splits: data.eval_split=test
    split.mkdir()
    write_jsonl(split / "train.jsonl", records["pairs"])
    write_jsonl(split / "test.jsonl", records["test"])
    return {
        "llama": llama,
        "adapter": llama / "adapter",
        "ref": save_tiny_llama(root / "ref", tied=False, seed=1),  # dpo.ref_model: another model
        "moe": save_tiny_moe(root / "moe"),
        "records": records,
        "split": split,
        **{kind: write_jsonl(root / f"{kind}.jsonl", records[kind]) for kind in ("pairs", "full")},
    }


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_runs")
    args = ["--out", str(out)]
    for name in ("llama", "moe", "ref", "pairs", "full", "split", "adapter"):
        args += [f"--{name}", str(inputs[name])]
    # while developing: DTRAIN_DPO_ONLY=1x1_sigmoid,dp4_ipo runs only those (the other tests then fail)
    args += ["--only", os.environ.get("DTRAIN_DPO_ONLY", "")]
    for nproc in (1, 4):
        result = run_worker(nproc, "dpo_runs", *args, timeout=1200)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


def trl_settings(overrides: dict) -> dict:
    """DPOConfig's keywords for a scenario's dpo.* overrides: the same names (dpo.reference has no
    DPOConfig key: TRL's live and precomputed references are the same; dpo.ref_model is the trainer's
    ref_model)."""
    types = overrides.get("dpo.loss_type", "sigmoid")
    settings = {"beta": 0.1, "loss_type": [types] if isinstance(types, str) else types}
    for key, value in overrides.items():
        if key.startswith("dpo.") and key not in ("dpo.loss_type", "dpo.reference", "dpo.ref_model"):
            settings[key.removeprefix("dpo.")] = value
    return settings


def reference(inputs, runs, name: str, cache: Path) -> dict:
    """TRL's run of the scenario `name`: its model, records and loss; LoRA from dtrain's initial A;
    the eval scenarios' held-out pairs as its eval_dataset."""
    model, data, overrides = ALL[name]
    settings = trl_settings(overrides)
    peft = adapters = None
    adapter = inputs["adapter"] if "lora.adapter" in overrides else None  # TRL from the same PEFT folder
    ref_model = inputs["ref"] if "dpo.ref_model" in overrides else None
    if "lora.r" in overrides:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft = dict(r=overrides["lora.r"], lora_alpha=overrides["lora.alpha"], target_modules=targets)
        adapters = runs[name]["adapters"]
    records = inputs["records"]["pairs" if data == "split" else data]
    evals = inputs["records"]["test"] if data == "split" else None
    key = [model, data, settings, peft, adapter is not None, ref_model is not None]
    key += [STEPS, GLOBAL_BATCH, LR, ADAM_EPS, MAX_LEN, records, evals, EVAL_EVERY]
    key += [sorted((k, v.sum().item()) for k, v in (adapters or {}).items())]

    def compute() -> dict:
        return trl_run(
            inputs[model], records, STEPS, GLOBAL_BATCH, LR, MAX_LEN, peft, adapters, adapter,
            ref_model, evals, EVAL_EVERY, **settings,
        )  # fmt: skip

    return cached(cache, "trl-dpo", key, compute)


COMPARED = sorted(name for name in ALL if name != "resumed")
EVALUATED = sorted(name for name in COMPARED if ALL[name][1] == "split")


def training(history: list[dict]) -> list[dict]:
    """The training steps' records of a history (its eval lines left out)."""
    return [record for record in history if "loss" in record]


# f-DPO's score of a log-ratio r is f'(e^r): forward_kl 1 − e^−r, js_divergence log 2 + log σ(r),
# alpha_divergence (e^((α−1)r) − 1)/(α − 1). The relative change of its derivative per unit of r is at
# most κ (1, 1, |α − 1|), so a pair's loss gradient carries κ times the log-ratio's absolute noise,
# RTOL·|logps|, besides its own RTOL (module docstring): not shrunk by β as the sigmoid's argument is.
KAPPA = {"reverse_kl": 0.0, "forward_kl": 1.0, "js_divergence": 1.0}


def kappa(overrides: dict) -> float:
    divergence = overrides.get("dpo.f_divergence_type", "reverse_kl")
    if divergence == "alpha_divergence":
        return abs(overrides.get("dpo.f_alpha_divergence_coef", 0.5) - 1.0)
    return KAPPA[divergence]


def assert_step_close(
    record: dict, expected: dict, step: int, what: str, keys=FIGURES, amplified: float = 0.0
) -> None:
    """FIGURES (or `keys`) of one step at RTOL (module docstring); the rewards (β × a log-ratio: a
    difference of two log-probabilities of ~|logps|) with the absolute noise of what was subtracted,
    β·RTOL·|logps|; with an f-divergence (`amplified`: its κ) the loss and grad norm also with κ times
    that noise relative (KAPPA)."""
    logps = abs(expected["logps/chosen"][step]) + abs(expected["logps/rejected"][step])
    scale = 0.1 * RTOL * logps
    for key in keys:
        atol = scale if key.startswith("rewards/") else 1e-7
        if key in ("loss", "grad_norm"):
            atol += amplified * RTOL * logps * abs(expected[key][step])
        value, want = (
            torch.tensor(record[key], dtype=torch.float64),
            torch.tensor(expected[key][step], dtype=torch.float64),
        )
        assert_close(value, want, atol, f"{what} step {step + 1} {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPARED)
def test_every_step_matches_trl(inputs, runs, tmp_path_factory, name):
    """Every step's loss, grad norm, rewards and chosen and rejected log-probs within the module's
    error model of TRL's, and its reward accuracy the same; TRL's own curve moves (not a vacuous
    match)."""
    ref = reference(inputs, runs, name, reference_cache_dir(tmp_path_factory))
    history = training(runs[name]["history"])
    assert [record["step"] for record in history] == list(range(1, STEPS + 1))
    assert max(abs(loss - ref["loss"][0]) for loss in ref["loss"]) > 1e-3, ref["loss"]
    for step, record in enumerate(history):
        assert_step_close(record, ref, step, name, amplified=kappa(ALL[name][2]))
        assert record["rewards/accuracies"] == ref["rewards/accuracies"][step], f"{name} step {step + 1}"


@pytest.mark.slow
def test_trls_reward_accuracies_vary(inputs, runs, tmp_path_factory):
    """The pairs make TRL's accuracy take values other than 0 and 1/2 after step 1 (a chosen/rejected
    swap in dtrain's accuracy, 1 − it, then differs from it), and its chosen and rejected log-probs
    differ (a copy of one in the other's place shows)."""
    ref = reference(inputs, runs, "1x1_sigmoid", reference_cache_dir(tmp_path_factory))
    assert set(ref["rewards/accuracies"][1:]) - {0.0, 0.5}, ref["rewards/accuracies"]
    assert all(abs(c - r) > 1.0 for c, r in zip(ref["logps/chosen"], ref["logps/rejected"], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", EVALUATED)
def test_eval_matches_trl(inputs, runs, tmp_path_factory, name):
    """dtrain's eval of the held-out pairs after every step (train.eval_every) is TRL's (its eval_dataset
    as one batch, eval_steps 1): eval_loss, the rewards and log-probs under TRL's `eval_` names at the
    error model's tolerance, the accuracy the same; with the precomputed reference and with TR-DPO's
    moved one."""
    ref = reference(inputs, runs, name, reference_cache_dir(tmp_path_factory))
    evals = [record for record in runs[name]["history"] if "eval_loss" in record]
    steps = list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert [record["step"] for record in evals] == [entry["step"] for entry in ref["eval"]] == steps
    for record, entry in zip(evals, ref["eval"], strict=True):
        expected = {key.removeprefix("eval_"): [entry[key]] for key in EVAL_METRICS}
        got = {key.removeprefix("eval_"): record[key] for key in EVAL_METRICS}
        keys = [key for key in got if key != "rewards/accuracies"]
        assert_step_close(got, expected, 0, f"{name} eval", keys, kappa(ALL[name][2]))
        assert got["rewards/accuracies"] == entry["eval_rewards/accuracies"], name
        assert record["eval_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(name for name in ALL if "dpo.ref_model" not in ALL[name][2]))
def test_first_step_is_the_reference_exactly(runs, name):
    """The reference is the starting policy: at step 1 every pair's margin is exactly 0, so no pair is
    accurate (TRL's strict >) and the sigmoid loss is exactly fp32's ln 2 (-log σ(0); the MoE's logged
    loss adds its aux term)."""
    first = training(runs[name]["history"])[0]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[key] == 0.0, f"{name}: {key} {first[key]}"
    _, _, overrides = ALL[name]
    if overrides.get("dpo.loss_type", "sigmoid") == "sigmoid" and "aux_loss" not in first:
        assert first["loss"] == LN2, first["loss"]


def assert_continues(history: list[dict], whole: list[dict], what: str) -> None:
    assert [record["step"] for record in history] == list(range(1, STEPS + 1))
    expected = {key: [record[key] for record in whole] for key in whole[0]}
    for step, record in enumerate(history):
        assert_step_close(record, expected, step, what)


@pytest.mark.slow
def test_resumed_on_another_mesh_continues_the_uninterrupted_curve(runs):
    """A dp_shard 4 run checkpointed at step 2, whose later steps are thrown away (what a kill after
    that checkpoint leaves; killing and rerunning through the launcher is test_lifecycle's), rerun from
    there in the same folder at tp 2 × dp 2: its steps equal the uninterrupted dp_shard 4 run's (dtrain
    against dtrain: the reference is the run not interrupted, itself TRL's), and the reference table is
    read, not computed again (from a policy that has moved: the curve would leave)."""
    resumed, whole = runs["resumed"], runs["dp4_sigmoid"]["history"]
    assert resumed["table_unchanged"]
    assert_continues(resumed["same"]["history"], whole, "resumed")
    assert any("read the reference log-probs from" in line for line in resumed["same"]["lines"])


@pytest.mark.slow
def test_resumed_into_a_new_folder_reads_the_checkpoints_run_table(runs):
    """checkpoint.resume=PATH into a new run folder: the reference table is read from the folder the
    checkpoint belongs to (its log line names that file) and copied into the new folder byte for byte
    (its own later resumes find it there); the curve continues the uninterrupted one."""
    resumed, whole = runs["resumed"], runs["dp4_sigmoid"]["history"]
    lines = resumed["new_folder"]["lines"]
    read = [line for line in lines if "read the reference log-probs from" in line]
    assert len(read) == 1 and read[0].endswith("resumed/reference_logps.safetensors"), lines
    assert not any("computed again" in line for line in lines), lines
    assert resumed["copied"]
    assert_continues(resumed["new_folder"]["history"], whole, "resumed into a new folder")


@pytest.mark.slow
def test_a_truncated_reference_table_is_set_aside_and_computed_again(runs):
    """The run folder's reference_logps.safetensors cut in half on disk, then the same run resumed: one
    line says it cannot be read and is set aside (renamed unreadable-..., its bytes kept), the table is
    computed again from the starting policy rebuilt (not from the moved policy: the curve would leave)
    and written whole, and the run continues the uninterrupted curve (the recomputed table on another
    mesh than the first: equal to the error model's tolerance)."""
    resumed, whole = runs["resumed"], runs["dp4_sigmoid"]["history"]
    lines = resumed["truncated"]["lines"]
    aside = [line for line in lines if "cannot be read" in line]
    assert len(aside) == 1 and "set aside as unreadable-reference_logps.safetensors" in aside[0], lines
    assert resumed["set_aside"] and resumed["rewritten"]
    assert_continues(resumed["truncated"]["history"], whole, "resumed after a truncated table")


@pytest.mark.slow
def test_the_moved_tr_dpo_reference_resumes_from_its_checkpoint(runs):
    """TR-DPO's reference, moved by two syncs, is in the step-2 checkpoint: resumed from it on another
    mesh (tp 2 × dp 2 → dp_shard 4), step 3 and its eval continue the uninterrupted run (itself TRL's;
    dtrain against dtrain on purpose). A reference rebuilt from the starting policy instead would
    leave the curve at step 3."""
    whole, resumed = runs["tp2_dp2_tr_dpo"]["history"], runs["tp2_dp2_tr_dpo"]["resumed"]
    assert [(record["step"], "loss" in record) for record in resumed] == [
        (record["step"], "loss" in record) for record in whole
    ]
    trained, again = training(whole), training(resumed)
    expected = {key: [record[key] for record in trained] for key in FIGURES}
    for step, record in enumerate(again):
        assert_step_close(record, expected, step, "TR-DPO resumed")
    evals = [record for record in whole if "eval_loss" in record]
    got = [record for record in resumed if "eval_loss" in record]
    expected = {key.removeprefix("eval_"): [record[key] for record in evals] for key in EVAL_METRICS}
    keys = [key.removeprefix("eval_") for key in EVAL_METRICS if "accuracies" not in key]
    for step, record in enumerate(got):
        figures = {key.removeprefix("eval_"): record[key] for key in EVAL_METRICS}
        assert_step_close(figures, expected, step, "TR-DPO resumed eval", keys)


@pytest.mark.slow
def test_dtrain_raises_no_warning_of_its_own(runs):
    """No scenario's run makes dtrain's own code warn (torch's FutureWarning that
    all_gather_into_tensor is deprecated came from the reference table's gather on every precompute
    run)."""
    for name, saved in runs.items():
        assert saved["warnings"] == [], (name, saved["warnings"])


@pytest.mark.slow
def test_the_start_line_says_which_reference(runs):
    """The run's summary line names the reference it took: with LoRA from an adapter (precompute and
    live: the starting adapter), with fresh LoRA (adapters_off: the base), another folder's model, and
    TR-DPO's moving one."""
    adapter = "the starting policy (the base with its starting adapters)"
    said = {
        "1x1_lora_adapter": f"dpo reference=precompute: {adapter}",
        "1x1_lora_adapter_live": f"dpo reference=live: {adapter}, frozen",
        "lora_tp2_dp2_sigmoid": "dpo reference=adapters_off: the policy with its LoRA adapters bypassed",
        "1x1_ref_model": "dpo reference=precompute: the model in ",
        "tp2_dp2_ref_model": "dpo reference=live: the model in ",
        "1x1_tr_dpo": "dpo reference=live: the starting policy, frozen, run beside the policy, moved towards",
    }
    for name, words in said.items():
        assert words in runs[name]["start"], (name, runs[name]["start"])


COUNTED = ("1x1_sigmoid", "1x1_packed", "tp2_dp2_sigmoid", "cp2_tp2_sigmoid")
SIDES = ("chosen_ids", "rejected_ids")


@pytest.mark.slow
@pytest.mark.parametrize("name", COUNTED)
def test_padding_and_throughput_figures_equal_a_count_from_the_rows(inputs, runs, tmp_path_factory, name):
    """A DPO step's padding_fraction, input tokens (input_tokens_per_s × step_time_s: the slots of its
    rows) and supervised tokens (tokens_per_s × step_time_s, and `tokens`) are a count made from TRL's
    tokenization of its pairs (log_every=1): each micro-batch's 2·m sequences one per row of max_len
    slots, or packed best-fit decreasing into as few rows as hold them (tests/reference.py's packer);
    the micro-batches are the step's pairs m at a time whatever the rank (dp splits them, tp and cp
    ranks share them: counted once)."""
    records = inputs["records"]["pairs"]
    tokenized = cached(
        reference_cache_dir(tmp_path_factory),
        "trl-tokenized",
        [records, MAX_LEN],
        lambda: trl_tokenized(inputs["llama"], records, MAX_LEN),
    )
    _, _, overrides = ALL[name]
    micro, packed = overrides.get("train.micro_batch_size", 4), overrides.get("data.packing", False)
    for step, record in enumerate(training(runs[name]["history"])):
        pairs = tokenized[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        slots = filled = supervised = 0
        for start in range(0, GLOBAL_BATCH, micro):
            micro_batch = pairs[start : start + micro]
            sides = [(pair["prompt_ids"], pair[side]) for pair in micro_batch for side in SIDES]
            lengths = [len(prompt) + len(completion) for prompt, completion in sides]
            rows = len(best_fit_decreasing(lengths, MAX_LEN)) if packed else len(lengths)
            slots += rows * MAX_LEN
            filled += sum(lengths)
            supervised += sum(len(completion) for _, completion in sides)
        where = f"{name} step {step + 1}"
        assert record["tokens"] == supervised, where
        assert record["padding_fraction"] == pytest.approx(1 - filled / slots, rel=1e-12), where
        assert record["input_tokens_per_s"] * record["step_time_s"] == pytest.approx(slots, rel=1e-9), where
        assert record["tokens_per_s"] * record["step_time_s"] == pytest.approx(supervised, rel=1e-9), where
    assert packed == (slots < 2 * GLOBAL_BATCH * MAX_LEN)  # packing saved rows in the last step


def dtrain_pairs(path: Path, max_len: int, **keys) -> list[dict[str, list[int]]]:
    data = DataConfig(path=str(path), format="preference", max_len=max_len, **keys)
    examples, _ = prepare(data, AutoTokenizer.from_pretrained(TOKENIZER), seed=0)
    return [
        {key: list(example[key]) for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for example in examples
    ]


def implicit(records: list[dict]) -> list[dict]:
    return [{side: record["prompt"] + record[side] for side in ("chosen", "rejected")} for record in records]


def strings(records: list[dict]) -> list[dict]:
    return [{key: value[0]["content"] for key, value in record.items()} for record in records]


@pytest.mark.slow  # TRL's trainer tokenizes
@pytest.mark.parametrize("kind", ["explicit", "implicit", "explicit_strings", "implicit_strings"])
def test_tokenized_pairs_equal_trls_own(inputs, tmp_path, tmp_path_factory, kind):
    """TRL's tokenization of the same records, token for token: conversations through the chat template
    (the prompt with the generation prompt; the completion after the longest shared token prefix),
    strings with the EOS text appended, TRL's prompt extraction for the implicit formats, each sequence
    cut to max_len (prompt kept), the pair whose prompt fills max_len dropped."""
    records = preference_records(12, seed=3)
    records = {"explicit": records, "implicit": implicit(records)}.get(kind) or strings(records)
    records = implicit(records) if kind == "implicit_strings" else records
    expected = cached(
        reference_cache_dir(tmp_path_factory),
        "trl-tokenized",
        [records, MAX_LEN],
        lambda: trl_tokenized(inputs["llama"], records, MAX_LEN),
    )
    assert len(expected) == len(records) - 1  # the overlong prompt's pair dropped
    assert any(len(p["prompt_ids"]) + len(p["chosen_ids"]) == MAX_LEN for p in expected)  # cut ones too
    assert dtrain_pairs(write_jsonl(tmp_path / "pairs.jsonl", records), MAX_LEN) == expected


def test_pairs_pack_whole_into_micro_batches_and_steps_do_not_depend_on_the_mesh(tmp_path):
    """Each micro-batch holds whole pairs: every sequence once, in one row, with restarting positions
    and its completion's targets (read back independently of how they were packed); the pairs of a
    step are the same for dp = 1, 2, 4 (only their split over ranks differs)."""
    path = write_jsonl(tmp_path / "pairs.jsonl", preference_records(41, seed=4))
    examples, _ = prepare(DataConfig(path=str(path), format="preference", max_len=MAX_LEN), _tokenizer(), 0)
    pairs = Pairs(examples, MAX_LEN, pad_id=2, packing=True)
    steps = {}
    for dp in (1, 2, 4):
        loaders = [
            SFTLoader(
                pairs, global_batch_size=8, micro_batch_size=2, dp_rank=rank, dp_size=dp, seed=5, shuffle=True
            )
            for rank in range(dp)
        ]
        steps[dp] = [
            sorted(sum((mb["pair_index"].tolist() for ld in loaders for mb in ld.next_step()), []))
            for _ in range(7)
        ]
        for loader in loaders:
            for micro_batch in loader.next_step():
                check_micro_batch(micro_batch, pairs)
    assert steps[1] == steps[2] == steps[4]
    assert sorted(sum(steps[1][:5], [])) == list(range(len(pairs)))  # 5 steps: each pair once (an epoch)


def _tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def check_micro_batch(micro_batch: dict, pairs: Pairs) -> None:
    rows = micro_batch["input_ids"].shape[0]
    found = {}
    for row in range(rows):
        positions = micro_batch["position_ids"][row].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [int(micro_batch["num_tokens"][row])]
        for start, stop in zip(starts, starts[1:], strict=False):
            assert positions[start:stop] == list(range(stop - start))
            sequences = set(micro_batch["sequence_index"][row, start:stop].tolist()) - {NO_SEQUENCE}
            assert len(sequences) == 1
            sequence = sequences.pop()
            ids = micro_batch["input_ids"][row, start:stop].tolist()
            targets = micro_batch["labels"][row, start:stop]
            found[sequence] = (ids, targets[targets != -100].tolist())
    assert sorted(found) == list(range(2 * len(micro_batch["pair_index"])))
    for place, index in enumerate(micro_batch["pair_index"].tolist()):
        pair = pairs[index]
        for side, key in enumerate(("chosen_ids", "rejected_ids")):
            ids, targets = found[2 * place + side]
            assert ids == pair["prompt_ids"] + pair[key]
            assert targets == pair[key]


SYSTEM = {"role": "system", "content": "s"}
BAD = {
    "no_rejected": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}],
        [],
        "no_rejected.jsonl:2: key 'rejected' is missing or null",
    ),
    "prompts_disagree": (
        [
            {
                side: [SYSTEM, {"role": "user", "content": user}, {"role": "assistant", "content": "b"}]
                for side, user in (("chosen", "a"), ("rejected", "c"))
            }
        ],
        [],
        "chosen and rejected disagree at message 1",
    ),
    "all_dropped": (
        [{"prompt": "a b c d e f g h i j k l m n o p", "chosen": "b", "rejected": "c"}],
        ["data.max_len=8"],
        "no example left",
    ),
    "adapters_off": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        ["dpo.reference=adapters_off"],
        "needs LoRA adapters",
    ),
    "loss_type": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        ["dpo.loss_type=dpo_plus"],
        "dpo.loss_type='dpo_plus'",
    ),
    # TRL 1.16's sigmoid ignores it: refused rather than ignored
    "label_smoothing": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        ["dpo.label_smoothing=0.1"],
        "dpo.label_smoothing=0.1: no loss of dpo.loss_type=['sigmoid'] reads it",
    ),
    "f_divergence": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        ["dpo.loss_type=nca_pair", "dpo.f_divergence_type=js_divergence"],
        "nca_pair has no f-divergence form",
    ),
    "sync_precompute": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        ["dpo.sync_ref_model=true", "dpo.reference=precompute"],
        "dpo.sync_ref_model=true moves the reference, which needs dpo.reference=live",
    ),
    "ref_model_folder": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}],
        ["dpo.ref_model=" + str(Path(__file__).parent)],
        "no config.json in that folder",
    ),
}


@pytest.mark.slow  # a process
def test_bad_input_fails_with_one_line_and_exit_code_2(tmp_path):
    """Each: the one-line message naming what is wrong, exit code 2 (dtrain.dpo's main, one process)."""
    from tests.helpers import one_interpreter_command

    commands = {}
    for name, (records, overrides, _) in BAD.items():
        data = write_jsonl(tmp_path / f"{name}.jsonl", records * 4)
        commands[name] = [
            f"data.path={data}",
            f"hydra.run.dir={tmp_path / name}",
            "parallel.tp=1",
            "train.max_steps=1",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            *overrides,
        ]
    envs = dict.fromkeys(
        commands,
        {
            "WORLD_SIZE": "1",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29561",
        },
    )
    result = run(
        one_interpreter_command(tmp_path / "cli", commands, module="dtrain.dpo", envs=envs), timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:]
    outcomes = json.loads((tmp_path / "cli" / "out.json").read_text())
    for name, (_, _, message) in BAD.items():
        outcome = outcomes[name]
        errors = [line for line in outcome["stderr"].splitlines() if line.startswith("dtrain: error:")]
        assert outcome["returncode"] == 2, (name, outcome["stderr"][-2000:])
        assert len(errors) == 1 and message in errors[0], (name, errors)
