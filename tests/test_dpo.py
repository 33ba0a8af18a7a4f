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
from tests.dpo_reference import cached, preference_records, trl_run, trl_tokenized, write_jsonl
from tests.helpers import TOKENIZER, run, run_worker, save_tiny_llama, save_tiny_moe
from tests.test_lora import save_peft_adapter
from tests.test_parity import reference_cache_dir
from tests.tolerance import RTOL, assert_close
from tests.workers.dpo_runs import GLOBAL_BATCH, LR, MAX_LEN, SCENARIOS, STEPS

LN2 = float(torch.tensor(math.log(2.0)))  # -log σ(0) in fp32: each pair's loss at step 1
PAIRS = STEPS * GLOBAL_BATCH + 1  # a step's pairs each step, and one dropped (its prompt fills max_len)
FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    records = {
        "pairs": preference_records(PAIRS),
        "full": preference_records(PAIRS, seed=1, long=True),
        "equal": [{**record, "rejected": record["chosen"]} for record in preference_records(PAIRS, seed=2)],
    }
    llama = save_tiny_llama(root / "llama", tied=False)
    save_peft_adapter(llama)  # llama/adapter: non-zero A and B on every projection, written by PEFT
    return {
        "llama": llama,
        "adapter": llama / "adapter",
        "moe": save_tiny_moe(root / "moe"),
        "records": records,
        **{kind: write_jsonl(root / f"{kind}.jsonl", rows) for kind, rows in records.items()},
    }


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_runs")
    args = ["--out", str(out)]
    for name in ("llama", "moe", "pairs", "full", "equal", "adapter"):
        args += [f"--{name}", str(inputs[name])]
    # while developing: DTRAIN_DPO_ONLY=1x1_sigmoid,dp4_ipo runs only those (the other tests then fail)
    args += ["--only", os.environ.get("DTRAIN_DPO_ONLY", "")]
    for nproc in (1, 4):
        result = run_worker(nproc, "dpo_runs", *args, timeout=500)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


def trl_settings(overrides: dict) -> dict:
    """DPOConfig's keywords for a scenario's dpo.* overrides (RPO: TRL's `sft` loss type, weighted)."""
    types = overrides.get("dpo.loss_type", "sigmoid")
    settings = {"beta": 0.1, "loss_type": [types] if isinstance(types, str) else types}
    if "dpo.loss_weights" in overrides:
        settings["loss_weights"] = overrides["dpo.loss_weights"]
    if "dpo.label_smoothing" in overrides:
        settings["label_smoothing"] = overrides["dpo.label_smoothing"]
    if "dpo.sft_weight" in overrides:
        settings |= {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, overrides["dpo.sft_weight"]]}
    return settings


def reference(inputs, runs, name: str, cache: Path) -> dict:
    """TRL's run of the scenario `name`: its model, records and loss; LoRA from dtrain's initial A."""
    model, data, overrides = {**SCENARIOS[1], **SCENARIOS[4]}[name]
    settings = trl_settings(overrides)
    peft = adapters = None
    adapter = inputs["adapter"] if "lora.adapter" in overrides else None  # TRL from the same PEFT folder
    if "lora.r" in overrides:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft = dict(r=overrides["lora.r"], lora_alpha=overrides["lora.alpha"], target_modules=targets)
        adapters = runs[name]["adapters"]
    key = [model, data, settings, peft, adapter is not None, STEPS, GLOBAL_BATCH, LR, MAX_LEN]
    key += [inputs["records"][data]]
    key += [sorted((k, v.sum().item()) for k, v in (adapters or {}).items())]

    def compute() -> dict:
        records = inputs["records"][data]
        return trl_run(
            inputs[model], records, STEPS, GLOBAL_BATCH, LR, MAX_LEN, peft, adapters, adapter, **settings
        )

    return cached(cache, "trl-dpo", key, compute)


COMPARED = sorted(name for name in {**SCENARIOS[1], **SCENARIOS[4]} if name not in ("1x1_equal", "resumed"))


