"""dtrain.distill against TRL 1.16's distillation (tests/distill_reference.py: no dtrain code) and, for
what TRL does not have, against the divergence written out on Hugging Face models.

- The fused divergence alone (dtrain/fused_divergence.py) against TRL's dense `generalized_jsd_loss`
  on full logits in float64 (values, the student's hidden-state and head gradients, the NLL and
  entropy figures): each beta on tp 1 (here), 2 and 4 (sequence-sharded hidden states and replicated
  ones, a padded vocabulary), with a temperature, the NLL term, Gemma's softcap and Granite's scale;
  and its memory on fake tensors: one chunk's buffers, not the sequence's logits.
- Offline training (distill.on_policy=0) against GKDTrainer at lmbda=0 with T = 2 passed to its loss:
  every step's loss and grad norm for beta 0, 0.5, 1 on 1×1, packed rows, dp 4, tp 2 × dp 2 with
  accumulation (sequence parallel), cp 2 × tp 2 on packed rows, and a LoRA student (TRL with PEFT,
  from dtrain's initial adapters); the teacher is wider and deeper than the student in every run.
  The tokens are GKD's own, token for token.
- On-policy training (distill.on_policy=1) against DistillationTrainer with its sampling replaced by
  fixed completions (rollout.engine=file replays the same texts: their tokens + EOS, cut to
  max_completion_length without it): every step's loss, grad norm, completion-token count and the
  student's entropy, on 1×1 (beta 0, 0.5, 1), tp 2 × dp 2 with accumulation and cp 2 × tp 2 packed.
- Sampled steps (distill.on_policy=0.5, rollout.engine=hf): which steps sample is the seeded draw, and
  the run's curve is the same on 1×1 and tp 2 × dp 2 (dtrain against dtrain: TRL draws its mixture
  per micro-batch from Python's RNG and samples with its own, so no TRL run can give these steps).
- distill.sft_weight: step 1 against the divergence + NLL computed by hand through `from_pretrained`.
- A QLoRA student runs with its NF4 base (CPU fp32: that it runs and the NF4 path is taken).
- Bad inputs: one line, exit 2.

Tolerance: the error model's RTOL (tests/tolerance.py) per step on loss and grad norm (TRL's float64
norm). The teacher has initializer_range 0.2, so the divergences are O(0.1) and the fp32 noise of the
log-normalisers they are differences of (~1e-7 · log V a token) stays far below RTOL (notes of
tests/test_distill_reference.py). Gradients of the divergence alone: RTOL of the largest element.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from dtrain.config import DataConfig
from dtrain.data.pipeline import prepare
from dtrain.fused_divergence import Divergence, Logits, fused_divergence
from tests import distill_reference as ref
from tests.helpers import run, run_worker
from tests.test_distill_reference import pairs, save_llama
from tests.test_parity import reference_cache_dir
from tests.tolerance import RTOL, assert_close, assert_scalar_close
from tests.workers.distill_runs import (
    CHUNK,
    DIVERGENCE_CASES,
    GLOBAL_BATCH,
    LR,
    MAX_LEN,
    SCENARIOS,
    STEPS,
    VOCAB,
    T,
    divergence_inputs,
)

RECIPE = ref.Recipe(steps=STEPS, batch=GLOBAL_BATCH, lr=LR)
WIDE = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6)
VOCAB_OF_THE_PAIR = 1024  # tests/test_distill_reference.py's save_llama


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    couples = pairs(STEPS * GLOBAL_BATCH)
    records = [ref.as_messages(prompt, response) for prompt, response in couples]
    on_policy = [ref.as_prompt(prompt, response) for prompt, response in couples]
    files = {
        "path": records,
        "prompts": [{"prompt": record["prompt"]} for record in on_policy],
        "rollouts": [
            {"prompt": record["prompt"], "completions": [record["completion"]]} for record in on_policy
        ],
    }
    for name, lines in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {
        "student": save_llama(root / "student", seed=0),
        "teacher": save_llama(root / "teacher", seed=1, num_key_value_heads=2, initializer_range=0.2, **WIDE),
        "records": records,
        "on_policy": on_policy,
        **{name: root / f"{name}.jsonl" for name in files},
    }


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill_runs")
    args = ["--out", str(out), "--student", str(inputs["student"]), "--teacher", str(inputs["teacher"])]
    args += ["--records", str(inputs["path"]), "--prompts", str(inputs["prompts"])]
    args += ["--rollouts", str(inputs["rollouts"])]
    # while developing: DTRAIN_DISTILL_ONLY=1x1_b0.5,tp2_dp2_b0.5 runs only those (the other tests fail)
    args += ["--only", os.environ.get("DTRAIN_DISTILL_ONLY", "")]
    for nproc in (1, 4):
        result = run_worker(nproc, "distill_runs", *args, timeout=1200)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


# ---------------------------------------------------------------------------------------------------
# The divergence alone


def post_processed(logits: torch.Tensor, how: Logits) -> torch.Tensor:
    """A family's logits as its HF forward makes them: scaled (Granite's 1 / logits_scaling), then
    softcapped (Gemma's softcap · tanh(logits / softcap))."""
    logits = logits * how.scale
    return how.softcap * torch.tanh(logits / how.softcap) if how.softcap else logits


def dense_reference(inputs: dict, case: tuple) -> dict:
    """TRL's dense divergence (+ weight × the cross-entropy at T = 1) on the full logits, in float64:
    the summed loss, its figures and autograd's gradients for the student's hidden states and head."""
    _, _, beta, temperature, weight, student, teacher = case
    hidden = inputs["hidden"].double().requires_grad_()
    head = inputs["head"][:VOCAB].double().requires_grad_()
    labels = inputs["labels"]
    mask = labels != -100
    logits = post_processed(hidden @ head.T, student)
    teacher_logits = post_processed(
        inputs["teacher_hidden"].double() @ inputs["teacher_head"][:VOCAB].T.double(), teacher
    )
    divergence = ref.dense_divergence(logits, teacher_logits, mask, beta, temperature, num_items=1)
    nll = F.cross_entropy(logits[mask], labels[mask], reduction="sum")
    loss = divergence + weight * nll
    grad_hidden, grad_head = torch.autograd.grad(loss, (hidden, head))
    probs = torch.softmax(logits.detach() / temperature, -1)
    entropy = -(probs * probs.log()).sum(-1)[mask].sum()
    return {
        "loss": loss.item(),
        "sums": [divergence.item(), nll.item() if weight else 0.0, entropy.item()],
        "grad_hidden": grad_hidden,
        "grad_head": grad_head,
    }


def assert_divergence_close(got: dict, want: dict, what: str) -> None:
    assert_scalar_close(got["loss"], want["loss"], f"{what} loss")
    for name, got_value, want_value in zip(
        ("divergence", "nll", "entropy"), got["sums"], want["sums"], strict=True
    ):
        assert_scalar_close(got_value, want_value, f"{what} {name}")
    for name in ("grad_hidden", "grad_head"):
        expected = want[name].float()
        actual = got[name][: expected.shape[0]]
        assert_close(actual, expected, RTOL * expected.abs().max().item(), f"{what} {name}")
        assert (got[name][expected.shape[0] :] == 0).all(), f"{what}: a padded head row got a gradient"


TP1_CASES = {
    f"b{beta:g}{suffix}": (1, False, beta, temperature, weight, how, how)
    for beta in (0.0, 0.5, 1.0)
    for suffix, temperature, weight, how in (
        ("", 1.0, 0.0, Logits()),
        ("_T2_nll", T, 0.3, Logits()),
        ("_T0.7_softcap", 0.7, 0.0, Logits(2.0, 3.0)),
    )
}


@pytest.mark.slow  # imports TRL's trainers (~5 s)
@pytest.mark.parametrize("name", sorted(TP1_CASES))
def test_the_fused_divergence_is_trls_dense_one_on_one_rank(name):
    """tp 1: the loss, the divergence / NLL / entropy sums and both gradients against TRL's dense
    divergence in float64; the mixture and the reverse KL's gradients, with their row sums, included."""
    case = TP1_CASES[name]
    inputs = divergence_inputs(1)
    _, _, beta, temperature, weight, student, teacher = case
    hidden = inputs["hidden"].clone().requires_grad_()
    head = inputs["head"].clone().requires_grad_()
    settings = Divergence(beta, temperature, weight, student, teacher)
    loss, sums = fused_divergence(
        hidden,
        head,
        inputs["teacher_hidden"],
        inputs["teacher_head"],
        inputs["labels"],
        settings,
        CHUNK,
        VOCAB,
    )
    loss.backward()
    got = {"loss": loss.item(), "sums": sums.tolist(), "grad_hidden": hidden.grad, "grad_head": head.grad}
    want = dense_reference(inputs, case)
    assert want["sums"][0] > 1.0  # the two distributions are far apart: a real divergence
    assert_divergence_close(got, want, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DIVERGENCE_CASES))
