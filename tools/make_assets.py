"""Regenerate dtrain's embedded default assets: a tiny SFT dataset, preference pairs on the same
tasks (dtrain.dpo's), prompts with their solutions (dtrain.grpo's), and a tokenizer.

dtrain ships these so that training, tests and smoke runs work offline with no
Hugging Face hub access. The dataset mixes four simple deterministic tasks that
a ~3M-parameter model can visibly learn in ~100 steps; the tokenizer is a
byte-level BPE (vocab exactly 1024) trained on that dataset, with a chat
template whose ``{% generation %}`` block marks the assistant tokens.

Everything is seeded, so ``python tools/make_assets.py`` rewrites byte-identical
files under ``dtrain/assets/``.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SEED = 1234
ROWS_PER_TASK = 1000
VOCAB_SIZE = 1024
ASSETS = Path(__file__).resolve().parent.parent / "dtrain" / "assets"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, SYSTEM, END]

CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'system' -%}\n"
    "<|system|>{{ message['content'] }}<|end|>\n"
    "{%- elif message['role'] == 'user' -%}\n"
    "<|user|>{{ message['content'] }}<|end|>\n"
    "{%- elif message['role'] == 'assistant' -%}\n"
    "<|assistant|>{% generation %}{{ message['content'] }}<|eos|>{% endgeneration %}\n"
    "{%- else -%}\n"
    "{{- raise_exception('unknown role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}\n"
)

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
SYLLABLES = [c + v for c in CONSONANTS for v in VOWELS]


def _letters(rng: random.Random, lo: int, hi: int) -> list[str]:
    """Draw between ``lo`` and ``hi`` random lowercase letters."""
    return [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi))]


def _word(rng: random.Random) -> str:
    """A pronounceable pseudo-word of 1-3 consonant-vowel syllables."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))


def task_reverse(rng: random.Random) -> tuple[str, str]:
    """Reverse space-separated letters (one token per letter)."""
    xs = _letters(rng, 3, 8)
    return "reverse: " + " ".join(xs), " ".join(reversed(xs))


def task_sort(rng: random.Random) -> tuple[str, str]:
    """Sort space-separated letters alphabetically."""
    xs = _letters(rng, 3, 8)
    return "sort: " + " ".join(xs), " ".join(sorted(xs))


def task_add(rng: random.Random) -> tuple[str, str]:
    """Add two numbers below 100 (digits are tokenized one by one)."""
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add: {a} + {b}", str(a + b)


def task_upper(rng: random.Random) -> tuple[str, str]:
    """Uppercase one to three pseudo-words."""
    words = " ".join(_word(rng) for _ in range(rng.randint(1, 3)))
    return "uppercase: " + words, words.upper()


TASKS = [task_reverse, task_sort, task_add, task_upper]


def make_rows(rng: random.Random) -> list[dict[str, str]]:
    """Build ``ROWS_PER_TASK`` rows per task, shuffled, with no duplicate prompts."""
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for task in TASKS:
        made, tries = 0, 0
        while made < ROWS_PER_TASK and tries < 50 * ROWS_PER_TASK:
            tries += 1
            prompt, response = task(rng)
            if prompt in seen:
                continue
            seen.add(prompt)
            rows.append({"prompt": prompt, "response": response})
            made += 1
    rng.shuffle(rows)
    return rows


def make_tokenizer(rows: list[dict[str, str]]) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with exactly ``VOCAB_SIZE`` entries on the rows."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [t for row in rows for t in (row["prompt"], row["response"])]
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"BPE gave {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END],
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def wrong_answer(rng: random.Random, row: dict[str, str]) -> str:
    """A plausible wrong response to the row's prompt: the right one with two tokens swapped, or
    another number, or the wrong case (never the right one)."""
    right = row["response"]
    parts = right.split(" ")
    if row["prompt"].startswith("add:"):
        return str(int(right) + rng.choice([-10, -1, 1, 10]))
    if row["prompt"].startswith("uppercase:"):
        return right.lower()
    i, j = rng.sample(range(len(parts)), 2)
    parts[i], parts[j] = parts[j], parts[i]
    wrong = " ".join(parts)
    return wrong if wrong != right else " ".join(reversed(sorted(parts)))


def make_preference_rows(rng: random.Random, rows: list[dict[str, str]], count: int) -> list[dict]:
    """dtrain.dpo's embedded pairs: the first `count` prompts as chat messages, the right response
    chosen, a wrong one (wrong_answer) rejected (TRL's explicit-prompt conversational format)."""
    pairs = []
    for row in rows[:count]:
        wrong = wrong_answer(rng, row)
        if wrong == row["response"]:
            continue
        pairs.append(
            {
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "chosen": [{"role": "assistant", "content": row["response"]}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return pairs


def make_prompt_rows(rows: list[dict[str, str]], count: int) -> list[dict]:
    """dtrain.grpo's embedded prompts: the first `count` prompts as chat messages, each with its right
    response as `solution` (TRL's prompt-only conversational format; the reward functions get the
    column)."""
    return [
        {"prompt": [{"role": "user", "content": row["prompt"]}], "solution": row["response"]}
        for row in rows[:count]
    ]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    """Write ``sft_tiny.jsonl``, ``dpo_tiny.jsonl``, ``grpo_tiny.jsonl`` and the tokenizer of
    ``tiny_llama/`` under ``dtrain/assets``."""
    rng = random.Random(SEED)
    rows = make_rows(rng)
    ASSETS.mkdir(parents=True, exist_ok=True)
    write_jsonl(ASSETS / "sft_tiny.jsonl", rows)
    write_jsonl(ASSETS / "dpo_tiny.jsonl", make_preference_rows(random.Random(SEED + 1), rows, 512))
    write_jsonl(ASSETS / "grpo_tiny.jsonl", make_prompt_rows(rows, 1024))
    model_dir = ASSETS / "tiny_llama"  # its config.json (the architecture) is kept as it is
    for p in model_dir.glob("*"):
        if p.name != "config.json":
            p.unlink()
    make_tokenizer(rows).save_pretrained(str(model_dir))
    print(f"wrote {len(rows)} rows and a {VOCAB_SIZE}-token tokenizer to {ASSETS}")


if __name__ == "__main__":
    main()
