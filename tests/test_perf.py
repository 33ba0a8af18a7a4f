"""Performance paths that must not change numerics: the chunked vocab-parallel loss, selective
activation checkpointing, per-layer resharding, FSDP prefetch and compiled layers on the 2×2 mesh,
and the host synchronisations of a step (tests/workers/perf_mesh.py, 4 gloo processes); the tp=1
fast path and torch.compile on 1×1 (one process); flex attention on packed rows against sdpa's
dense mask; the planner showing the chunked loss's saving; the bench's table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import dtrain.attention
from dtrain.attention import set_backend
from dtrain.checks import check_config
from dtrain.config import ConfigError
from dtrain.data.loader import Rows, SFTLoader
from dtrain.estimate.planner import plan
from dtrain.model import allocate, build_meta_model, init_weights, load_model_config
from tests.helpers import MAX_LEN, ROOT, TINY, parity_config, run, run_worker, worker

WORKER = worker("perf_mesh")


@pytest.mark.slow
def test_chunked_loss_checkpointing_and_resharding_keep_the_numerics_on_2x2(tmp_path):
    """perf_mesh's 2×2 checks (its docstring): the numerics of the performance paths, compiled
    layers' gradients, and the host synchronisations of a step of SFT, LoRA, MoE and DPO."""
    done = tmp_path / "done"
    result = run_worker(4, "perf_mesh", "--done", str(done), timeout=600)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]


@pytest.mark.slow
def test_compiled_layers_at_tp2_alone_have_eager_s_gradients(tmp_path):
    """tp 2 on 2 processes (no FSDP): parallel.compile=true's layers give the eager loss, gradients
    and grad norm (perf_mesh.check_compiled_layers; 2×2 is in the 4-process launch)."""
    done = tmp_path / "done"
    result = run_worker(2, "perf_mesh", "--tp2", "--done", str(done), timeout=300)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]


def inductor_python(folder: Path) -> str:
    """This interpreter, or, where its environment's path holds whitespace, the same virtual
    environment through a symlink without any: torch 2.13's Inductor links its C++ kernels with
    `-L<torch/lib>` unquoted (torch/_inductor/cpp_builder.py), which a path such as `/tmp/a b/`
    splits (README, Not yet). Python finds a venv's site-packages from the path it was started by."""
    if not any(c.isspace() for c in sys.prefix) or sys.prefix == sys.base_prefix:
        return sys.executable
    link = folder / "venv"
    link.symlink_to(sys.prefix, target_is_directory=True)
    return str(link / "bin" / Path(sys.executable).name)


@pytest.mark.slow
def test_tp1_fast_path_compile_and_selective_recomputation_on_1x1(tmp_path):
    """One process. Inductor compiles on the CPU (g++); one compile worker, not a pool of them."""
    done = tmp_path / "done"
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    python = inductor_python(tmp_path)
    result = run([python, *WORKER, "--single", "--done", str(done)], timeout=300, env=env)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]


