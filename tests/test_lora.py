"""LoRA on the 2-D mesh against single-process Hugging Face + `peft` (fp32, gloo).

tests/workers/lora_runs.py trains every scenario through dtrain's trainer on 1 and 4 processes; the
reference here is `peft.get_peft_model` (or `PeftModel.from_pretrained` of the same PEFT-written
adapter) on `from_pretrained`, and a plain AdamW loop over rows tokenized by the tokenizer's own chat
template (helpers.chat_rows), in file order: it shares no dtrain code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dtrain.metrics import flops_per_token
from tests import reference
from tests.helpers import (
    adamw_run,
    chat_rows,
    one_interpreter_command,
    read_metrics,
    run,
    run_in_one_interpreter,
    save_user_model,
    sft,
    user_rows,
    worker_results,
)
from tests.tolerance import assert_logits_close, assert_scalar_close, assert_weights_close
from tests.workers.lora_runs import ALPHA, GLOBAL_BATCH, LR, MAX_LEN, SCENARIOS, STEPS, R, logit_ids

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = STEPS * GLOBAL_BATCH
# Gemma 3's quirks at the user model's size: tied head, scaled embedding, query_pre_attn_scalar,
# sliding and full layers with their own rotary bases
GEMMA3 = dict(
    head_dim=16,
    query_pre_attn_scalar=32,
    sliding_window=8,
    tie_word_embeddings=True,
    layer_types=["sliding_attention", "full_attention"],
)


def write_rows(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in user_rows(ROWS)))
    return path


# The model whose PEFT adapter is rsLoRA (alpha / sqrt(r)): lora.adapter takes use_rslora from it
RSLORA_ADAPTER = "qwen3"


def save_peft_adapter(folder: Path) -> None:
    """A PEFT-written adapter of the folder's model with non-zero A and B (seeded), at folder/adapter:
    on every linear projection of the decoder layers, by PEFT's own names (Phi-3: qkv_proj, gate_up_proj)."""
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        use_rslora=folder.name == RSLORA_ADAPTER,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(folder / "adapter")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_models")
    folders = {
        "llama": save_user_model(root / "llama", num_key_value_heads=4),  # 4 KV heads: tp=4 divides them
        "tied": save_user_model(root / "tied", num_key_value_heads=4, tie_word_embeddings=True),
        "qwen3": save_user_model(root / "qwen3", "qwen3", num_key_value_heads=4, head_dim=16),
        "phi3": save_user_model(root / "phi3", "phi3"),
        "gemma3": save_user_model(root / "gemma3", "gemma3_text", **GEMMA3),
        "olmo2": save_user_model(root / "olmo2", "olmo2"),
    }
    for folder in folders.values():
        save_peft_adapter(folder)
    return {"root": root, "data": write_rows(root / "rows.jsonl"), **folders}


@pytest.fixture(scope="module")
def lora_runs(models, tmp_path_factory):
    """Every scenario: one launch per world size, each sharing its process group across scenarios."""
    out = tmp_path_factory.mktemp("lora_runs")
    return worker_results("lora_runs", out, "--models", str(models["root"]), "--data", str(models["data"]))


