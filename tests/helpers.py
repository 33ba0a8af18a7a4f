"""Shared by the tests: tiny models saved with save_pretrained, the config for parity runs, and a
torchrun launcher that never hangs the suite."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dtrain.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "dtrain" / "assets"
DATASET = ASSETS / "sft_tiny.jsonl"
TOKENIZER = ASSETS / "tokenizer"

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
STEPS, GLOBAL_BATCH, MICRO_BATCH, MAX_LEN = 10, 16, 2, 32


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
        parallel=ParallelConfig(tp=tp, dp_shard=dp),
        optim=OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, schedule="cosine", warmup_steps=2),
        train=TrainConfig(
            max_steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, precision="fp32"
        ),
        checkpoint=CheckpointConfig(resume="none", save_final=False),
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


def sharded_model(config: Config, device: torch.device) -> torch.nn.Module:
    """The model exactly as the trainer builds it (on this process group), before any step."""
    from dtrain.config import check_config
    from dtrain.distributed import build_parallel
    from dtrain.model import build_meta_model, load_model_config, materialize
    from dtrain.parallel.parallelize import parallelize
    from dtrain.parallel.vocab import padded_vocab_size

    model_config = load_model_config(config.model)
    shape = check_config(config, torch.distributed.get_world_size(), model_config)
    rows = padded_vocab_size(model_config.vocab_size, shape.tp)
    model = build_meta_model(model_config, packed=config.data.packing, vocab_rows=rows)
    parallelize(model, build_parallel(shape, device), config.parallel, config.train.precision)
    materialize(model, device, config.model, seed=config.train.seed)
    return model


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


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = ROOT):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
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
