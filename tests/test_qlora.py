"""QLoRA (lora.base_dtype=nf4) against what dtrain did not write: bitsandbytes and PEFT (fp32, gloo).

tests/workers/qlora_runs.py quantizes and trains through dtrain's trainer on 1 and 4 processes. The
references here: bitsandbytes' own `quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True)` of each whole weight read from the model's safetensors, in one process,
and `dequantize_4bit` of it; for training, PEFT (`PeftModel.from_pretrained` of the same PEFT-written
adapter, non-zero A and B) on `from_pretrained` with the adapted weights replaced by bitsandbytes'
dequantized values, and a plain AdamW loop over rows the chat template tokenizes: no dtrain code.

bitsandbytes' reference path is its pure-torch one (bitsandbytes.backends.default, the path its
CUDA kernel's rounding follows; docs/lora.md says why): its CPU library's `quantize_blockwise`, which
quantize_4bit calls for the double quantization on a CPU, picks a farther scale code for about 1 in
1,100 (test_cpu_library_differs_only_by_farther_scale_codes). Its CPU `dequantize_4bit` scales a 2-D
weight whose rows are not a multiple of 64 by the wrong blocks (bitsandbytes 0.50.2, its C code; its
own pure-torch path and the flat weight agree with each other): the reference dequantizes the flat
weight.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import bitsandbytes.functional as bnb  # scripts/venv.sh installs it (--no-deps, bitsandbytes==0.50.2)
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import (
    adamw_run,
    chat_rows,
    read_metrics,
    run_in_one_interpreter,
    save_user_model,
    user_rows,
    worker_results,
)
from tests.test_lora import save_peft_adapter
from tests.tolerance import assert_logits_close, assert_scalar_close, assert_weights_close
from tests.workers.lora_runs import GLOBAL_BATCH, LR, MAX_LEN, logit_ids
from tests.workers.qlora_runs import SCENARIOS, STEPS

pytestmark = pytest.mark.slow

SCENARIO = {**SCENARIOS[1], **SCENARIOS[4]}
TRAINED = [name for name, (_, _, _, trained) in SCENARIO.items() if trained]
# Llama's TP plan (docs/lora.md): colwise weights split their rows over tp, rowwise their columns
ROWWISE = ("o_proj", "down_proj")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora_models")
    folder = save_user_model(root / "llama", num_key_value_heads=4)  # 4 KV heads: tp=4 divides them
    save_peft_adapter(folder)
    data = root / "rows.jsonl"  # STEPS global batches, and the README run's 2 steps of 32
    data.write_text("".join(json.dumps(row) + "\n" for row in user_rows(max(STEPS * GLOBAL_BATCH, 64))))
    return {"root": root, "folder": folder, "data": data}


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora_runs")
    args = ["--models", str(model["root"]), "--data", str(model["data"])]
    return worker_results("qlora_runs", out, *args) | {"out": out}


@contextlib.contextmanager
def bitsandbytes_pure_torch():
    """bitsandbytes' calls inside run its pure-torch kernels (bitsandbytes.backends.default) where its
    CPU library registers its own: `quantize_blockwise` (quantize_4bit has no CPU kernel)."""
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    library = torch.library.Library("bitsandbytes", "IMPL")
    library.impl(
        "quantize_blockwise", lambda A, code, blocksize: op.redispatch(default, A, code, blocksize), "CPU"
    )
    try:
        yield
    finally:
        library._destroy()


def bnb_nf4(weight: torch.Tensor, pure_torch: bool = True):
    """bitsandbytes' NF4 of the whole weight: (packed codes, QuantState, dequantized weight)."""
    with bitsandbytes_pure_torch() if pure_torch else contextlib.nullcontext():
        packed, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    flat = copy.copy(state)
    flat.shape = torch.Size([weight.numel()])  # see the module docstring
    return packed, state, bnb.dequantize_4bit(packed, flat).view(weight.shape)


@pytest.fixture(scope="module")
def reference(model):
    """{weight name: bnb_nf4 of the model file's weight} in fp32 and bf16."""
    files = load_file(str(model["folder"] / "model.safetensors"))
    linears = [name for name in files if name.endswith("proj.weight")]
    return {
        dtype: {name: bnb_nf4(files[name].to(dtype)) for name in linears}
        for dtype in (torch.float32, torch.bfloat16)
    }