def test_the_fused_divergence_on_tp_2_and_4_is_trls_dense_one(runs, name):
    """tp 2 and 4 (tests/workers/distill_runs.py), hidden states sequence-sharded or replicated, the
    vocabulary padded: as on one rank, the gradients gathered whole."""
    case = DIVERGENCE_CASES[name]
    assert_divergence_close(
        runs[f"divergence_{name}"], dense_reference(divergence_inputs(case[0]), case), name
    )


@pytest.mark.slow  # ~300 chunks through the memory tracker
def test_the_divergence_memory_is_one_chunk_not_the_sequence():
    """On fake tensors (the planner's way: no values, every row projected), the divergence's forward
    and backward hold at most five fp32 chunks of logits (scored rows × vocabulary) beyond its inputs
    and the gradients it returns: the same for a sequence 4× longer, whose full logits (both models)
    are more than 12× that; a 4× vocabulary takes 4× the chunk, no more."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def transient(vocab: int, seq: int, chunk: int = 64, rows: int = 2) -> int:
        with FakeTensorMode():
            hidden, head = (
                torch.randn(rows, seq, 64).requires_grad_(),
                torch.randn(vocab, 64).requires_grad_(),
            )
            teacher_hidden, teacher_head = torch.randn(rows, seq, 96), torch.randn(vocab, 96)
            labels = torch.randint(0, vocab, (rows, seq))
            tracker = MemTracker()
            tracker.track_external(hidden, head, teacher_hidden, teacher_head, labels)
            with tracker:
                loss, _ = fused_divergence(
                    hidden, head, teacher_hidden, teacher_head, labels, Divergence(0.5), chunk, vocab
                )
                loss.backward()
            peak, current = (
                sum(int(value) for snapshot in tracker.get_tracker_snapshot(kind).values()
                    for key, value in snapshot.items() if str(key) == "Total")
                for kind in ("peak", "current")
            )  # fmt: skip
        return peak - current

    chunk_bytes = 2 * 64 * 2048 * 4
    short, long = transient(2048, 512), transient(2048, 2048)
    assert short == long  # nothing grows with the sequence
    assert chunk_bytes < long <= 5 * chunk_bytes, long / chunk_bytes
    assert 2 * (2 * 2048 * 2048 * 4) > 12 * long  # the full logits of both models, at the long sequence
    assert transient(8192, 512) <= 5 * 4 * chunk_bytes


# ---------------------------------------------------------------------------------------------------
# Training against TRL


def dtrain_rows(path: Path) -> list[dict[str, list[int]]]:
    data = DataConfig(path=str(path), format="prompt_completion", max_len=MAX_LEN)
    examples, _ = prepare(data, AutoTokenizer.from_pretrained(ref_tokenizer()), seed=0)
    return [{key: list(example[key]) for key in ("prompt_ids", "completion_ids")} for example in examples]


def ref_tokenizer() -> Path:
    from tests.helpers import TOKENIZER

    return TOKENIZER


@pytest.mark.slow  # TRL's collator
def test_the_scored_tokens_are_gkds_own(inputs, tmp_path):
    """GKD's own tokenization of each record (DataCollatorForChatML): the row's ids and the ids its loss
    scores are dtrain's prompt + completion and completion, token for token; with a template that writes
    text after the end-of-turn token, that text is scored too (and an empty answer keeps its tail)."""
    from tests.test_distill_reference import NEWLINE_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(ref_tokenizer())
    newline = tmp_path / "newline"
    tokenizer.chat_template = NEWLINE_TEMPLATE
    tokenizer.save_pretrained(newline)
    records = [*inputs["records"], ref.as_messages("sort: b", "")]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    for folder in (ref_tokenizer(), newline):
        expected = ref.gkd_tokenized(folder, records)
        data = DataConfig(path=str(path), format="prompt_completion", max_len=MAX_LEN)
        examples, _ = prepare(data, AutoTokenizer.from_pretrained(folder), seed=0)
        got = [{key: list(example[key]) for key in ("prompt_ids", "completion_ids")} for example in examples]
        assert [row["prompt_ids"] + row["completion_ids"] for row in got] == [
            row["input_ids"] for row in expected
        ]
        assert [row["completion_ids"] for row in got] == [row["scored"] for row in expected]


ALL = {**SCENARIOS[1], **SCENARIOS[4]}


def reference(inputs, runs, name: str, cache: Path) -> dict:
    """TRL's run of scenario `name`: GKDTrainer on the records (offline), or DistillationTrainer on the
    prompts with the fixed completions (on-policy); a LoRA student from dtrain's initial adapters."""
    _, overrides = ALL[name]
    settings = dict(beta=overrides["distill.beta"], temperature=T)
    if "lora.r" in overrides:
        adapters = runs[name]["adapters"]
        settings["lora"] = ref.Lora(r=overrides["lora.r"], alpha=overrides["lora.alpha"], adapters=adapters)
    models = inputs["student"], inputs["teacher"]
    if overrides.get("distill.on_policy") == 1.0:
        length = overrides["distill.max_completion_length"]
        return ref.cached_distillation_run(
            cache, *models, inputs["on_policy"], RECIPE, max_completion_length=length, **settings
        )
    return ref.cached_gkd_run(cache, *models, inputs["records"], RECIPE, **settings)


