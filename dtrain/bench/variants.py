"""What `python -m dtrain.bench` runs: the model, the fixed batch, and each variant's step (a plain
PyTorch + transformers loop, dtrain's step on a mesh), timed in alternating rounds.

dtrain's variants run exactly the trainer's per-step functions (the objective's begin_step and
micro_step, dtrain.step's optimizer_step) on the model build_model() makes, so hooks, DTensor,
loss-parallel and a mixture of experts' routing and aux-loss overhead are all in the figure.
bench/gpu_check.py reuses these pieces on a Llama-3.2-1B shape."""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dtrain.checks import check_config
from dtrain.config import (
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from dtrain.distributed import build_parallel, init_distributed
from dtrain.loss import IGNORE
from dtrain.metrics import flops_per_token
from dtrain.model import build_model, load_model_config
from dtrain.objectives import Context, build_objective
from dtrain.optim import build_optimizer, trainable_parameters
from dtrain.parallel import nf4
from dtrain.parallel.experts import idle_parameters
from dtrain.step import optimizer_step, with_filled_slots

TINY_MODEL = dict(
    model_type="llama",
    vocab_size=8192,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
# The mixture-of-experts rows (--moe): a Qwen3-MoE of the same width and depth, 8 experts a layer,
# top-2, HF's router aux loss on (its coefficient Qwen3-MoE's default); expert sizes multiples of 4, so
# grouped_mm runs on the CPU in fp32 (dtrain's experts and HF's default, transformers' grouped_mm).
TINY_MOE_MODEL = dict(
    TINY_MODEL,
    model_type="qwen3_moe",
    moe_intermediate_size=128,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.001,
)
LR, MAX_NORM = 1e-3, 1.0
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # Llama's
# The LoRA and QLoRA rows (`.format(r=...)`); QLORA_BNB, what QLoRA users run today (bitsandbytes'
# NF4 under PEFT), is the row dtrain's QLoRA is held to, and runs where bitsandbytes is installed
LORA_PEFT, LORA_DTRAIN = "LoRA r={r}: PEFT + plain loop", "LoRA r={r}: dtrain 1x1"
QLORA_BNB, QLORA_DTRAIN = "QLoRA r={r}: PEFT + bitsandbytes NF4", "QLoRA r={r}: dtrain 1x1, NF4 base"
QLORA_DENSE = "QLoRA r={r}: PEFT, dense NF4 base"
LORA_PAIRS = [
    (LORA_DTRAIN, LORA_PEFT),
    (QLORA_DTRAIN, QLORA_BNB),
    (QLORA_DTRAIN, QLORA_DENSE),
]  # (ours, baseline)
BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
NO_BITSANDBYTES = "QLoRA's PEFT + bitsandbytes row: not run (bitsandbytes is not installed)"
TOKENIZER = Path(__file__).parents[1] / "assets" / "tiny_llama"  # only checked: the data is random ids
Step = Callable[[], None]


@dataclass
class Setup:
    """What every variant trains: the model's shape, one fixed micro-batch per dp rank, precision."""

    model: dict = field(default_factory=lambda: dict(TINY_MODEL))
    batch: int = 4
    seq: int = 256
    precision: str = "fp32"  # bf16: FSDP's mixed precision in dtrain, autocast in the plain loop
    packed: bool = False  # rows of several documents (position_ids restart, document mask)
    compile: bool = False  # torch.compile each decoder layer (dtrain and the plain loop alike)
    loss_impl: str = "dense"  # dtrain only: parallel.loss_impl
    loss_chunk: int = 0  # dtrain only: parallel.loss_chunk (chunked and fused)
    lora_r: int = 0  # > 0: LoRA adapters of this rank on every projection (PEFT in the plain loop)
    aux_scope: str = "micro_step"  # dtrain only, a mixture of experts: moe.aux_scope
    base_dtype: str = "auto"  # dtrain only: lora.base_dtype (the plain loop takes its base model)


@dataclass
class Result:
    name: str
    devices: int
    seconds: float  # per step, best round
    tokens: int  # input tokens per step, all devices
    supervised: int  # targets per step, all devices
    flops_per_token: float
    peak_gib: float | None  # CUDA only: per device, max over ranks

    def row(self, first: Result | None, peak: float | None) -> dict:
        rate = self.tokens / self.seconds
        mfu = self.flops_per_token * rate / (peak * self.devices) if peak else None
        return {
            "variant": self.name,
            "devices": self.devices,
            "tokens_per_s": rate,
            "supervised_tokens_per_s": self.supervised / self.seconds,
            "tokens_per_s_per_device": rate / self.devices,
            "mfu": mfu,
            "step_ms": self.seconds * 1000,
            "peak_gib": self.peak_gib,
            "ratio": rate / (first.tokens / first.seconds) if first else 1.0,
        }


def make_batch(setup: Setup, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """One fixed random micro-batch, every slot a token (`num_tokens`: the rows' length). The first
    quarter of each document is prompt (no targets); with packing each row holds documents of random
    lengths, each restarting position_ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.model["vocab_size"], (setup.batch, setup.seq + 1), generator=generator)
    labels, positions = ids[:, 1:].clone(), torch.empty(setup.batch, setup.seq, dtype=torch.long)
    for row in range(setup.batch):
        start = 0
        while start < setup.seq:
            low = max(2, setup.seq // 8)
            length = setup.seq - start if not setup.packed else int(torch.randint(low, setup.seq, (1,)))
            stop = min(setup.seq, start + length)
            positions[row, start:stop] = torch.arange(stop - start)
            labels[row, start : start + (stop - start) // 4] = IGNORE
            labels[row, start] = IGNORE  # a document's first label would predict across the seam
            start = stop
    return {
        "input_ids": ids[:, :-1].to(device),
        "labels": labels.to(device),
        "position_ids": positions.to(device),
        "num_tokens": torch.full((setup.batch,), setup.seq, device=device),
    }


def hf_model(setup: Setup, device: torch.device) -> torch.nn.Module:
    """Built (and initialised) on the device itself: a 1 B model's init on the host takes long."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**setup.model)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def dense_nf4_model(setup: Setup, device: torch.device) -> torch.nn.Module:
    """hf_model with each projection's weight rounded through NF4 and kept dense: the values dtrain's
    NF4 base computes with, at a dense model's cost."""
    model = hf_model(setup, device)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(tuple(PROJECTIONS)):
                module.weight.copy_(nf4.round_trip(module.weight))
    return model


def bitsandbytes_model(setup: Setup, device: torch.device) -> torch.nn.Module:
    """QLoRA's base as PEFT users load it: hf_model's weights saved, then transformers'
    from_pretrained with bitsandbytes' NF4 (double quantization, computing in the setup's precision):
    every projection a bitsandbytes Linear4bit that dequantizes its weight at each matmul."""
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if setup.precision == "bf16" else torch.float32
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    with tempfile.TemporaryDirectory() as folder:
        hf_model(setup, device).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quantization, dtype=torch.float32, device_map={"": device}
        )
    return model.train()


def plain_loop(
    setup: Setup, mb: dict[str, torch.Tensor], device: torch.device, base: torch.nn.Module | None = None
) -> Step:
    """The baseline: a Hugging Face model (`base`, or hf_model's; its default sdpa attention; packed
    rows get its own document mask from the restarting position_ids), AdamW (fused, as dtrain's),
    summed token loss / tokens (a mixture of experts: + coef · HF's aux loss of the batch, from the
    same forward), clip, step."""
    model = base if base is not None else hf_model(setup, device)
    if setup.lora_r:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=setup.lora_r, lora_alpha=2 * setup.lora_r, target_modules=PROJECTIONS)
        model = get_peft_model(model, lora).base_model.model  # PEFT's modules, called as the HF model
    if setup.compile:
        for index, layer in enumerate(model.model.layers):
            model.model.layers[index] = torch.compile(layer)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    tokens = (mb["labels"] != IGNORE).sum().float()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.precision == "bf16")

    router = {"output_router_logits": True} if getattr(model.config, "output_router_logits", False) else {}

    def step() -> None:
        with autocast:
            out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False, **router)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), mb["labels"].flatten(), reduction="sum")
        aux = model.config.router_aux_loss_coef * out.aux_loss if router else 0.0
        (loss / tokens + aux).backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def dtrain_step(
    setup: Setup, mb: dict[str, torch.Tensor], device: torch.device, dp: int, tp: int, ep: int = 1
) -> Step:
    """dtrain's model (build_model on the dp×tp mesh of this process group, experts split over `ep`)
    and the trainer's step: the objective's step (its global counts; forward, loss and backward;
    a mixture of experts: the router's record and aux loss, setup.aux_scope's), then clip and AdamW."""
    world = dist.get_world_size()
    config = Config(
        model=ModelConfig(config=dict(setup.model), init="random", tokenizer=str(TOKENIZER)),
        data=DataConfig(max_len=setup.seq, packing=setup.packed),
        parallel=ParallelConfig(
            tp=tp,
            dp_shard=dp,
            ep=ep,
            loss_impl=setup.loss_impl,
            loss_chunk=setup.loss_chunk,
            compile=setup.compile,
        ),
        optim=OptimConfig(lr=LR, max_grad_norm=MAX_NORM, schedule="constant"),
        train=TrainConfig(global_batch_size=setup.batch * dp, micro_batch_size=setup.batch),
        # LoRA's keys only with LoRA on: lora.alpha beside lora.r=0 is refused as a typo
        lora=LoraConfig(r=setup.lora_r, alpha=2.0 * setup.lora_r, base_dtype=setup.base_dtype)
        if setup.lora_r
        else LoraConfig(),
        moe=MoeConfig(aux_scope=setup.aux_scope),
    )
    config.train.precision = setup.precision
    model_config = load_model_config(config.model)
    shape = check_config(config, world, model_config, files=False)
    parallel = build_parallel(shape, device)
    model = build_model(model_config, config, parallel, device)
    optimizer = build_optimizer(model, config.optim)
    params = trainable_parameters(model)
    objective = build_objective(Context(config, model, parallel))
    batch = with_filled_slots(mb)

    def step() -> None:
        objective.begin_step([batch])
        objective.micro_step(batch)
        optimizer_step(optimizer, params, MAX_NORM)

    return step