@pytest.mark.slow
def test_flex_attention_on_packed_rows_matches_sdpa_with_the_document_mask(monkeypatch):
    """The CUDA path for packed rows (flex attention, block mask from the document ids), run eagerly
    on the CPU (forward only: flex has no CPU backward), against the sdpa path every other device
    takes. The mask is built once per forward and reaches every layer through the forward kwargs,
    also into compiled layers."""
    config = load_model_config(parity_config(None, dp=1, tp=1).model)
    config.num_key_value_heads = 2  # grouped-query attention through flex's enable_gqa
    config.num_hidden_layers = 4  # more layers than the graphs allowed below: they must share one
    model = build_meta_model(config, packed=True)
    allocate(model, torch.device("cpu"))
    init_weights(model, seed=0)
    ids = torch.arange(2 * MAX_LEN).reshape(2, MAX_LEN) * 7 % TINY["vocab_size"]
    # Documents of 11 + 21 and 5 + 20 + 7 tokens: boundaries inside flex's blocks.
    starts = [[0, 11], [0, 5, 25]]
    positions = torch.stack(
        [torch.cat([torch.arange(b - a) for a, b in zip(s, [*s[1:], MAX_LEN], strict=True)]) for s in starts]
    )
    with torch.no_grad():
        sdpa = model(input_ids=ids, position_ids=positions).logits
        builds = []
        build = dtrain.attention.document_block_mask
        monkeypatch.setattr(dtrain.attention, "document_block_mask", lambda p: builds.append(1) or build(p))
        set_backend(model, "flex")
        flex = model(input_ids=ids, position_ids=positions).logits
    assert len(builds) == 1, f"block mask built {len(builds)} times for one forward"
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    # As parallel.compile=true runs it on CUDA: each layer one full graph, the BlockMask an input
    # (new documents do not recompile). aot_eager: tracing is what is checked here, not inductor.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # eager flex compiles its own helper graph
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        compiled = model(input_ids=ids, position_ids=positions).logits
        # The first forward may compile twice: transformers' `kernels` wrappers flip a global on it.
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model(input_ids=ids, position_ids=positions.flip(0))
        model(input_ids=ids, position_ids=positions.roll(3, dims=1))
    torch.testing.assert_close(compiled, sdpa, rtol=1e-5, atol=1e-5)
    assert 1 <= graphs <= 2, f"{graphs} graphs for one forward of {len(model.model.layers)} identical layers"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "new documents recompiled"
    torch._dynamo.reset()  # leave no compiled code to the tests after this one