COMPARED = sorted(
    name for name, (_, overrides) in ALL.items()
    if "distill.sft_weight" not in overrides and overrides.get("lora.base_dtype") != "nf4"
    and overrides.get("rollout.engine") != "hf"
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPARED)
def test_every_step_matches_trl(inputs, runs, tmp_path_factory, name):
    """Every step's loss, grad norm and scored-token count equal TRL's (GKDTrainer at lmbda 0 with T 2
    in its loss; DistillationTrainer on the fixed completions, and its logged entropy) within the
    module's error model, on the scenario's mesh and split; TRL's curve moves."""
    expected = reference(inputs, runs, name, reference_cache_dir(tmp_path_factory))
    history = runs[name]["history"]
    assert [record["step"] for record in history] == list(range(1, STEPS + 1))
    assert (
        max(abs(loss - expected["loss"][0]) for loss in expected["loss"]) > 100 * RTOL * expected["loss"][0]
    )
    for step, record in enumerate(history):
        what = f"{name} step {step + 1}"
        assert record["tokens"] == expected["tokens"][step], what
        assert_scalar_close(record["loss"], expected["loss"][step], f"{what} loss")
        assert_scalar_close(record["grad_norm"], expected["grad_norm_fp64"][step], f"{what} grad norm")
        if "entropy" in expected:
            assert_scalar_close(record["entropy"], expected["entropy"][step], f"{what} entropy")