def peft_model(folder: Path, start: str, init: dict | None, use_rslora: bool = False):
    """PEFT on from_pretrained: the folder's PEFT adapter, or PEFT's own init with A set to dtrain's
    initial A (the A's draw is a generator's; B is zero in both)."""
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    if start == "adapter":
        return PeftModel.from_pretrained(base, folder / "adapter", is_trainable=True)
    config = LoraConfig(
        r=R, lora_alpha=ALPHA, use_rslora=use_rslora, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    state = model.state_dict()
    for key, tensor in init.items():  # base_model.model.X.lora_A.weight → X.lora_A.default.weight
        name = key.replace(".weight", ".default.weight")
        assert torch.count_nonzero(state[name]) == 0 or "lora_A" in name
        state[name].copy_(tensor)
    return model


def step_documents(folder: Path, data: Path, packed: bool) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's (input_ids, labels) sequences, each run alone: GLOBAL_BATCH rows a step in file
    order, rendered by the tokenizer's chat template; packed (data.packing), tests/reference.py's
    packed rows, document by document (what the document mask computes)."""
    if not packed:
        rows = [
            (ids[:MAX_LEN], labels[:MAX_LEN])
            for ids, labels in chat_rows(AutoTokenizer.from_pretrained(folder), user_rows(ROWS))
        ]
        return [rows[step * GLOBAL_BATCH :][:GLOBAL_BATCH] for step in range(STEPS)]
    settings = reference.Data(
        path=data, tokenizer=folder, max_len=MAX_LEN, packing=True, shuffle=False, input_key="question"
    )
    batches = reference.stream(settings, GLOBAL_BATCH)
    return [
        [
            (row.input_ids[start:stop], row.labels[start:stop])
            for row in next(batches)
            for start, stop in row.spans
        ]
        for _ in range(STEPS)
    ]


def reference_run(
    folder: Path, data: Path, start: str, init: dict | None, packed: bool, use_rslora: bool
) -> dict:
    """PEFT + plain AdamW (helpers.adamw_run: decay 0.1, betas 0.9/0.95, clip 1.0, warmup 2 + cosine),
    the loss a token mean over the step: {"losses", "norms", "adapters", "allowance"}."""
    return adamw_run(peft_model(folder, start, init, use_rslora), step_documents(folder, data, packed), LR)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart: for checks that training moved something, not for parity (tests/tolerance.py)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


PARITY = [
    name
    for world in SCENARIOS.values()
    for name, (_, _, _, _, overrides) in world.items()
    if not overrides.get("lora.dropout") and not overrides.get("train.precision")
]


SCENARIO = {**SCENARIOS[1], **SCENARIOS[4]}


@pytest.fixture(scope="module")
def references(models, lora_runs):
    """One reference run per model, start, data layout and initial adapters: scenarios that differ
    only in the mesh share it (dtrain's init does not depend on the mesh: test_dtrain_init_is_peft_init)."""
    cache: dict = {}

    def get(name: str):
        _, _, kind, start, overrides = SCENARIO[name]
        packed, use_rslora = bool(overrides.get("data.packing")), bool(overrides.get("lora.use_rslora"))
        init = lora_runs[name].get("init")
        runs = cache.setdefault((kind, start, packed, use_rslora), [])
        for seen, result in runs:
            if init is None or all(torch.equal(seen[key], tensor) for key, tensor in init.items()):
                return result
        result = reference_run(models[kind], models["data"], start, init, packed, use_rslora)
        runs.append((init, result))
        return result

    return get


@pytest.mark.parametrize("name", PARITY)
def test_loss_grad_norm_and_adapters_match_single_process_peft(lora_runs, references, name):
    """test_parity's rule: every step's loss and grad norm within RTOL, every adapter element within
    RTOL of itself plus its AdamW allowance (tests/tolerance.py)."""
    ref = references(name)
    saved = lora_runs[name]
    history = saved["history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert ref["losses"][-1] < ref["losses"][0]  # the reference learns: the comparison is not vacuous
    for step, (record, loss, norm) in enumerate(zip(history, ref["losses"], ref["norms"], strict=True), 1):
        assert_scalar_close(record["loss"], loss, f"{name} step {step} loss")
        assert_scalar_close(record["grad_norm"], norm, f"{name} step {step} grad norm")
    assert_weights_close(saved["adapters"], ref["adapters"], ref["allowance"], name)


@pytest.mark.parametrize("name", [n for world in SCENARIOS.values() for n in world])
def test_only_adapters_train_and_the_base_stays_bit_identical(models, lora_runs, name):
    """The frozen base after training equals the model's safetensors bit for bit (rounded once to
    bf16 in a bf16 run: lora.base_dtype=auto); only adapters are trainable and only they have AdamW
    state."""
    saved = lora_runs[name]
    kind = SCENARIO[name][2]
    files = load_file(str(models[kind] / "model.safetensors"))
    base = {key: value for key, value in saved["base"].items() if key in files}
    assert set(files) <= set(saved["base"])  # lm_head of the tied model is the embedding, one tensor
    for key, tensor in base.items():
        assert torch.equal(tensor, files[key].to(tensor.dtype)), key
    assert saved["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in saved["trainable"])
    assert saved["optimizer_states"] == len(saved["trainable"])


def test_dtrain_init_is_peft_init(lora_runs):
    """A Kaiming-uniform(a=sqrt(5)): within ±1/sqrt(fan_in), spread over it; B zero."""
    init = lora_runs["2x2"]["init"]
    for key, tensor in init.items():
        if ".lora_B." in key:
            assert torch.count_nonzero(tensor) == 0, key
        else:
            bound = 1 / tensor.shape[1] ** 0.5
            assert tensor.abs().max() <= bound and tensor.abs().max() > 0.9 * bound, key
            assert tensor.std() == pytest.approx(bound / 3**0.5, rel=0.15), key
    assert torch.equal(
        lora_runs["1x1"]["init"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
        init["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
    )  # mesh-independent


EXPORTED = ["2x2", "2x2_phi3"]  # Phi-3: the split parts' adapters written as PEFT's fused ones


@pytest.mark.parametrize("name", EXPORTED)
def test_adapter_export_loads_in_peft_with_the_trained_logits(models, lora_runs, name):
    saved = lora_runs[name]
    base = AutoModelForCausalLM.from_pretrained(models[SCENARIO[name][2]], dtype=torch.float32)
    ids = logit_ids()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        logits = PeftModel.from_pretrained(base, Path(saved["run_dir"]) / "hf").eval()(input_ids=ids).logits
    assert_logits_close(logits, saved["trained_logits"])
    assert relative_error(logits, base_logits) > 1e-3  # training moved the adapters: not the base's


@pytest.mark.parametrize("name", EXPORTED)
def test_merged_export_loads_in_transformers_with_the_trained_logits(lora_runs, name):
    saved = lora_runs[name]
    model = AutoModelForCausalLM.from_pretrained(Path(saved["run_dir"]) / "hf-merged", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=logit_ids()).logits
    assert_logits_close(logits, saved["trained_logits"])


@pytest.mark.parametrize("name", EXPORTED)
def test_checkpoint_from_2x2_resumes_at_tp1_on_the_uninterrupted_curve(lora_runs, references, name):
    """dtrain against dtrain on purpose (the reference is the same run not interrupted, which is
    PEFT's above), at the rule's tolerances: the adapters within the PEFT run's AdamW allowance of the
    whole run, which bounds what the resumed steps alone can add."""
    saved = lora_runs[name]
    uninterrupted = {h["step"]: h for h in saved["history"]}
    resumed = saved["resumed_history"]
    assert [h["step"] for h in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
    for record in resumed:
        for key in ("loss", "grad_norm"):
            expected = uninterrupted[record["step"]][key]
            assert_scalar_close(record[key], expected, f"{name} resumed step {record['step']} {key}")
    assert_weights_close(saved["resumed_adapters"], saved["adapters"], references(name)["allowance"], name)


def test_bf16_keeps_a_bf16_base_and_fp32_adapters_and_tracks_fp32(lora_runs):
    """lora.base_dtype=auto in a bf16 run: the frozen base is stored in bf16 (2 bytes a parameter),
    the adapters in fp32; the losses track the fp32 run's (dtrain's own, the same rows and init)."""
    saved = lora_runs["1x1_bf16"]
    for name, dtype in saved["dtypes"].items():
        expected = torch.float32 if name in saved["trainable"] else torch.bfloat16
        assert dtype == expected, name
    fp32 = [h["loss"] for h in lora_runs["1x1"]["history"]]
    assert [h["loss"] for h in saved["history"]] == pytest.approx(fp32, rel=2e-2)


def test_compiled_scenario_compiled_its_layers(lora_runs):
    """1x1 runs with parallel.compile=true: its parity above is that of compiled layers."""
    compiled = [name for name, scenario in SCENARIO.items() if scenario[4].get("parallel.compile")]
    assert compiled and all(lora_runs[name]["graphs"] >= 1 for name in compiled)


def test_flops_per_token_counts_no_weight_gradients_for_the_frozen_base(models):
    """dtrain's FLOPs a token (MFU's numerator) against a hand count over PEFT's model of the same
    Llama: 2 a multiply-accumulate of every Linear (the base's, lm_head's, the adapters') in the
    forward, 2 again for the activation gradients, 2 for the weight gradients of the adapters only,
    and attention's 12·L·d·S; the convention also counts the norms' weights like a Linear's (4 each:
    forward and activation gradient, frozen)."""
    base = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    config = base.config
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS))
    linears = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    total = sum(p.numel() for p in model.parameters())
    attention = 12 * config.num_hidden_layers * config.hidden_size * MAX_LEN
    hand = 2 * sum(linears) + 2 * sum(linears) + 2 * adapters + attention
    assert flops_per_token(config, total, MAX_LEN, adapters) == hand + 4 * norms
    # full training: weight gradients for every Linear too (the embedding, a lookup, has none)
    full = flops_per_token(config, total, MAX_LEN, total)
    assert full == 6 * sum(linears) + attention + 6 * norms
    assert full - flops_per_token(config, total, MAX_LEN, adapters) == 2 * (sum(linears) + norms - adapters)


def test_dropout_masks_agree_over_tp_and_the_loss_falls(lora_runs):
    saved = lora_runs["2x2_dropout"]
    assert saved["masks_agree"]
    losses = [h["loss"] for h in saved["history"]]
    assert losses[-1] < losses[0]


def test_cli_tp2_lora_trains_and_exports_an_adapter_peft_loads(models, tmp_path):
    """The issue's command line at world 4 (dp 2 x tp 2): the summary gives the trainable share, and
    RUN/hf is a PEFT adapter folder whose model gives the logits the trained run's merged export does."""
    args = [
        f"model.name_or_path={models['llama']}",
        f"data.path={models['data']}",
        "data.input_key=question",
        "parallel.tp=2",
        "lora.r=8",
        "train.max_steps=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "checkpoint.export_hf=true",
        "checkpoint.export_merged=true",
        "checkpoint.export_dtype=fp32",
        f"hydra.run.dir={tmp_path}",
    ]
    result = sft(4, *args, timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:]
    summary = next(line for line in result.stdout.splitlines() if "per-rank shards" in line)
    assert "M trainable (" in summary
    assert len(read_metrics(tmp_path)) == 2
    config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == sorted(TARGETS)
    base = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=logit_ids()).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "hf").eval()(input_ids=logit_ids()).logits
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-merged", dtype=torch.float32)
    with torch.no_grad():
        assert_logits_close(merged(input_ids=logit_ids()).logits, adapted)
    assert relative_error(adapted, base_logits) > 1e-4  # two steps moved B off zero


# PEFT variants whose model is not W x + scaling · B A x on every target, as PEFT writes them: refused
# (docs/lora.md, "Starting from an adapter"), each named by its adapter_config.json key
PEFT_VARIANTS = {
    "use_dora": dict(use_dora=True),
    "rank_pattern": dict(rank_pattern={"q_proj": 8}),
    "alpha_pattern": dict(alpha_pattern={"q_proj": 32}),
    "modules_to_save": dict(modules_to_save=["lm_head"]),
    "bias": dict(bias="lora_only"),
}


@pytest.fixture(scope="module")
def refusals(models, tmp_path_factory):
    """`python -m dtrain.sft ARGS` for each refused LoRA setting, as dtrain.sft.main() in one
    interpreter (the checks come before any process group): a bad target module, lora.base_dtype=bf16
    in an fp32 run, and an adapter folder of each variant in PEFT_VARIANTS (its adapter_config.json
    written by PEFT's own LoraConfig; the refusal comes before the weights are read)."""
    root = tmp_path_factory.mktemp("lora_refusals")
    common = [
        f"model.name_or_path={models['llama']}",
        f"data.path={models['data']}",
        "data.input_key=question",
    ]
    commands = {
        "bad_target": ["lora.r=8", "lora.target_modules=[q_proj,qkv]"],
        "bf16_base_in_fp32": ["lora.r=8", "lora.base_dtype=bf16", "train.precision=fp32"],
    }
    for name, variant in PEFT_VARIANTS.items():  # adapter_config.json as PEFT writes it; any weights
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **variant).save_pretrained(
            root / name
        )
        shutil.copy(models["llama"] / "adapter" / "adapter_model.safetensors", root / name)
        commands[name] = [f"lora.adapter={root / name}"]
    commands = {
        name: [*common, *args, f"hydra.run.dir={root / 'runs' / name}"] for name, args in commands.items()
    }
    return run_in_one_interpreter(root / "cli", commands)


def refused_with_one_line(outcome: dict) -> str:
    """The one `dtrain: error:` line of a command refused with exit code 2, before any process group."""
    output = outcome["output"]
    assert outcome["returncode"] == 2, output[-3000:]
    assert "Traceback" not in output and "process group" not in output.lower()
    errors = [line for line in output.splitlines() if line.startswith("dtrain: error:")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def test_a_bad_target_module_fails_before_any_process_group_with_one_line(refusals):
    assert refused_with_one_line(refusals["bad_target"]) == (
        "dtrain: error: lora.target_modules: 'qkv' names no linear projection of the decoder layers "
        "(they are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"
    )


def test_a_bf16_base_in_an_fp32_run_is_refused(refusals):
    line = refused_with_one_line(refusals["bf16_base_in_fp32"])
    assert "lora.base_dtype=bf16" in line and "train.precision=bf16" in line, line


@pytest.mark.parametrize("key", PEFT_VARIANTS)
def test_a_peft_variant_dtrain_does_not_compute_is_refused_naming_its_key(refusals, key):
    """DoRA, per-module ranks and alphas, extra trained modules and trained biases: each adapter
    folder, written by PEFT itself, is refused naming the key and its value."""
    line = refused_with_one_line(refusals[key])
    assert line.startswith("dtrain: error: lora.adapter=") and f"{key}=" in line, line
    assert line.endswith("is not supported"), line


def test_export_from_a_lora_checkpoint_writes_the_adapter_and_the_merged_model(models, lora_runs, tmp_path):
    """python -m dtrain.export on 2x2's middle checkpoint: the adapter folder and, with --merged, the
    merged model give the same logits (PEFT's model against transformers' own). Both commands are
    dtrain.export's main() in one interpreter (tests/workers/cli_many)."""
    checkpoint = Path(lora_runs["2x2"]["run_dir"]) / "checkpoints" / f"step-{STEPS // 2:08d}"
    exports = {"adapter": [], "merged": ["--merged"]}
    commands = {
        out: [str(checkpoint), str(tmp_path / out), "--dtype", "fp32", *extra]
        for out, extra in exports.items()
    }
    result = run(one_interpreter_command(tmp_path / "cli", commands, module="dtrain.export"))
    assert result.returncode == 0, result.stdout[-3000:]
    for out, outcome in json.loads((tmp_path / "cli" / "out.json").read_text()).items():
        assert outcome["returncode"] == 0, (out, outcome["output"][-3000:])
    base = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=logit_ids()).logits
        assert_logits_close(merged(input_ids=logit_ids()).logits, adapted)