def timed(step: Step, steps: int, device: torch.device) -> float:
    """Seconds per step over `steps` steps (ranks start together, the slowest one counts)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = torch.tensor((time.perf_counter() - start) / steps)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def peak_gib(device: torch.device) -> float | None:
    """Peak allocated memory since the last reset, GiB; None on CPU (no per-variant figure there)."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def flops(setup: Setup) -> float:
    """dtrain.metrics' count; with LoRA, r·(in + out) adapter parameters a projection, which alone
    get weight gradients."""
    config = AutoConfig.for_model(**setup.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters()) - idle_parameters(model)  # experts: top-k's
    projections = [m for n, m in model.named_modules() if n.endswith(tuple(PROJECTIONS))]
    adapters = sum(setup.lora_r * (m.in_features + m.out_features) for m in projections)
    return flops_per_token(config, total + adapters, setup.seq, adapters if setup.lora_r else None)


def measure(
    builds: dict[str, Callable[[], Step]],
    setup: Setup,
    device: torch.device,
    args: argparse.Namespace,
    devices: int = 1,
    dp: int = 1,
) -> list[Result]:
    """Build and warm up each variant (its peak memory is its own: what it adds to the memory the
    variants built before it hold), then time them in alternating
    rounds, so that load from elsewhere falls on every variant; the best round counts."""
    mb = make_batch(setup, device)
    tokens, supervised = mb["input_ids"].numel() * dp, int((mb["labels"] != IGNORE).sum()) * dp
    steps, peaks, seconds = {}, {}, {}
    for name, build in builds.items():
        before = 0.0
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() / 2**30  # the variants built before this one
        steps[name] = build()
        timed(steps[name], args.warmup, device)
        peak = peak_gib(device)
        peaks[name] = peak - before if peak is not None else None
    for _ in range(args.rounds):
        for name, step in steps.items():
            seconds[name] = min(seconds.get(name, float("inf")), timed(step, args.steps, device))
    per_token = flops(setup)
    return [
        Result(name, devices, seconds[name], tokens, supervised, per_token, peaks[name]) for name in steps
    ]


