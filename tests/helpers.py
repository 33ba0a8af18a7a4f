"""Shared by the tests: tiny models saved with save_pretrained, the config for parity runs, and a
torchrun launcher that never hangs the suite."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import dtrain
from dtrain.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from dtrain.loss import IGNORE, loss_context, summed_cross_entropy

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "dtrain" / "assets"
DATASET = ASSETS / "sft_tiny.jsonl"
TOKENIZER = ASSETS / "tiny_llama"  # the embedded model folder: config.json and tokenizer, no weights


def dtrain_frames(output: str) -> list[str]:
    """The traceback lines of `output` in dtrain's own code: files under the repository's `dtrain`
    package folder, named by its path (as launched from ROOT, and as this process imported it), not
    by a `/dtrain/` anywhere in a path (a clone named dtrain/ holds its .venv, and so torch's and
    datasets' files, under one)."""
    packages = {str(ROOT / "dtrain"), str(Path(dtrain.__file__).parent)}
    pattern = "|".join(re.escape(package + os.sep) for package in sorted(packages))
    return re.findall(rf'File "(?:{pattern})[^"]*", line \d+', output)


# Small enough for 2 CPU cores; 4 heads and 4 KV heads so that tp=4 divides them.
TINY = dict(
    vocab_size=1024,
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
)
STEPS, GLOBAL_BATCH, MICRO_BATCH, MAX_LEN = 10, 16, 4, 32


def save_tiny_llama(folder: Path, tied: bool, seed: int = 0, max_shard_size: str = "5GB") -> Path:
    """A tiny HF Llama with random weights, written the way users' checkpoints are."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


# Each family's quirks on TINY: GQA everywhere; sliding windows shorter than MAX_LEN (Mistral on
# every layer, Qwen2 above max_window_layers, Gemma 3 on its local layers); Qwen2's q/k/v biases
# and tied small models; Qwen3's per-head q/k norms with an explicit head_dim; Gemma 3's four
# norms, tied head, scaled embedding, query_pre_attn_scalar and two rotary bases (one scaled).
FAMILIES = {
    "mistral": dict(num_key_value_heads=2, sliding_window=8),
    "qwen2": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    ),
    "qwen3": dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "gemma3_text": dict(
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    ),
    # OLMo 2: q/k norms over the whole width, of which each rank holds its heads' columns at tp=2
    "olmo2": dict(num_key_value_heads=2),
    # OLMo 3: the same with sliding-window layers
    "olmo3": dict(
        num_key_value_heads=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    ),
    # Phi-3: fused qkv_proj (GQA: q, k and v of different widths) and gate_up_proj
    "phi3": dict(num_key_value_heads=2, pad_token_id=2),
    # SmolLM3: Llama's modules, layer 1 without rotary (NoPE)
    "smollm3": dict(num_key_value_heads=2, no_rope_layers=[1, 0]),
    # Granite: embedding, residual, attention and logits multipliers (none of them 1), tied head
    "granite": dict(
        num_key_value_heads=2,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=2.0,
        tie_word_embeddings=True,
    ),
}
# HF initialises these to zero (biases; Gemma's (1 + weight) norms): random values make them matter.
_PERTURBED = {
    "qwen2": (".bias",),
    "gemma3_text": ("norm.weight",),
    "olmo2": ("norm.weight",),
    "olmo3": ("norm.weight",),
}


def save_tiny_family(folder: Path, model_type: str, seed: int = 0) -> Path:
    """A tiny HF model of another family (FAMILIES), saved like save_tiny_llama."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY, **FAMILIES[model_type]})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(_PERTURBED.get(model_type, ())):
                std = 0.02 if name.endswith(".bias") else 0.1
                param.add_(torch.randn_like(param) * std)  # ones + noise for the (weight) norms
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def parity_config(model_dir: Path | None, dp: int, tp: int) -> Config:
    """The run every mesh must reproduce: fp32, accumulation, clipping, decay, warmup + cosine."""
    model = (
        ModelConfig(name_or_path=str(model_dir), init="pretrained")
        if model_dir
        else ModelConfig(config=dict(model_type="llama", **TINY), init="random", tokenizer=str(TOKENIZER))
    )
    return Config(
        model=model,
        data=DataConfig(path=str(DATASET), max_len=MAX_LEN),
        # dense, not the default auto (fused where a plan exists): the tolerances of test_parity were
        # measured on it; fused equals dense within 1e-5 in test_fused_loss
        parallel=ParallelConfig(tp=tp, dp_shard=dp, loss_impl="dense"),
        optim=OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, schedule="cosine", warmup_steps=2),
        train=TrainConfig(
            max_steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, precision="fp32"
        ),
        checkpoint=CheckpointConfig(resume="never", save_final=False),
    )


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def fixed_batch() -> torch.Tensor:
    """Token ids for comparing logits with a Hugging Face reference."""
    return torch.arange(3 * MAX_LEN).reshape(3, MAX_LEN) * 7 % 1000


