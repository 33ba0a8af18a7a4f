"""tests/distill_reference.py is faithful: TRL 1.16's trainers as it runs them compute what the
divergence by hand computes, on the tokens the tokenizer's own chat template gives.

- The divergence alone: `dense_divergence` (TRL's generalized_jsd_loss) equals the generalized JSD
  written out with torch.softmax on full logits in float64 (values and gradients, each beta, T 1 and
  2), and `chunked_divergence` (DistillationTrainer's chunked kernel on hidden states and heads of two
  widths) equals the dense one.
- Tokens: GKD scores what follows the prompt rendered with the generation prompt, token for token
  (the template's text after the end-of-turn token included); the replaced sampling feeds each
  prompt's fixed completion (text + EOS) and nothing else, and the normaliser counts those tokens.
- Runs: step 1 of each trainer (student 2 layers wide 64, teacher 3 layers wide 96, one micro-batch)
  equals the divergence by hand over each record alone through `from_pretrained` models (loss and
  float64 grad norm, RTOL), for beta 0, 0.5, 1 at T = 2; a LoRA student from given non-zero adapters
  likewise through PEFT; student = teacher gives a zero loss for every beta; the curves and weights
  move; GKD untouched ignores its temperature; offline GKD (T patched in) and the on-policy trainer
  on the same tokens give the same curves.

Tolerance: the error model's RTOL (tests/tolerance.py) on what one step computes; the hand
computation differs from TRL's only in summation order and precision (float64 here). The teacher is
built with initializer_range 0.2, so its distributions are peaked and the divergences are O(0.1-1):
a KL is a difference of log-normaliser-sized terms (~log V = 6.9 here), whose fp32 noise (~1e-6
absolute a token) would be a large fraction of a near-zero KL between two near-uniform random models
(measured 7e-6 relative between TRL's two implementations at beta 1 with a default-initialised
teacher); here it sits far below RTOL. Student = teacher: the loss is a sum of terms each zero in
exact arithmetic, allowed RTOL · log V (the log-probabilities' noise) per token.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests import distill_reference as ref
from tests.test_parity import reference_cache_dir
from tests.tolerance import RTOL, assert_close, assert_scalar_close

TOKENIZER = Path(__file__).resolve().parents[1] / "dtrain" / "assets" / "tiny_llama"
VOCAB = 1024
STEPS, BATCH, LR = 2, 4, 1e-3
RECIPE = ref.Recipe(steps=STEPS, batch=BATCH, lr=LR)
BETAS = (0.0, 0.5, 1.0)
T = 2.0
# A template that puts text after the end-of-turn token (as ChatML's "<|im_end|>\n"), with this
# tokenizer's own special tokens.
NEWLINE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|user|>{{ message['content'] }}<|end|>{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}<|eos|>{{ '\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def save_llama(folder: Path, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    tiny = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(LlamaConfig(**(tiny | config))).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, response) pairs of very different lengths (1 to 12 letters), so a batch pads."""
    rng = random.Random(seed)

    def word(lo: int, hi: int) -> str:
        return " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(lo, hi)))

    return [(f"sort: {word(1, 6)}", word(1, 12)) for _ in range(count)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_reference")
    wide = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6)
    return {
        "student": save_llama(root / "student", seed=0),
        "teacher": save_llama(root / "teacher", seed=1, num_key_value_heads=2, initializer_range=0.2, **wide),
        "pairs": pairs(STEPS * BATCH),
    }


def gkd_records(inputs) -> list[dict]:
    return [ref.as_messages(prompt, response) for prompt, response in inputs["pairs"]]


def distillation_records(inputs) -> list[dict]:
    return [ref.as_prompt(prompt, response) for prompt, response in inputs["pairs"]]


def template_rows(tokenizer, pairs_: list[tuple[str, str]]) -> list[dict]:
    """The tokenizer's own chat template: each pair's prompt rendered with the generation prompt and
    the whole conversation, as token ids; the completion is the whole's tail after the prompt."""
    rows = []
    for prompt, response in pairs_:
        messages = ref.as_messages(prompt, response)["messages"]
        head = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True)
        whole = tokenizer.apply_chat_template(messages, tokenize=True)
        head, whole = list(head["input_ids"]), list(whole["input_ids"])
        assert whole[: len(head)] == head, (head, whole)  # no token straddles the seam here
        rows.append({"prompt_ids": head, "completion_ids": whole[len(head) :]})
    return rows