@pytest.mark.slow
def test_sampled_steps_are_the_seeded_draw_and_the_same_on_every_mesh(runs):
    """distill.on_policy=0.5 with the hf engine: the steps that sample are on_policy_step's draws from
    train.seed (at least one of each kind here), and 1×1 and tp 2 × dp 2 with accumulation train the
    same curve (each example's completion seeded by the seed, the step and its index), sampled steps
    included. dtrain against dtrain (the module's docstring says why)."""
    from dtrain.objectives.distill import on_policy_step

    one, four = runs["1x1_sampled"]["history"], runs["tp2_dp2_sampled"]["history"]
    flags = [record["on_policy"] for record in one]
    assert flags == [float(on_policy_step(0, step, 0.5)) for step in range(STEPS)] and 0 < sum(flags) < STEPS
    assert [record["on_policy"] for record in four] == flags
    for step, (a, b) in enumerate(zip(one, four, strict=True)):
        assert a["tokens"] == b["tokens"], step
        assert_scalar_close(b["loss"], a["loss"], f"step {step + 1} loss")
        assert_scalar_close(b["grad_norm"], a["grad_norm"], f"step {step + 1} grad norm")


@pytest.mark.slow
def test_sft_weight_adds_the_nll_of_the_datas_completions(inputs, runs):
    """distill.sft_weight=0.5 at beta 0.5, T 2: step 1's loss is the divergence (TRL's dense one over
    the step's scored tokens, the logits of `from_pretrained` models) plus 0.5 × the token-mean
    cross-entropy of the same tokens at T = 1, and its grad norm that of their sum; the logged
    divergence and nll_loss are its two terms."""
    student = AutoModelForCausalLM.from_pretrained(inputs["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(inputs["teacher"], dtype=torch.float32)
    rows = dtrain_rows(inputs["path"])[:GLOBAL_BATCH]
    count = sum(len(row["completion_ids"]) for row in rows)
    divergence = nll = 0.0
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
        scored = slice(len(row["prompt_ids"]) - 1, ids.shape[1] - 1)
        targets = ids[0, len(row["prompt_ids"]) :]
        with torch.no_grad():
            teacher_logits = teacher(ids).logits[0, scored]
        logits = student(ids).logits[0, scored]
        mask = torch.ones(len(targets), dtype=torch.bool)
        term = ref.dense_divergence(logits, teacher_logits, mask, 0.5, T, num_items=count)
        cross = F.cross_entropy(logits, targets, reduction="sum") / count
        (term + 0.5 * cross).backward()
        divergence, nll = divergence + term.item(), nll + cross.item()
    norm = sum(p.grad.double().pow(2).sum() for p in student.parameters()).sqrt().item()
    first = runs["1x1_sft"]["history"][0]
    assert_scalar_close(first["loss"], divergence + 0.5 * nll, "loss")
    assert_scalar_close(first["grad_norm"], norm, "grad norm")
    assert_scalar_close(first["divergence"], divergence, "divergence")
    assert_scalar_close(first["nll_loss"], nll, "nll_loss")
    assert nll > divergence  # the term is not negligible: the check can fail


@pytest.mark.slow
def test_a_qlora_student_runs_on_its_nf4_base(runs):
    """lora.base_dtype=nf4 (CPU fp32): every adapted base weight is NF4 and the run trains (its loss
    finite and moving)."""
    result = runs["1x1_qlora"]
    assert any(name.endswith("q_proj.weight") for name in result["nf4"]), result["nf4"]
    losses = [record["loss"] for record in result["history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[-1], losses


# ---------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.slow  # a process
def test_bad_input_fails_with_one_line_and_exit_code_2(inputs, tmp_path):
    """Each: the one-line message naming what is wrong, exit code 2 (dtrain.distill's main)."""
    from tests.helpers import one_interpreter_command

    other_vocab = save_llama(tmp_path / "vocab512", seed=2, vocab_size=512)
    gpt2 = tmp_path / "gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    bad = {
        "vocabulary": ([f"distill.teacher={other_vocab}"], "its vocabulary has 512 ids, the student's"),
        "no_teacher_folder": ([f"distill.teacher={tmp_path / 'nowhere'}"], "nowhere': no such folder"),
        "beta": (
            [f"distill.teacher={inputs['teacher']}", "distill.beta=1.5"],
            "distill.beta=1.5: must be in [0, 1]",
        ),
        "family_at_tp2": (
            [f"distill.teacher={gpt2}", "parallel.tp=2"],
            "model type 'gpt2' has no TP plan, so it runs with parallel.tp=1 only",
        ),
        "no_teacher": ([], "distill.teacher: required"),
        "file_without_path": (
            [f"distill.teacher={inputs['teacher']}", "distill.on_policy=1", "rollout.engine=file"],
            "rollout.engine=file: needs rollout.path",
        ),
    }
    commands = {}
    for name, (overrides, _) in bad.items():
        commands[name] = [
            f"model.name_or_path={inputs['student']}",
            f"data.path={inputs['path']}",
            f"hydra.run.dir={tmp_path / name}",
            "train.max_steps=1",
            "train.global_batch_size=2",
            "train.micro_batch_size=1",
            *overrides,
        ]
    world = dict.fromkeys(bad, 1) | {"family_at_tp2": 2}
    envs = {name: {"WORLD_SIZE": str(world[name]), "RANK": "0", "LOCAL_RANK": "0"} for name in commands}
    result = run(
        one_interpreter_command(tmp_path / "cli", commands, module="dtrain.distill", envs=envs), timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:]
    outcomes = json.loads((tmp_path / "cli" / "out.json").read_text())
    for name, (_, message) in bad.items():
        outcome = outcomes[name]
        errors = [line for line in outcome["stderr"].splitlines() if line.startswith("dtrain: error:")]
        assert outcome["returncode"] == 2, (name, outcome["stderr"][-2000:])
        assert len(errors) == 1 and message in errors[0], (name, errors)


# ---------------------------------------------------------------------------------------------------
# The planner


@pytest.mark.slow  # a plan on fake tensors
def test_the_planner_counts_the_teacher(inputs):
    """dtrain.estimate on the tiny pair (4 ranks, FSDP, bf16 as on GPUs): the frozen model it counts is
    the teacher's parameters (Hugging Face's own count of its folder's model) in bf16 over the 4 ranks
    (every dimension divides), beside the student's state; the step's peak includes it; the divergence's
    temporaries are probed, at most five fp32 chunks of logits, and no logits are materialized."""
    from dtrain.estimate.app import compose
    from dtrain.estimate.planner import plan

    overrides = [
        f"model.name_or_path={inputs['student']}",
        f"distill.teacher={inputs['teacher']}",
        f"data.path={inputs['path']}",
        "data.format=prompt_completion",
        f"data.max_len={MAX_LEN}",
        "estimate.world_size=4",
        "parallel.tp=1",
        "parallel.loss_chunk=8",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
    ]
    result = plan(compose(overrides), 4)
    teacher = AutoModelForCausalLM.from_pretrained(inputs["teacher"])
    assert result.objective == f"distill (teacher={inputs['teacher']})"
    assert result.step.reference == teacher.num_parameters() * 2 // 4
    assert result.step.peak > result.step.reference + result.step.params
    chunk_bytes = 2 * 8 * VOCAB_OF_THE_PAIR * 4  # micro batch × loss_chunk rows, fp32
    assert chunk_bytes < result.step.loss_temporaries <= 5 * chunk_bytes, (
        result.step.loss_temporaries / chunk_bytes
    )
    assert result.step.logits == 0


@pytest.mark.slow  # the bench's processes
def test_bench_prints_the_distillation_rows():
    """Smoke (no figure asserted: the bench prints them, docs/distill.md): `python -m dtrain.bench`'s
    distillation table has TRL's GKDTrainer and dtrain.distill 1×1 unpacked and packed, each scoring
    fewer tokens than it reads (the prompts), and the divergence's memory its four rows."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    command = [sys.executable, "-m", "dtrain.bench", "--seq", "16", "--steps", "1", "--warmup", "1"]
    command += ["--rounds", "1", "--meshes", "", "--hf-trainer", "0", "--lora-r", "0", "--moe", "0"]
    command += ["--dpo", "0", "--distill-records", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    rows = {
        line[:36].strip(): line[36:].split() for line in lines if line.startswith(("TRL", "dtrain.distill"))
    }
    assert list(rows) == ["TRL GKDTrainer (lmbda 0)", "dtrain.distill 1x1", "dtrain.distill 1x1 packed"], (
        lines
    )
    for name, (_, rate, scored, *_) in rows.items():
        assert 0 < float(scored) < float(rate), name
    memory = [line for line in lines if line.startswith(("  TRL", "  dtrain fused divergence"))]
    assert len(memory) == 4, result.stdout