def loss_variants(
    name: str, setup: Setup, mb: dict, device: torch.device, dp: int, tp: int, loss_chunk: int
) -> dict[str, Callable[[], Step]]:
    """dtrain on one mesh with the dense loss (`name`), then chunked and fused (when loss_chunk)."""
    builds = {name: lambda: dtrain_step(setup, mb, device, dp, tp)}
    for impl in ("chunked", "fused") if loss_chunk else ():
        variant = Setup(**{**asdict(setup), "loss_impl": impl, "loss_chunk": loss_chunk})
        builds[f"{name} {impl} loss_chunk={loss_chunk}"] = lambda v=variant: dtrain_step(
            v, mb, device, dp, tp
        )
    return builds


def in_process_variants(setup: Setup, device: torch.device, loss_chunk: int) -> dict[str, Callable[[], Step]]:
    mb = make_batch(setup, device)
    return {
        "plain torch + transformers loop": lambda: plain_loop(setup, mb, device),
        **loss_variants("dtrain 1x1", setup, mb, device, 1, 1, loss_chunk),
    }


def lora_variants(setup: Setup, device: torch.device, r: int) -> dict[str, Callable[[], Step]]:
    """LoRA (rank r, every projection): PEFT on the plain loop against dtrain 1x1, the same model.
    QLoRA: PEFT over bitsandbytes' NF4 base (QLORA_BNB, when bitsandbytes is installed: each
    keeps its base in NF4 and dequantizes it at every matmul), dtrain 1x1 on its NF4 base, and PEFT
    on the same values dequantized once into a dense model: what keeping the base in NF4 costs."""
    mb = make_batch(setup, device)
    lora = Setup(**{**asdict(setup), "lora_r": r})
    qlora = Setup(**{**asdict(lora), "base_dtype": "nf4"})
    builds = {
        LORA_PEFT.format(r=r): lambda: plain_loop(lora, mb, device),
        LORA_DTRAIN.format(r=r): lambda: dtrain_step(lora, mb, device, 1, 1),
    }
    if BITSANDBYTES:
        builds[QLORA_BNB.format(r=r)] = lambda: plain_loop(
            qlora, mb, device, bitsandbytes_model(qlora, device)
        )
    builds[QLORA_DTRAIN.format(r=r)] = lambda: dtrain_step(qlora, mb, device, 1, 1)
    builds[QLORA_DENSE.format(r=r)] = lambda: plain_loop(qlora, mb, device, dense_nf4_model(qlora, device))
    return builds