@pytest.mark.slow
def test_planner_shows_the_chunked_loss_saving():
    """The planner runs the trainer's step: with loss_chunk the logits alive at once drop by the chunk
    factor (local sequence / chunk) and so does the step's peak (the logits dominate a tiny model)."""
    config = parity_config(None, dp=2, tp=2)
    config.model.config["vocab_size"] = 8192  # logits large enough to dominate the peak
    unchunked = plan(config, 4).step
    config.parallel.loss_impl, config.parallel.loss_chunk = "chunked", 4
    chunked = plan(config, 4).step
    local_len = MAX_LEN // 2  # the sequence-parallel shard
    assert chunked.logits * (local_len // 4) == unchunked.logits, (chunked.logits, unchunked.logits)
    assert chunked.peak < unchunked.peak, (chunked.peak, unchunked.peak)


def test_prefetching_loader_gives_the_same_stream_and_resumes_mid_stream():
    """The CUDA default (a thread builds the next step ahead), forced on CPU: the same micro-batches
    as building each step on demand, also after load_state_dict with a step already built ahead."""
    examples = datasets.Dataset.from_dict(
        {"input_ids": [[i, i + 1, i + 2] for i in range(10)], "mask": [[0, 1, 1]] * 10}
    )
    rows = Rows(examples, [[i] for i in range(10)], max_len=4, pad_id=0)

    def loader(prefetch: bool) -> SFTLoader:
        return SFTLoader(rows, global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3,
                         shuffle=True, prefetch=prefetch)  # fmt: skip

    def ids(step: list[dict]) -> list[list[int]]:
        return [row for mb in step for row in mb["input_ids"].tolist()]

    plain, ahead = loader(False), loader(True)
    expected = [ids(plain.next_step()) for _ in range(6)]  # over an epoch boundary (10 rows)
    assert [ids(ahead.next_step()) for _ in range(3)] == expected[:3]
    state = ahead.state_dict()
    assert ids(ahead.next_step()) == expected[3]
    ahead.load_state_dict(state)  # back one step, while step 5 is being built ahead
    assert [ids(ahead.next_step()) for _ in range(3)] == expected[3:]


@pytest.mark.parametrize(
    "key,value",
    [
        ("loss_impl", "sparse"),
        ("fsdp_prefetch", -1),
        ("reshard_after_forward", "sometimes"),
        ("activation_checkpointing", "partial"),
    ],
)
def test_bad_perf_settings_name_the_key(key, value):
    config = parity_config(None, dp=1, tp=1)
    setattr(config.parallel, key, value)
    shown = repr(value) if isinstance(value, str) else value  # how _one_of and the int checks print it
    with pytest.raises(ConfigError, match=f"parallel.{key}={shown}"):
        check_config(config, 1, load_model_config(config.model))


@pytest.mark.slow
def test_bench_prints_one_table_of_every_variant():
    """Smoke (no timed assertion, and none of the table's own arithmetic, which only restates
    itself): one invocation, one row per variant (the HF Trainer one, or why it did not run), a
    2-process mesh from torchrun workers, fewer supervised tokens than tokens (the prompts); the LoRA
    and QLoRA rows (PEFT over bitsandbytes' NF4 among them) and their ratio lines; the DPO table's
    rows: TRL's DPOTrainer (or why it did not run), dtrain 1×1 unpacked and packed."""
    command = [sys.executable, "-m", "dtrain.bench", "--seq", "16", "--steps", "1", "--warmup", "1"]
    command += ["--rounds", "1", "--meshes", "2x1", "--dpo-pairs", "4", "--distill", "0"]  # test_distill's
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    rows = {
        line[:36].strip(): line[36:].split()
        for line in lines
        if line.startswith(("plain", "dtrain", "HF", "TRL"))
    }
    assert "CPU figures" in result.stdout
    names = ["plain torch + transformers loop", "dtrain 1x1", "dtrain 1x1 chunked loss_chunk=64"]
    names += ["dtrain 1x1 fused loss_chunk=64", "dtrain 2x1", "dtrain 1x1 DPO", "dtrain 1x1 DPO packed"]
    assert [name for name in rows if not name.startswith(("HF", "TRL"))] == names, result.stdout
    assert "HF Trainer" in rows or any(line.startswith("HF Trainer: not run") for line in lines)
    assert "TRL DPOTrainer" in rows or any(line.startswith("DPO: not run") for line in lines)
    for name in names:
        devices, rate, supervised, _, mfu, _, memory, _ = rows[name]
        assert (mfu, memory) == ("-", "-"), name  # no peak FLOP/s and no per-variant memory on CPU
        assert 0 < float(supervised) < float(rate), name  # prompt positions carry no targets
    assert rows["dtrain 2x1"][0] == "2"
    # LoRA and QLoRA (rank 16), each dtrain row beside the baseline it is held to, and their ratios
    qlora = ["QLoRA r=16: PEFT + bitsandbytes NF4", "QLoRA r=16: dtrain 1x1, NF4 base"]
    for name in ["LoRA r=16: PEFT + plain loop", "LoRA r=16: dtrain 1x1", *qlora]:
        assert any(line.startswith(name) for line in lines), name
    assert any(line.startswith(f"{qlora[1]} / {qlora[0]}: ") for line in lines), result.stdout


FAULTS_OF_A_FRESH_BLOCK = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from dtrain.distributed import keep_freed_host_memory
    keep_freed_host_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # a training loop's steady state: the heap settles around the freed blocks
    torch.ones(16 * 2**20)  # 64 MiB, written, then freed at once
before = faults()
for _ in range(5):
    torch.ones(16 * 2**20)  # each a fresh mmap by default: every one of its 16384 pages faults in
print(faults() - before)
"""


@pytest.mark.slow
def test_cpu_training_reuses_freed_host_memory_instead_of_faulting_it_in_again():
    """keep_freed_host_memory (init_distributed on CPU) against glibc's default, by the kernel's own
    count of page faults: a logits-sized block allocated again after a free."""
    faults = {}
    for mode in ("default", "keep"):
        result = run([sys.executable, "-c", FAULTS_OF_A_FRESH_BLOCK, mode], timeout=60)
        assert result.returncode == 0, result.stdout[-2000:]
        faults[mode] = int(result.stdout.split()[-1])
    assert faults["default"] > 5 * 8000 and faults["keep"] < 1000, faults