@pytest.mark.parametrize("name", list(SCENARIO))
def test_nf4_codes_scales_and_dequantized_base_equal_bitsandbytes(runs, reference, name):
    """Every adapted weight, quantized shard by shard on this mesh and gathered: the packed 4-bit
    codes, the 8-bit scale codes, state2 and offset are bitsandbytes' of the whole weight, bit for bit,
    and so is the dequantized base."""
    saved = runs[name]
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    assert len(saved["quantized"]) == 2 * 7  # every linear projection of both layers
    for weight, ours in saved["quantized"].items():
        packed, state, dequantized = reference[dtype][weight]
        assert torch.equal(ours["packed"], packed), weight
        assert torch.equal(ours["absmax"], state.absmax), weight
        assert torch.equal(ours["state2"], state.state2.absmax), weight
        assert torch.equal(ours["offset"], state.offset), weight
        assert ours["dequantized"].dtype == dtype and torch.equal(ours["dequantized"], dequantized), weight


@pytest.mark.parametrize(
    ("shape", "tp", "dp", "rowwise"),
    [((7, 9), 1, 1, False), ((33, 50), 1, 3, False), ((30, 50), 2, 3, True), ((96, 600), 3, 2, True)],
)
def test_odd_shapes_quantized_in_pieces_equal_bitsandbytes(shape, tp, dp, rowwise):
    """Shapes the model's weights do not have: a partial last 64-block (divided, not multiplied, by
    bitsandbytes) and a partial last 256-group, odd widths, blocks across rows, tp ranks and dp
    shards. dtrain's format functions on each piece a rank would hold (cut here by hand: tp's rows or
    columns, then dp's rows), the absmax values reduced with max as the all-reduce does, assembled:
    bitsandbytes' quantize_4bit and dequantize_4bit of the whole weight."""
    from dtrain.parallel import nf4

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    packed, state, dequantized = bnb_nf4(weight)
    rows, cols = shape
    pieces = []  # (layout, first row in the piece, values)
    for t in range(tp):
        top, left = (0, t * cols // tp) if rowwise else (t * rows // tp, 0)
        height, width = (rows, cols // tp) if rowwise else (rows // tp, cols)
        layout = nf4.Layout(shape, (top, left), width)
        for d in range(dp):
            first = d * height // dp
            pieces.append(
                (layout, first, weight[top + first : top + first + height // dp, left : left + width])
            )
    absmax = torch.stack([nf4.local_absmax(x, layout, first) for layout, first, x in pieces]).amax(0)
    codes, state2, offset = nf4.double_quantize(absmax, pieces[0][0])
    assert torch.equal(codes, state.absmax) and torch.equal(state2, state.state2.absmax)
    assert torch.equal(offset.reshape(()), state.offset)
    whole_codes, whole = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape)
    for layout, first, x in pieces:
        piece_codes = nf4.quantize_rows(x, absmax, layout, first)
        scales = nf4.scale_codes(codes, layout, first, x.shape[0])
        top, left = layout.origin[0] + first, layout.origin[1]
        region = (slice(top, top + x.shape[0]), slice(left, left + layout.cols))
        whole_codes[region] = nf4.unpack(piece_codes, layout.cols)
        whole[region] = nf4.dequantize_rows(
            piece_codes, scales, state2, offset, layout, first, torch.empty(x.shape)
        )
    assert torch.equal(nf4.bnb_codes(whole_codes), packed)
    assert torch.equal(whole, dequantized)


def test_cpu_library_differs_only_by_farther_scale_codes(model, reference):
    """bitsandbytes' CPU library gives the same 4-bit codes and picks, where its scale codes differ
    from the reference's, a code farther from the value (the reference's is the nearest); those are
    rare."""
    dynamic = bnb.create_dynamic_map()
    files = load_file(str(model["folder"] / "model.safetensors"))
    differ = total = 0
    for name, (packed, state, _) in reference[torch.float32].items():
        library_packed, library, _ = bnb_nf4(files[name], pure_torch=False)
        assert torch.equal(library_packed, packed) and torch.equal(library.state2.absmax, state.state2.absmax)
        absmax = files[name].reshape(-1, 64).abs().amax(-1)
        value = (absmax - state.offset) / state.state2.absmax.repeat_interleave(256)[: len(absmax)]
        mismatch = library.absmax != state.absmax
        ours = (value - dynamic[state.absmax.long()]).abs()
        theirs = (value - dynamic[library.absmax.long()]).abs()
        assert bool((ours[mismatch] < theirs[mismatch]).all()), name
        differ, total = differ + int(mismatch.sum()), total + len(absmax)
    assert differ <= total // 100, (differ, total)


def test_nf4_storage_bytes_per_rank_equal_the_hand_count(model, runs):
    """2x2: each rank stores, per adapted weight, its rows' 4-bit codes (half a byte an element, a
    row rounded up to whole bytes), one 8-bit scale code per 64-block each row touches, and the whole
    weight's fp32 state2 (one per 256 blocks) and fp32 offset."""
    config = AutoModelForCausalLM.from_pretrained(model["folder"]).config
    files = load_file(str(model["folder"] / "model.safetensors"))
    dp, tp = SCENARIO["2x2"][:2]
    expected = 0
    for name, weight in files.items():
        if not name.endswith("proj.weight"):
            continue
        rows, cols = weight.shape
        rowwise = name.split(".")[-2] in ROWWISE
        local_rows, local_cols = (rows // dp, cols // tp) if rowwise else (rows // tp // dp, cols)
        aligned = cols % 64 == 0 and local_cols % 64 == 0  # tp ranks' first columns: multiples of cols
        # a row of local_cols elements touches at most this many 64-blocks
        slots = local_cols // 64 if aligned else (local_cols + 62) // 64 + 1
        blocks = -(weight.numel() // -64)
        expected += local_rows * (-(local_cols // -2) + slots) + 4 * -(blocks // -256) + 4
    assert config.num_hidden_layers == 2
    assert runs["2x2"]["storage_bytes"] == [expected] * dp * tp


def test_fsdp_all_gathers_nf4_bytes_not_dense_weights(model, runs):
    """4x1 (FSDP only): every all-gather of a step moves, for a decoder layer, its adapted weights'
    NF4 bytes (codes and scale codes of every row) and its fp32 adapters and norms; for the root, the
    fp32 embedding, final norm and lm_head. A step gathers the root once, the last layer once and
    the other layer twice (FSDP frees it after forward), one micro-batch a step at dp = 4."""
    files = load_file(str(model["folder"] / "model.safetensors"))
    adapter = load_file(str(model["folder"] / "adapter" / "adapter_model.safetensors"))
    layer = root = dense = 0
    for name, weight in files.items():
        if not name.startswith("model.layers.0."):
            root += weight.numel() * 4 if not name.startswith("model.layers.") else 0
            continue
        if name.endswith("proj.weight"):
            rows, cols = weight.shape
            slots = cols // 64 if cols % 64 == 0 else (cols + 62) // 64 + 1
            layer += rows * (-(cols // -2) + slots)
            dense += weight.numel() * 2  # what a bf16 base would gather
        else:
            layer += weight.numel() * 4  # the norms
    layer += sum(t.numel() * 4 for key, t in adapter.items() if ".layers.0." in key)
    steps = runs["4x1"]["all_gather_bytes"]
    assert len(steps) == 4 * STEPS
    for step in range(STEPS):
        assert sorted(steps[4 * step : 4 * step + 4]) == sorted([root, layer, layer, layer]), step
    nf4_bytes = layer - sum(t.numel() * 4 for key, t in adapter.items() if ".layers.0." in key)
    assert nf4_bytes < 0.3 * dense  # about 0.28 of bf16 at these widths (64, 96: scale codes per row)


@pytest.fixture(scope="module")
def peft_reference(model, reference):
    """PEFT + plain AdamW (helpers.adamw_run, as test_lora's) on the dequantized base, over the chat
    template's rows in file order, GLOBAL_BATCH a step: {"losses", "norms", "adapters", "allowance"}."""
    peft = peft_on_dequantized(model["folder"], reference[torch.float32], trainable=True)
    tokenizer = AutoTokenizer.from_pretrained(model["folder"])
    rows = [
        (ids[:MAX_LEN], labels[:MAX_LEN])
        for ids, labels in chat_rows(tokenizer, user_rows(STEPS * GLOBAL_BATCH))
    ]
    return adamw_run(peft, [rows[step * GLOBAL_BATCH :][:GLOBAL_BATCH] for step in range(STEPS)], LR)


def peft_on_dequantized(folder: Path, reference: dict, trainable: bool = False, adapter: Path | None = None):
    """PeftModel.from_pretrained of the adapter on from_pretrained, its adapted weights replaced by
    bitsandbytes' dequantized ones."""
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, (_, _, dequantized) in reference.items():
            base.get_parameter(name).copy_(dequantized)
    return PeftModel.from_pretrained(base, adapter or folder / "adapter", is_trainable=trainable)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", TRAINED)
def test_loss_grad_norm_and_adapters_match_peft_on_the_dequantized_base(runs, peft_reference, name):
    """10 steps from the same PEFT adapter, fp32. The base is the same bit for bit (the test above),
    so dtrain and PEFT compute one model and differ only in the order of fp32 sums (tp's partial sums,
    FSDP's reduce-scatter over dp, the step's token count, accumulation): the error model's rule
    (tests/tolerance.py), as test_lora's: every step's loss and grad norm within RTOL, every adapter
    element within RTOL of itself plus its AdamW allowance."""
    ref = peft_reference
    history = runs[name]["history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert ref["losses"][-1] < ref["losses"][0]  # the reference learns: the comparison is not vacuous
    for step, (record, loss, norm) in enumerate(zip(history, ref["losses"], ref["norms"], strict=True), 1):
        assert_scalar_close(record["loss"], loss, f"{name} step {step} loss")
        assert_scalar_close(record["grad_norm"], norm, f"{name} step {step} grad norm")
    assert_weights_close(runs[name]["adapters"], ref["adapters"], ref["allowance"], name)


def test_compiled_layers_train_on_the_nf4_base(runs):
    """1x1 runs with parallel.compile=true (its parity above is that of compiled layers): FSDP's
    all-gather gives the compiled layer a dequantized weight, a plain tensor."""
    assert SCENARIO["1x1"][2]["parallel.compile"] and runs["1x1"]["graphs"] >= 1


def test_only_adapted_weights_are_nf4_and_the_adapters_stay_fp32(runs):
    """bf16 run: the adapted weights' logical dtype is bf16 (NF4 storage), the embedding, norms and
    lm_head bf16 (lora.base_dtype=auto's), the adapters fp32."""
    saved = runs["2x2_bf16"]
    assert saved["nf4"] == sorted(saved["quantized"])
    assert all(name.endswith("proj.weight") for name in saved["nf4"])
    for name, dtype in saved["dtypes"].items():
        adapter = ".lora_A." in name or ".lora_B." in name
        assert dtype == (torch.float32 if adapter else torch.bfloat16), name


def test_adapter_and_merged_exports_load_with_the_trained_logits(model, runs, reference):
    """2x2's exports: the PEFT adapter folder on the dequantized base (PeftModel.from_pretrained) and
    the merged folder (the adapters merged into the dequantized base, from_pretrained) give dtrain's
    trained logits."""
    saved = runs["2x2"]
    run_dir = Path(saved["run_dir"])
    adapted = peft_on_dequantized(model["folder"], reference[torch.float32], adapter=run_dir / "hf").eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf-merged", dtype=torch.float32)
    with torch.no_grad():
        assert_logits_close(
            adapted(input_ids=logit_ids()).logits, saved["trained_logits"], "PEFT's adapted logits"
        )
        assert_logits_close(
            merged(input_ids=logit_ids()).logits, saved["trained_logits"], "the merged logits"
        )


def test_readme_command_trains_qlora_at_tp2_and_exports_an_adapter_peft_loads(model, runs):
    """The README's QLoRA line on 4 processes (dp 2 x tp 2), one step: RUN/hf is a PEFT adapter
    folder that PeftModel.from_pretrained loads on the model, whose logits it moved (B is no longer
    zero: AdamW's first step moves every element by about the learning rate)."""
    run_dir = runs["out"] / "readme"
    assert [record["step"] for record in read_metrics(run_dir)] == [1]
    config = json.loads((run_dir / "hf" / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(model["folder"], dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=logit_ids()).logits
        after = PeftModel.from_pretrained(base, run_dir / "hf").eval()(input_ids=logit_ids()).logits
    assert relative_error(after, before) > 1e-7  # above fp32's rounding of unchanged logits (0)


def test_the_start_line_says_nf4_and_the_exports_gather_without_torch_s_warning(runs):
    """The README run's start line (rank 0's log) names the NF4 base, and the 4-rank launch's
    exports (2x2's adapter and merged folders, the README run's adapter) gathered the adapters,
    (_StridedShard, Shard) DTensors, without torch's warning about unmergeable all-gathers (an
    all-gather reduces nothing; the exported values are checked against PEFT above)."""
    log = (runs["out"] / "readme" / "sft.log").read_text()
    (summary,) = [line for line in log.splitlines() if "| mesh " in line]
    assert "LoRA r=16, alpha 8, on an NF4 base (QLoRA; the rest fp32)" in summary, summary
    assert json.loads((runs["out"] / "torch_warnings.json").read_text()) == []


def test_nf4_without_lora_fails_before_any_process_group_with_one_line(model, tmp_path):
    args = [f"model.name_or_path={model['folder']}", f"data.path={model['data']}", "data.input_key=question"]
    outcome = run_in_one_interpreter(tmp_path / "cli", {"nf4": [*args, "lora.base_dtype=nf4"]})["nf4"]
    output = outcome["output"]
    assert outcome["returncode"] == 2, output[-3000:]
    assert "Traceback" not in output and "process group" not in output.lower()
    errors = [line for line in output.splitlines() if line.startswith("dtrain: error:")]
    assert errors == [
        "dtrain: error: lora.base_dtype=nf4 is set but lora.r=0 (LoRA off: every parameter trains); "
        "set lora.r to train adapters"
    ]