def packed_documents() -> tuple[torch.Tensor, torch.Tensor]:
    """One row of MAX_LEN tokens holding three documents (13, 11 and 8 tokens, each longer than or
    as long as the tiny sliding window): token ids and restarting position_ids, each [1, MAX_LEN]."""
    lengths = [13, 11, 8]
    ids = (torch.arange(MAX_LEN) * 11 + 5) % 1000
    positions = torch.cat([torch.arange(n) for n in lengths])
    return ids[None], positions[None]


# A token of chunk 3 of 8: at cp = 4 only cp rank 3 holds it; rank 0 holds chunks 0 and 7.
CROSS_RANK_TOKEN = 13


def cross_rank_row() -> list[dict[str, torch.Tensor]]:
    """One unpacked row of MAX_LEN tokens as a micro-batch, and the same row with CROSS_RANK_TOKEN
    changed: what rank 0's late tokens see of it is only what attention gathers from rank 3."""
    ids = fixed_batch()[:1]
    changed = ids.clone()
    changed[0, CROSS_RANK_TOKEN] = (changed[0, CROSS_RANK_TOKEN] + 1) % 1000
    return [
        {
            "input_ids": row,
            "labels": torch.cat([row[:, 1:], torch.full((1, 1), IGNORE)], dim=1),
            "position_ids": torch.arange(MAX_LEN)[None],
            "num_tokens": torch.tensor([MAX_LEN]),
        }
        for row in (ids, changed)
    ]


def sharded_model(config: Config, device: torch.device) -> torch.nn.Module:
    """The model exactly as the trainer builds it (on this process group), before any step."""
    from dtrain.checks import check_config
    from dtrain.distributed import build_parallel
    from dtrain.model import build_model, load_model_config

    model_config = load_model_config(config.model)
    shape = check_config(config, torch.distributed.get_world_size(), model_config)
    return build_model(model_config, config, build_parallel(shape, device), device)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered, a plain tensor (one process: no TP, no FSDP) as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of fixed_batch() from a sharded model, gathered."""
    ids = fixed_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(MAX_LEN).expand(len(ids), -1)).logits
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def worker_args() -> argparse.Namespace:
    """The command line of the torchrun workers under tests/workers/."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--untied", type=Path, required=True)
    parser.add_argument("--tied", type=Path, required=True)
    parser.add_argument("--families", type=Path, help="folder of save_tiny_family models, one per type")
    return parser.parse_args()


def worker(name: str) -> list[str]:
    """The arguments that run tests/workers/NAME.py as the module `tests.workers.NAME`, for torchrun
    or python: `-m` puts the working directory on sys.path, and run's is ROOT."""
    return ["-m", f"tests.workers.{name}"]