def assert_step_close(record: dict, expected: dict, step: int, what: str) -> None:
    """FIGURES of one step at RTOL (module docstring); the rewards (β × a log-ratio: a difference of
    two log-probabilities of ~|logps|) with the absolute noise of what was subtracted, β·RTOL·|logps|."""
    scale = 0.1 * RTOL * (abs(expected["logps/chosen"][step]) + abs(expected["logps/rejected"][step]))
    for key in FIGURES:
        atol = scale if key.startswith("rewards/") else 1e-7
        value, want = (
            torch.tensor(record[key], dtype=torch.float64),
            torch.tensor(expected[key][step], dtype=torch.float64),
        )
        assert_close(value, want, atol, f"{what} step {step + 1} {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPARED)
def test_every_step_matches_trl(inputs, runs, tmp_path_factory, name):
    """Every step's loss, grad norm, rewards and chosen log-probs within the module's error model of
    TRL's, and its reward accuracy the same; TRL's own curve moves (not a vacuous match)."""
    ref = reference(inputs, runs, name, reference_cache_dir(tmp_path_factory))
    history = runs[name]["history"]
    assert [record["step"] for record in history] == list(range(1, STEPS + 1))
    assert max(abs(loss - ref["loss"][0]) for loss in ref["loss"]) > 1e-3, ref["loss"]
    for step, record in enumerate(history):
        assert_step_close(record, ref, step, name)
        assert record["rewards/accuracies"] == ref["rewards/accuracies"][step], f"{name} step {step + 1}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted({**SCENARIOS[1], **SCENARIOS[4]}))
def test_first_step_is_the_reference_exactly(runs, name):
    """The reference is the starting policy: at step 1 every pair's margin is exactly 0, so no pair is
    accurate (TRL's strict >) and the sigmoid loss is exactly fp32's ln 2 (-log σ(0); the MoE's logged
    loss adds its aux term)."""
    first = runs[name]["history"][0]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[key] == 0.0, f"{name}: {key} {first[key]}"
    _, _, overrides = {**SCENARIOS[1], **SCENARIOS[4]}[name]
    sigmoid = overrides.get("dpo.loss_type", "sigmoid") == "sigmoid" and "dpo.sft_weight" not in overrides
    if sigmoid and "aux_loss" not in first:
        assert first["loss"] == LN2, first["loss"]


@pytest.mark.slow
def test_pairs_with_chosen_equal_to_rejected_give_no_gradient(runs):
    """chosen = rejected: the two log-probabilities are the same sums (in packed rows too), so every
    step's loss is ln 2 and the gradient cancels to float noise (relative 1e-6 of a real step's)."""
    real = runs["1x1_packed"]["history"][0]["grad_norm"]
    for record in runs["1x1_equal"]["history"]:
        assert record["loss"] == LN2
        assert record["grad_norm"] < 1e-6 * real, record["grad_norm"]


@pytest.mark.slow
def test_resumed_on_another_mesh_continues_the_uninterrupted_curve(runs):
    """A dp_shard 4 run checkpointed at step 2, whose later steps are thrown away (what a kill after
    that checkpoint leaves; killing and rerunning through the launcher is test_lifecycle's), rerun from
    there in the same folder at tp 2 × dp 2: its steps equal the uninterrupted dp_shard 4 run's (dtrain
    against dtrain: the reference is the run not interrupted, itself TRL's), and the reference table is
    read, not computed again (from a policy that has moved: the curve would leave)."""
    resumed, whole = runs["resumed"], runs["dp4_sigmoid"]["history"]
    assert resumed["table_unchanged"]
    assert [record["step"] for record in resumed["history"]] == list(range(1, STEPS + 1))
    expected = {key: [record[key] for record in whole] for key in whole[0]}
    for step, record in enumerate(resumed["history"]):
        assert_step_close(record, expected, step, "resumed")


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
        "example 1: key 'rejected' is missing or null",
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