# ---------------------------------------------------------------------------------------------------
# The divergence by hand


def divergence_by_hand(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float):
    """Each position's generalized JSD from torch.softmax over full logits, in float64: beta 0
    KL(teacher || student), 1 KL(student || teacher), else beta KL(t || m) + (1 - beta) KL(s || m),
    m = (1 - beta) p_s + beta p_t."""
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0:
        return kl(p_t, p_s)
    if beta == 1:
        return kl(p_s, p_t)
    mixture = (1 - beta) * p_s + beta * p_t
    return beta * kl(p_t, mixture) + (1 - beta) * kl(p_s, mixture)


def random_logits(seed: int, shape=(2, 5, VOCAB), scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * scale


@pytest.mark.slow  # imports TRL's trainers (~5 s)
@pytest.mark.parametrize("temperature", (1.0, T))
@pytest.mark.parametrize("beta", (0.0, 0.25, 0.5, 1.0))
def test_dense_divergence_is_the_divergence_by_hand(beta, temperature):
    """Values (the reduced loss and each token's) and the student logits' gradient of TRL's
    generalized_jsd_loss equal the formula written out; masked positions add nothing."""
    student, teacher = random_logits(0).requires_grad_(), random_logits(1)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    by_hand = divergence_by_hand(student, teacher, beta, temperature) * mask
    expected = by_hand.sum() / mask.sum()
    (expected_grad,) = torch.autograd.grad(expected, student)

    loss = ref.dense_divergence(student, teacher, mask, beta, temperature)
    (grad,) = torch.autograd.grad(loss, student)
    assert_scalar_close(loss.item(), expected.item(), f"beta {beta} T {temperature} loss")
    assert_close(grad, expected_grad.float(), RTOL * expected_grad.abs().max().item(), "gradient")
    per_token = ref.dense_divergence_per_token(student.detach(), teacher, mask, beta, temperature)
    assert_close(per_token, by_hand.detach().float(), RTOL * by_hand.abs().max().item(), "per token")
    assert (per_token[~mask] == 0).all()
    halved = ref.dense_divergence(student, teacher, mask, beta, temperature, num_items=2 * mask.sum())
    assert_scalar_close(halved.item(), expected.item() / 2, "num_items divides the sum")
    assert loss.item() > 0.1  # the two distributions are far apart: a real divergence


@pytest.mark.slow  # imports TRL's trainers
def test_the_mixed_divergence_vanishes_towards_the_ends():
    """TRL's special cases are discontinuous: beta 0 and 1 are the two KLs, but the mixed formula
    tends to 0 at both ends (KL is convex in its second argument, so JSD(beta) <= beta (1 - beta)
    (KL(t || s) + KL(s || t))), so an implementation must branch on beta == 0 and beta == 1 exactly
    as TRL does, not evaluate the mixture there."""
    student, teacher = random_logits(0), random_logits(1)
    mask = torch.ones(student.shape[:-1], dtype=torch.bool)
    forward = ref.dense_divergence(student, teacher, mask, 0.0).item()
    reverse = ref.dense_divergence(student, teacher, mask, 1.0).item()
    assert forward > 1 and reverse > 1
    for beta in (1e-3, 1 - 1e-3):
        mixed = ref.dense_divergence(student, teacher, mask, beta).item()
        assert 0 < mixed <= beta * (1 - beta) * (forward + reverse) * (1 + RTOL), (beta, mixed)


@pytest.mark.slow  # imports TRL's trainers
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_divergence_is_the_dense_one(beta):
    """DistillationTrainer's loss function on hidden states of two widths (8 and 12) and their heads
    gives the dense divergence of the logits they make: the loss, its gradients for the student's
    hidden states and head, and the student's entropy; right-padding positions add nothing."""
    generator = torch.Generator().manual_seed(2)
    hidden_s = torch.randn(2, 5, 8, generator=generator).requires_grad_()
    head_s = (torch.randn(VOCAB, 8, generator=generator) * 0.5).requires_grad_()
    hidden_t, head_t = torch.randn(2, 5, 12, generator=generator), torch.randn(VOCAB, 12, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)

    logits_s, logits_t = hidden_s @ head_s.T, hidden_t @ head_t.T
    dense = ref.dense_divergence(logits_s, logits_t, mask, beta, T, num_items=7)
    dense_grads = torch.autograd.grad(dense, (hidden_s, head_s))
    loss, entropy, count = ref.chunked_divergence(
        hidden_s, head_s, hidden_t, head_t, mask, beta, T, num_items=7
    )
    grads = torch.autograd.grad(loss, (hidden_s, head_s))

    assert int(count) == 8
    assert_scalar_close(loss.item(), dense.item(), f"beta {beta} loss")
    for got, want, name in zip(grads, dense_grads, ("hidden", "head"), strict=True):
        assert_close(got, want, RTOL * want.abs().max().item(), f"beta {beta} {name} gradient")
    p = torch.softmax(logits_s.detach().double() / T, -1)
    by_hand = -(p * p.log()).sum(-1)[mask].sum()
    assert_scalar_close(entropy.item(), by_hand.item(), "entropy")


# ---------------------------------------------------------------------------------------------------
# Tokens


def test_completion_ids_are_what_sampling_returns():
    """Text + EOS; cut to max_completion_length without EOS (a truncated sample); ids as given; an EOS
    before the end (sampling stops at the first) or an empty completion refused."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    text = tokenizer("a b c", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert ref.completion_ids(tokenizer, "a b c", 16) == [*text, eos]
    assert ref.completion_ids(tokenizer, "a b c", len(text)) == text
    assert ref.completion_ids(tokenizer, [5, 6, eos], 3) == [5, 6, eos]
    for bad in ([5, eos, 6], []):
        with pytest.raises(ValueError):
            ref.completion_ids(tokenizer, bad, 16)
    with pytest.raises(ValueError):
        ref.completion_ids(tokenizer, [5, 6, 7], 2)


@pytest.mark.slow  # imports TRL's trainers
def test_gkd_scores_what_follows_the_generation_prompt(tmp_path):
    """GKD's scored tokens are the whole conversation's tokens after the prompt rendered with the
    generation prompt: with the tiny template the answer and <|eos|> (its {% generation %} span),
    with a template that writes "\\n" after the end-of-turn token that "\\n" too; an empty answer is
    kept and scores <|eos|> alone."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    newline = tmp_path / "newline"
    tokenizer.chat_template = NEWLINE_TEMPLATE
    tokenizer.save_pretrained(newline)
    records = [*pairs(4), ("sort: b", "")]
    for folder, tail in ((TOKENIZER, "<|eos|>"), (newline, "<|eos|>\n")):
        template = AutoTokenizer.from_pretrained(folder)
        rows = ref.gkd_tokenized(folder, [ref.as_messages(p, r) for p, r in records])
        for row, expected, (_, response) in zip(rows, template_rows(template, records), records, strict=True):
            assert row["input_ids"] == expected["prompt_ids"] + expected["completion_ids"]
            assert row["scored"] == expected["completion_ids"]
            assert template.decode(row["scored"]) == response + tail


# ---------------------------------------------------------------------------------------------------
# Runs


def hand_step(student, teacher, rows: list[dict], beta: float, temperature: float) -> tuple[float, float]:
    """Step 1 without a trainer: each row alone (positions from 0, no padding) through the models,
    the divergence by hand at every completion token, summed over the step and divided by the
    step's completion-token count; (loss, the student gradients' norm in float64)."""
    count = sum(len(row["completion_ids"]) for row in rows)
    student.zero_grad()
    total = 0.0
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
        scored = slice(len(row["prompt_ids"]) - 1, ids.shape[1] - 1)  # the logits that predict them
        with torch.no_grad():
            teacher_logits = teacher(ids).logits[0, scored]
        loss = (
            divergence_by_hand(student(ids).logits[0, scored], teacher_logits, beta, temperature).sum()
            / count
        )
        loss.backward()
        total += loss.item()
    norm = sum(p.grad.double().pow(2).sum() for p in student.parameters() if p.grad is not None).sqrt()
    return total, norm.item()


def expected_rows(inputs) -> list[dict]:
    """Both trainers' rows on the tiny template: the template's prompt with the generation prompt and
    the answer + <|eos|> (GKD: what follows the prompt; on-policy: the text + EOS)."""
    return template_rows(AutoTokenizer.from_pretrained(TOKENIZER), inputs["pairs"])


def run(kind: str, inputs, cache: Path, **settings) -> dict:
    records = gkd_records(inputs) if kind == "gkd" else distillation_records(inputs)
    runner = ref.cached_gkd_run if kind == "gkd" else ref.cached_distillation_run
    return runner(cache, inputs["student"], inputs["teacher"], records, RECIPE, **settings)


def models(inputs, lora: ref.Lora | None = None):
    student = AutoModelForCausalLM.from_pretrained(inputs["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(inputs["teacher"], dtype=torch.float32)
    if lora is not None:
        from peft import get_peft_model

        student = get_peft_model(student, lora.config())
        ref.load_adapters(student, lora)
    return student, teacher


def assert_trained_on(result: dict, kind: str, inputs) -> None:
    """Each step's rows are the step's records' template tokens (in any order: DistillationTrainer
    permutes a step's rows), and its normaliser their completion-token count."""
    rows = expected_rows(inputs)
    for step in range(STEPS):
        want = rows[step * BATCH : (step + 1) * BATCH]
        if kind == "gkd":
            got = [(row["input_ids"], row["scored"]) for row in result["batches"][step]]
            want = [(row["prompt_ids"] + row["completion_ids"], row["completion_ids"]) for row in want]
        else:
            got = [(row["prompt_ids"], row["completion_ids"]) for row in result["batches"][step]]
            want = [(row["prompt_ids"], row["completion_ids"]) for row in want]
        assert sorted(got) == sorted(want), f"step {step + 1}"
        assert result["tokens"][step] == sum(len(row[1]) for row in want if row)


@pytest.mark.slow  # a trainer run
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("kind", ("gkd", "distillation"))
def test_step_one_is_the_divergence_by_hand(inputs, tmp_path_factory, kind, beta):
    """At T = 2 (GKD: T passed to its loss function), a teacher wider and deeper than the student:
    step 1's loss and grad norm equal hand_step over the template's tokens, each step trains on its
    records' tokens, and the curve and the learning rate move."""
    result = run(kind, inputs, reference_cache_dir(tmp_path_factory), beta=beta, temperature=T)
    loss, norm = hand_step(*models(inputs), expected_rows(inputs)[:BATCH], beta, T)
    assert_scalar_close(result["loss"][0], loss, f"{kind} beta {beta} step 1 loss")
    assert_scalar_close(result["grad_norm_fp64"][0], norm, f"{kind} beta {beta} step 1 grad norm")
    assert_scalar_close(result["grad_norm"][0], norm, f"{kind} beta {beta} TRL's logged grad norm")
    assert_trained_on(result, kind, inputs)
    assert abs(result["loss"][1] - result["loss"][0]) > 100 * RTOL * result["loss"][0]
    assert result["learning_rate"] == pytest.approx([LR, LR / 2], rel=1e-12)  # cosine, no warmup


@pytest.mark.slow  # trainer runs
@pytest.mark.parametrize("beta", BETAS)
def test_offline_and_on_policy_agree_on_the_same_tokens(inputs, tmp_path_factory, beta):
    """On the tiny template GKD's scored tokens are the fixed completions' tokens, so GKD at lmbda=0
    with T passed to its loss and DistillationTrainer (T applied natively, its chunked kernel) train
    the same: every step's loss and grad norm at RTOL (two TRL implementations of one objective)."""
    cache = reference_cache_dir(tmp_path_factory)
    gkd = run("gkd", inputs, cache, beta=beta, temperature=T)
    on_policy = run("distillation", inputs, cache, beta=beta, temperature=T)
    for step in range(STEPS):
        for key in ("loss", "grad_norm_fp64", "tokens"):
            assert_scalar_close(gkd[key][step], on_policy[key][step], f"beta {beta} step {step + 1} {key}")


@pytest.mark.slow  # a trainer run
def test_gkd_alone_ignores_its_temperature(inputs, tmp_path_factory):
    """GKDTrainer untouched at temperature 2 trains as at temperature 1 (its loss never receives T)."""
    cache = reference_cache_dir(tmp_path_factory)
    untouched = run("gkd", inputs, cache, beta=0.5, temperature=T, gkd_temperature_in_loss=False)
    loss, norm = hand_step(*models(inputs), expected_rows(inputs)[:BATCH], 0.5, 1.0)
    assert_scalar_close(untouched["loss"][0], loss, "step 1 loss at T = 1")
    assert_scalar_close(untouched["grad_norm_fp64"][0], norm, "step 1 grad norm at T = 1")
    divided, _ = hand_step(*models(inputs), expected_rows(inputs)[:BATCH], 0.5, T)
    assert abs(divided - loss) > 0.1 * loss  # T matters to the loss, so the check can fail


@pytest.mark.slow  # trainer runs
@pytest.mark.parametrize("kind", ("gkd", "distillation"))
def test_student_equal_to_teacher_gives_zero_loss(inputs, kind):
    """The teacher is the student's own folder: step 1's loss is 0 for every beta (within each
    token's log-probability noise)."""
    records = gkd_records(inputs) if kind == "gkd" else distillation_records(inputs)
    runner = ref.gkd_run if kind == "gkd" else ref.distillation_run
    one_step = ref.Recipe(steps=1, batch=BATCH, lr=LR)
    for beta in BETAS:
        result = runner(inputs["student"], inputs["student"], records, one_step, beta=beta, temperature=T)
        assert abs(result["loss"][0]) <= RTOL * math.log(VOCAB), f"beta {beta}: {result['loss']}"


@pytest.fixture(scope="module")
def lora(inputs) -> ref.Lora:
    """PEFT's adapters on every projection with non-zero A and B (so step 1 depends on both)."""
    from peft import get_peft_model

    peft_model = get_peft_model(models(inputs)[0], ref.Lora(r=4, alpha=8).config())
    generator = torch.Generator().manual_seed(3)
    adapters = {
        ref.saved_name(name): torch.randn(param.shape, generator=generator) * 0.1
        for name, param in peft_model.named_parameters()
        if "lora_" in name
    }
    return ref.Lora(r=4, alpha=8, adapters=adapters)


@pytest.mark.slow  # trainer runs
@pytest.mark.parametrize("kind", ("gkd", "distillation"))
def test_a_lora_student_starts_from_the_given_adapters(inputs, lora, tmp_path_factory, kind):
    """A LoRA student (beta 0.5, T 2): step 1 equals hand_step through PEFT's model with the given
    adapters; only the adapters train and all of them move; each has its AdamW allowance."""
    cache = reference_cache_dir(tmp_path_factory)
    result = run(kind, inputs, cache, beta=0.5, temperature=T, lora=lora, weights=True)
    loss, norm = hand_step(*models(inputs, lora), expected_rows(inputs)[:BATCH], 0.5, T)
    assert_scalar_close(result["loss"][0], loss, f"{kind} LoRA step 1 loss")
    assert_scalar_close(result["grad_norm_fp64"][0], norm, f"{kind} LoRA step 1 grad norm")
    assert set(result["params"]) == set(lora.adapters) == set(result["allowance"])
    for name, start in lora.adapters.items():
        assert not torch.equal(result["params"][name], start), name
        assert (result["allowance"][name] > 0).all(), name


def test_a_cached_run_is_computed_once_per_input(tmp_path, monkeypatch):
    """`cached` computes once, then loads; other settings or other bytes in a model folder compute
    again (the key hashes the files, not the folder's name)."""
    monkeypatch.delenv("REFERENCE_CACHE", raising=False)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    calls = []

    def compute():
        calls.append(1)
        return {"loss": [float(len(calls))]}

    first = ref.cached(tmp_path / "cache", "run", [folder], {"beta": 0.5}, compute)
    assert ref.cached(tmp_path / "cache", "run", [folder], {"beta": 0.5}, compute) == first
    assert len(calls) == 1
    ref.cached(tmp_path / "cache", "run", [folder], {"beta": 1.0}, compute)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    ref.cached(tmp_path / "cache", "run", [folder], {"beta": 0.5}, compute)
    assert len(calls) == 3