def torchrun(
    nproc: int, *args: str, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node=N ARGS` and return it (stdout+stderr in .stdout)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    return run(command, timeout=timeout, env=env)


def forked_command(nproc: int, module: str, *args: str) -> list[str]:
    """The command that runs MODULE's main() on `nproc` ranks of one gloo process group, forked after
    its imports (tests/workers/forked.py: torchrun's environment, without an interpreter's start-up
    per rank)."""
    return [sys.executable, "-m", "tests.workers.forked", str(nproc), module, *args]


def worker_command(nproc: int, name: str, *args: str) -> list[str]:
    """forked_command for tests/workers/NAME.py."""
    return forked_command(nproc, f"tests.workers.{name}", *args)


def sft(nproc: int, *overrides: str, timeout: float = 600, env: dict | None = None):
    """What `torchrun --standalone --nproc_per_node=N -m dtrain.sft OVERRIDES` runs in each rank
    (dtrain.sft's main(): Hydra's command line, the run, its exit code), in `nproc` ranks forked after
    one import: for tests of what a run does. Tests of the launch itself (torchrun's report of each
    worker's exit code, the ranks' log files, restarts, signals, the launch scripts) run torchrun.
    Returns it run to its end, stdout+stderr in .stdout."""
    return run(forked_command(nproc, "dtrain.sft", *overrides), timeout=timeout, env=env)


def run_worker(nproc: int, name: str, *args: str, timeout: float = 600, env: dict | None = None):
    """worker_command, run to its end: stdout+stderr in .stdout."""
    return run(worker_command(nproc, name, *args), timeout=timeout, env=env)


def worker_results(name: str, out: Path, *args: str, worlds: tuple[int, ...] = (1, 4)) -> dict[str, object]:
    """Launch tests/workers/NAME once per world size (run_worker; its arguments `args`), each writing
    `<out>/<scenario>.pt` from rank 0; those files loaded, by scenario."""
    for nproc in worlds:
        result = run_worker(nproc, name, "--out", str(out), *args, timeout=900)
        assert result.returncode == 0, f"{nproc} processes:\n{result.stdout[-6000:]}"
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


def one_interpreter_command(
    folder: Path,
    commands: dict[str, list[str]],
    module: str = "dtrain.sft",
    envs: dict[str, dict] | None = None,
) -> list[str]:
    """The command that runs `python -m MODULE ARGS` for each of `commands` ({name: args}; its
    environment updated with envs[name]) in one interpreter (tests/workers/cli_many), writing
    folder/out.json: {name: {"returncode", "stdout", "stderr", "output"}}."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = {name: {"args": args, "env": (envs or {}).get(name, {})} for name, args in commands.items()}
    (folder / "commands.json").write_text(json.dumps(entries))
    runner = [sys.executable, "-m", "tests.workers.cli_many", module]
    return [*runner, str(folder / "commands.json"), str(folder / "out.json")]


def run_in_one_interpreter(
    folder: Path, commands: dict[str, list[str]], world: int | dict[str, int] = 1, env: dict | None = None
) -> dict:
    """`python -m dtrain.sft ARGS` for each of `commands` in one interpreter (one_interpreter_command),
    as rank 0 of a `world`-process torchrun (WORLD_SIZE; `world` may give each command's): for
    commands refused before any process group, without an interpreter's start-up per message.
    {name: {"returncode", "output", ...}}."""
    worlds = world if isinstance(world, dict) else dict.fromkeys(commands, world)
    envs = {name: {"WORLD_SIZE": str(worlds[name]), "RANK": "0", "LOCAL_RANK": "0"} for name in commands}
    result = run(one_interpreter_command(folder, commands, envs=envs), timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((folder / "out.json").read_text())


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = ROOT):
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # tests/conftest.py's (DTRAIN_TEST_THREADS)
    full_env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(
        command,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def wandb_records(path: Path):
    """The records of a W&B transaction log (`run-*.wandb`): LevelDB's log format of 32 KiB blocks,
    each record a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a
    protobuf `Record`. Read independently of wandb's own (Go) reader."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", path
    position, pending = header, b""
    while position + header <= len(data):
        if block - position % block < header:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + header])
        pending += data[position + header : position + header + length]
        position += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def save_results(results: dict, out: Path) -> None:
    """A torchrun worker's end: rank 0 saves each scenario's results as OUT/NAME.pt (what the
    pytest side loads), then every rank leaves the process group together."""
    if torch.distributed.get_rank() == 0:
        for name, saved in results.items():
            torch.save(saved, out / f"{name}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# A user's own model and data, unlike the embedded default in every respect the front door must
# not leak: vocabulary (384), width, KV heads (2), tokenizer and special tokens, record keys.
USER_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{%- else -%}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
USER_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
USER_ARCHITECTURE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def user_rows(count: int = 32) -> list[dict[str, str]]:
    """question/response records (the OpenOrca keys), short enough for any max_len >= 64."""
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    return [
        {
            "question": f"what follows {words[i % 10]} {i}?",
            "response": f"{words[(i + 1) % 10]} {i + 1}, then {words[(i + 2) % 10]}.",
        }
        for i in range(count)
    ]


def write_user_dataset(path: Path, count: int = 32) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in user_rows(count)))
    return path


def user_tokenizer():
    """A byte-level BPE of 384 tokens trained on user_rows, with ChatML-like special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=USER_ARCHITECTURE["vocab_size"],
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in USER_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text for row in user_rows() for text in row.values()], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=USER_CHAT_TEMPLATE,
        padding_side="right",
    )


def save_user_model(folder: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A user's HF folder: save_pretrained weights (random, seeded), config and its own tokenizer."""
    tokenizer = user_tokenizer()
    assert len(tokenizer) <= USER_ARCHITECTURE["vocab_size"], len(tokenizer)
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**USER_ARCHITECTURE, **special, **overrides})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def chat_rows(tokenizer, rows: list[dict[str, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per record, from the chat template's assistant mask alone (no dtrain
    code): labels are the next tokens where they are the assistant's, else -100."""
    out = []
    for row in rows:
        messages = [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": row["response"]},
        ]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor(rendered["input_ids"])
        mask = torch.tensor(rendered["assistant_masks"], dtype=torch.bool)
        labels = torch.where(mask[1:], ids[1:], -100)
        out.append((ids[:-1], labels))
    return out


def reference_losses(
    folder: Path, rows: list[dict[str, str]], steps: int, batch: int, lr: float
) -> list[float]:
    """Token-mean losses of `steps` steps of a plain transformers + AdamW loop over `rows` in order,
    `batch` rows a step: what dtrain must reproduce on any mesh (fp32; clip 1.0; cosine, no warmup)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    examples = chat_rows(AutoTokenizer.from_pretrained(folder), rows)
    chunks = [examples[step * batch : (step + 1) * batch] for step in range(steps)]
    return adamw_run(model, chunks, lr, weight_decay=0.0, warmup=0)["losses"]


def adamw_run(
    model: torch.nn.Module,
    steps: list[list[tuple[torch.Tensor, torch.Tensor]]],
    lr: float,
    weight_decay: float = 0.1,
    warmup: int = 2,
) -> dict:
    """The tests' reference loop of a PEFT model (no dtrain code): AdamW on the parameters that
    require grad (betas 0.9/0.95, eps 1e-8), clip 1.0, `warmup` steps + cosine over len(steps)
    (transformers' get_scheduler), the loss a token mean over each step's (input_ids, labels)
    sequences, each run alone. Returns {"losses", "norms" (before clipping, summed in float64),
    "adapters" (the trained ones under the names PEFT saves them with), "allowance" (each adapter
    element's AdamW allowance, tests/tolerance.py)}."""
    from transformers import get_scheduler

    from tests.reference import grad_norm
    from tests.tolerance import AdamAllowance

    named = {peft_saved_name(name): p for name, p in model.named_parameters() if p.requires_grad}
    trainable = list(named.values())
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=len(steps))
    allowance = AdamAllowance(optimizer, named)
    losses, norms = [], []
    for batch in steps:
        tokens = sum(int((labels != -100).sum()) for _, labels in batch)
        total = 0.0
        for ids, labels in batch:
            logits = model(input_ids=ids[None]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            (loss / tokens).backward()
            total += loss.item()
        norms.append(grad_norm(trainable))
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        allowance.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total / tokens)
    adapters = {name: p.detach() for name, p in named.items()}
    return {"losses": losses, "norms": norms, "adapters": adapters, "allowance": allowance.allowance()}


def peft_saved_name(name: str) -> str:
    """PEFT's parameter name as its adapter file saves it (no adapter name `default`)."""
    return "base_model.model." + name.removeprefix("base_model.model.").replace(".default", "")


# FSDP's dp shard of a parameter that tp also shards on dim 0 is a _StridedShard (not a Shard subclass)
SHARDS = (Shard, _StridedShard)


def check_sharding(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dp: int,
    tp: int,
    cp: int = 1,
    replicate: int = 1,
) -> None:
    """Parameters, gradients and AdamW states (exp_avg and exp_avg_sq required on every parameter,
    with its step): DTensors on the one mesh with the parameter's placements. The mesh: dp_replicate
    (HSDP, where replicate > 1), then the FSDP axis (dp_shard, or dp_shard_cp where cp > 1: FSDP
    shards over dp_shard × cp), then tp; at tp = 1 no TP is applied and there is no tp axis. Where
    FSDP has one rank (dp_replicate × dp_shard × cp = 1) it is not applied: no FSDP axis, and at
    tp = 1 every one of them a plain tensor. Each parameter is replicated over dp_replicate, sharded
    over the FSDP axis, each local shard at most ceil(numel / (dp·cp·tp)) where tp shards it, else
    ceil(numel / (dp·cp)); the embedding, lm_head and projections are sharded over tp."""
    fsdp = "dp_shard_cp" if cp > 1 else "dp_shard"
    sharded = replicate * dp * cp > 1
    names = (
        *(("dp_replicate",) if replicate > 1 else ()),
        *((fsdp,) if sharded else ()),
        *(("tp",) if tp > 1 else ()),
    )
    shards = dp * cp
    for name, param in model.named_parameters():
        # .get, not [...]: optimizer.state is a defaultdict, and a parameter without state must fail
        states = optimizer.state.get(param, {})
        missing = {"exp_avg", "exp_avg_sq", "step"} - set(states)
        assert not missing, f"{name} has no AdamW {sorted(missing)}"
        moments = [(key, states[key]) for key in ("exp_avg", "exp_avg_sq")]
        for label, tensor in [("param", param), ("grad", param.grad), *moments]:
            if not names:  # one process: neither TP nor FSDP
                assert type(tensor.data) is torch.Tensor, f"{label} of {name} is a {type(tensor.data)}"
                assert tensor.shape == param.shape, f"{label} of {name}: {tuple(tensor.shape)}"
                continue
            assert isinstance(tensor, DTensor), f"{label} of {name} is not a DTensor"
            assert tuple(tensor.device_mesh.mesh_dim_names) == names, (
                f"{label} of {name}: {tensor.device_mesh}"
            )
            assert tensor.placements == param.placements, f"{label} of {name}: {tensor.placements}"
        if not names:
            continue
        placements = dict(zip(names, param.placements, strict=True))
        if replicate > 1:
            assert placements["dp_replicate"] == Replicate(), f"{name}: {param.placements}"
        if sharded:
            assert isinstance(placements[fsdp], SHARDS), f"{name}: {param.placements}"
        tp_sharded = tp > 1 and isinstance(placements["tp"], SHARDS)
        bound = math.ceil(param.numel() / (shards * tp if tp_sharded else shards))
        assert param.to_local().numel() <= bound, f"{name}: {param.to_local().numel()} > {bound}"
        if any(key in name for key in ("embed_tokens", "lm_head", "proj")):
            assert tp == 1 or isinstance(placements["tp"], Shard), (
                f"{name} is not sharded over tp: {param.placements}"
            )


def one_backward(model: torch.nn.Module) -> None:
    """Leave gradients in place (the trainer zeroes them after each step) for check_sharding."""
    ids = torch.arange(2 * MAX_LEN).reshape(2, MAX_LEN) % 50
    positions = torch.arange(MAX_LEN).expand(2, -1)
    with loss_context(True):
        summed_cross_entropy(model(input_ids=ids, position_ids=positions).logits, ids).backward()


def assert_adam_state_equal(before: dict[str, dict], after: dict[str, dict]) -> None:
    """Every parameter's AdamW state unchanged (what a skipped step must leave): `before` and `after`
    map parameter names to their state (a checkpoint's `optimizer.state`, after dcp_to_torch_save);
    both name the same parameters, each with exp_avg, exp_avg_sq and step, each tensor bitwise equal."""
    assert before, "no optimizer state to compare"
    assert set(before) == set(after), sorted(set(before) ^ set(after))
    for name in before:
        for side, state in (("before", before[name]), ("after", after[name])):
            missing = {"exp_avg", "exp_avg_sq", "step"} - set(state)
            assert not missing, f"{name} has no {sorted(missing)} {side}"
        for key in ("exp_avg", "exp_avg_sq", "step"):
            old, new = torch.as_tensor(before[name][key]), torch.as_tensor(after[name][key])
            assert torch.equal(old, new), f"{name}: {key} changed"


# A tiny Qwen3-MoE: 8 experts, top-2 with normalised weights (as Qwen3-30B-A3B), experts in every
# layer, training with HF's router aux loss at 50 times Qwen's coefficient, so that a wrong aux loss
# or gradient shows.
TINY_MOE = dict(
    output_router_logits=True,
    router_aux_loss_coef=0.05,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def save_tiny_moe(folder: Path, seed: int = 0, aux_loss: bool = True) -> Path:
    """A tiny HF Qwen3-MoE with random weights, saved by transformers (one tensor per expert on disk);
    aux_loss=False: trained without the router's aux loss (output_router_logits false, HF's default)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, **TINY_MOE, "output_router_logits": aux_loss})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


# The other stacked-experts families on TINY, with HF's aux loss as TINY_MOE: Mixtral (Llama's
# attention with GQA, normalised top-2 weights), OLMoE (whole-width q/k norms, weights not normalised),
# GPT-OSS (transposed experts with biases and a clamped interleaved gate, a router with a bias, q/k/v/o
# biases, attention sinks, sliding-window layers (window 8 < MAX_LEN) alternating with full ones).
MOE_FAMILIES = {
    "mixtral": dict(num_key_value_heads=2, num_local_experts=8, tie_word_embeddings=False),
    "olmoe": dict(num_experts=8, norm_topk_prob=False, tie_word_embeddings=False),
    "gpt_oss": dict(
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        intermediate_size=32,
        sliding_window=8,
        # GPT-OSS's YaRN, stretching 32 positions to TINY's 64
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=2.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=32,
        ),
    ),
}


def save_tiny_moe_family(folder: Path, model_type: str, seed: int = 0) -> Path:
    """A tiny HF model of MOE_FAMILIES, saved like save_tiny_moe."""
    torch.manual_seed(seed)
    aux = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
    config = AutoConfig.for_model(model_type, **{**TINY, **aux, **MOE_FAMILIES[model_type]})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


# Rank 0's row of dispatch_rows() changes at this position in the second variant.
DISPATCH_TOKEN = 5


def dispatch_rows() -> list[torch.Tensor]:
    """Four rows of MAX_LEN tokens ([4, MAX_LEN]: row r for rank r), and the same rows with row 0's
    DISPATCH_TOKEN changed: only rank 0 holds the change."""
    ids = (torch.arange(4 * MAX_LEN).reshape(4, MAX_LEN) * 13 + 3) % 1000
    changed = ids.clone()
    changed[0, DISPATCH_TOKEN] = (changed[0, DISPATCH_TOKEN] + 1) % 1000
    return [ids, changed]


def check_expert_sharding(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ep: int, efsdp: int, tp: int
) -> None:
    """Expert parameters (`.experts.` in the name), their gradients and AdamW moments (each required,
    with its step): DTensors on the experts mesh (efsdp, ep, and tp where tp > 1) with the parameter's
    placements: Shard(0) over ep (the expert dimension), sharded over efsdp, replicated over tp; each
    local shard at most ceil(numel / (ep·efsdp)). Every AdamW param group holds parameters of one mesh."""
    names = ("efsdp", "ep", *(("tp",) if tp > 1 else ()))
    experts = [(name, param) for name, param in model.named_parameters() if ".experts." in name]
    assert experts, "no expert parameters"
    for name, param in experts:
        states = optimizer.state.get(param, {})
        missing = {"exp_avg", "exp_avg_sq", "step"} - set(states)
        assert not missing, f"{name} has no AdamW {sorted(missing)}"
        for label, tensor in [("param", param), ("grad", param.grad)] + [
            (key, states[key]) for key in ("exp_avg", "exp_avg_sq")
        ]:
            assert isinstance(tensor, DTensor), f"{label} of {name} is not a DTensor"
            assert tuple(tensor.device_mesh.mesh_dim_names) == names, (
                f"{label} of {name}: {tensor.device_mesh}"
            )
            assert tensor.placements == param.placements, f"{label} of {name}: {tensor.placements}"
        placements = dict(zip(names, param.placements, strict=True))
        assert placements["ep"] == Shard(0), f"{name}: {param.placements}"
        assert isinstance(placements["efsdp"], SHARDS), f"{name}: {param.placements}"
        assert tp == 1 or placements["tp"] == Replicate(), f"{name}: {param.placements}"
        bound = math.ceil(param.numel() / (ep * efsdp))
        assert param.to_local().numel() <= bound, f"{name}: {param.to_local().numel()} > {bound}"
    for group in optimizer.param_groups:
        meshes = {tuple(p.device_mesh.mesh_dim_names) for p in group["params"]}
        assert len(meshes) <= 1, f"an AdamW group mixes meshes: {meshes}"