def lora_pairs(r: int) -> list[tuple[str, str]]:
    """LORA_PAIRS' row names at rank r: (dtrain's row, the baseline it is held to)."""
    return [(ours.format(r=r), baseline.format(r=r)) for ours, baseline in LORA_PAIRS]


def moe_variants(setup: Setup, device: torch.device) -> dict[str, Callable[[], Step]]:
    """A mixture of experts (setup.model: TINY_MOE_MODEL) with HF's aux loss: the plain loop, then
    dtrain 1x1 with each moe.aux_scope."""
    mb = make_batch(setup, device)
    builds = {"MoE plain loop + HF aux loss": lambda: plain_loop(setup, mb, device)}
    for scope in ("micro_step", "global_batch"):
        scoped = Setup(**{**asdict(setup), "aux_scope": scope})
        builds[f"MoE dtrain 1x1 {scope}"] = lambda s=scoped: dtrain_step(s, mb, device, 1, 1)
    return builds


def mesh_worker(kind: str, setup: Setup, args: argparse.Namespace) -> list[Result]:
    """Under torchrun: dtrain on the DPxTP mesh named by `kind`, one micro-batch per dp rank (at tp > 1
    with --compile, also with parallel.compile=true: Inductor's kernels, C++ on a CPU); `moe-epN`:
    the mixture of experts on dp N with its experts split over ep = N (the default aux scope)."""
    device = init_distributed(timeout_s=300)
    if kind.startswith("moe-ep"):
        ep = dp = int(kind.removeprefix("moe-ep"))
        moe = Setup(**{**asdict(setup), "model": dict(TINY_MOE_MODEL)})
        mb = make_batch(moe, device, seed=dist.get_rank())  # each dp rank its own rows: real routing
        builds = {f"MoE dtrain ep{ep} (dp {dp}) micro_step": lambda: dtrain_step(moe, mb, device, dp, 1, ep)}
        return measure(builds, moe, device, args, devices=dist.get_world_size(), dp=dp)
    mb = make_batch(setup, device, seed=0)  # tp ranks must agree; dp ranks may too (same cost)
    dp, tp = (int(n) for n in kind.split("x"))
    # The loss variants where tp shards the vocabulary (their collectives are the difference).
    builds = loss_variants(f"dtrain {kind}", setup, mb, device, dp, tp, args.loss_chunk if tp > 1 else 0)
    if tp > 1 and args.compile:  # beside the eager row: what parallel.compile=true gains at tp > 1
        compiled = Setup(**{**asdict(setup), "compile": True})
        builds[f"dtrain {kind} compiled"] = lambda: dtrain_step(compiled, mb, device, dp, tp)
    results = measure(builds, setup, device, args, devices=dist.get_world_size(), dp=dp)
    for result in results:
        if result.peak_gib is not None:
            peak = torch.tensor(result.peak_gib, device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            result.peak_gib = peak.item()
    return results
