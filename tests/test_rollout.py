"""The rollout engines (dtrain/rollout/) against what dtrain did not write: transformers'
`from_pretrained` and `generate`, PEFT's `merge_and_unload`, bitsandbytes' NF4, the safetensors files
transformers saved, and TRL 1.16's completion rule restated here.

tests/workers/rollout_runs.py builds each policy as the trainer does on 1 and 4 processes, syncs it
into the `hf` engine and into the `vllm` engine over a recording stand-in for `vllm.LLM`, and samples.
Where runs are compared with each other (the same completions on 1x1, dp 4 and tp 2 x dp 2), each
is also compared with transformers' own `generate`, so equality carries that reference over.
"""

from __future__ import annotations

import hashlib
import sys
import types

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from dtrain.config import ConfigError, RolloutConfig
from tests.helpers import save_tiny_moe, save_user_model, worker_results
from tests.test_lora import save_peft_adapter
from tests.workers.rollout_runs import DEFAULTS, PROMPTS, SAMPLING, SCENARIOS, SEED

SCENARIO = {**SCENARIOS[1], **SCENARIOS[4]}
EOS_BOOST = 12.0  # the EOS row of lm_head scaled: some completions end early, others are cut


def boost_eos(folder) -> None:
    """Scale the EOS token's lm_head row, so that sampling often ends a completion (and not always)."""
    tensors = load_file(str(folder / "model.safetensors"))
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    tensors["lm_head.weight"][eos] *= EOS_BOOST
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_models")
    # 385 tokens: padded to 386 rows at tp = 2; 4 KV heads, as test_lora's
    llama = save_user_model(root / "llama", num_key_value_heads=4, vocab_size=385)
    boost_eos(llama)
    save_peft_adapter(llama)
    save_peft_adapter(save_user_model(root / "phi3", "phi3"))
    save_tiny_moe(root / "moe")
    return root


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    return worker_results("rollout_runs", tmp_path_factory.mktemp("rollout_runs"), "--models", str(models))


def reference_model(folder, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def every_tensor(model) -> dict[str, torch.Tensor]:
    """A model's parameters (both names of a tied one) and buffers (the non-persistent ones too)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())


def assert_tensors_equal(ours: dict, reference: dict) -> None:
    assert set(ours) == set(reference), sorted(set(ours) ^ set(reference))
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype, (name, ours[name].dtype, tensor.dtype)
        assert torch.equal(ours[name], tensor.detach()), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1x1", "1x1_bf16", "dp4", "2x2", "moe_2x2_ep2"])
def test_synced_generator_equals_from_pretrained(models, runs, name):
    """Before any step the generator holds exactly the weights transformers loads from the folder
    (FSDP, tp with the padded vocabulary, experts over ep; bf16 the compute dtype), buffers too."""
    kind, *_ = SCENARIO[name]
    dtype = torch.bfloat16 if SCENARIO[name][4].get("precision") == "bf16" else torch.float32
    assert_tensors_equal(runs[name]["synced"], every_tensor(reference_model(models / kind, dtype)))


@pytest.mark.slow
def test_synced_lora_policy_equals_peft_merge_and_unload(models, runs):
    """A LoRA policy started from a PEFT adapter reaches the generator as PEFT merges it: Phi-3's, one
    adapter on each fused projection, which dtrain splits into parts sharing A (the QLoRA test merges
    on Llama with a padded vocabulary)."""
    folder = models / "phi3"
    merged = PeftModel.from_pretrained(reference_model(folder), folder / "adapter").merge_and_unload()
    assert_tensors_equal(runs["2x2_phi3_lora"]["synced"], every_tensor(merged))


@pytest.mark.slow
def test_synced_qlora_policy_equals_peft_merge_on_the_bitsandbytes_base(models, runs):
    """The NF4 base (QLoRA) reaches the generator dequantized as bitsandbytes dequantizes it, with
    the adapter merged by PEFT (tp 2 x dp 2: the vocabulary padded to 386 rows, cut back to 385)."""
    from tests.test_qlora import bnb_nf4, peft_on_dequantized

    folder = models / "llama"
    files = load_file(str(folder / "model.safetensors"))
    dequantized = {name: bnb_nf4(files[name]) for name in files if name.endswith("proj.weight")}
    merged = peft_on_dequantized(folder, dequantized, adapter=folder / "adapter").merge_and_unload()
    assert_tensors_equal(runs["2x2_qlora"]["synced"], every_tensor(merged.eval()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1x1", "2x2"])
def test_sync_after_optimizer_steps_equals_the_policys_own_tensors(runs, name):
    """After AdamW steps the generator holds the policy's current weights: each parameter gathered
    whole by torch (`full_tensor`), the vocabulary's padding rows dropped."""
    saved = runs[name]
    policy = {
        n: t[: saved["vocab_size"]] if t.shape[0] > saved["vocab_size"] else t
        for n, t in saved["trained_policy"].items()
    }
    synced = {n: t for n, t in saved["trained_synced"].items() if n in policy}
    assert set(synced) == set(policy)
    assert_tensors_equal(synced, policy)
    changed = [n for n in policy if not torch.equal(policy[n], saved["synced"][n])]
    assert len(changed) == len(policy), "the steps left some weights as they were"


def reference_completions(folder, sampling, generation: int, eos: list[int], pad: int) -> dict[int, list]:
    """transformers' generate on from_pretrained, one prompt's completions a call, seeded by the rule
    of docs (the first 8 bytes of SHA-256 of "seed/generation/index", top bit cleared), the ids cut
    as TRL 1.16's GRPOTrainer masks them (up to and including the first EOS)."""
    model = reference_model(folder)
    settings = GenerationConfig(
        max_new_tokens=sampling.max_completion_length,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    out = {}
    for index, ids in enumerate(PROMPTS):
        digest = hashlib.sha256(f"{SEED}/{generation}/{index}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        batch = torch.tensor([ids] * sampling.num_generations)
        completion_ids = model.generate(
            input_ids=batch, attention_mask=torch.ones_like(batch), generation_config=settings
        )[:, len(ids) :]
        # TRL 1.16 grpo_trainer._generate_single_turn's mask
        is_eos = torch.isin(completion_ids, torch.tensor(eos))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        mask = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
        out[index] = [
            (c[m].tolist(), not bool(e.any()), None)
            for c, m, e in zip(completion_ids, mask, is_eos, strict=True)
        ]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "key,sampling,generation",
    [("completions", SAMPLING, 0), ("generation_1", SAMPLING, 1), ("defaults", DEFAULTS, 0)],
)
def test_hf_engine_samples_as_transformers_generate_with_the_seed_rule(
    models, runs, key, sampling, generation
):
    """Each prompt's completions are transformers' own generate on from_pretrained with the same
    settings (TRL's defaults, and others that each reach a logits processor), seeded by the rule,
    cut at the first EOS."""
    saved = runs["1x1"]
    reference = reference_completions(models / "llama", sampling, generation, saved["eos"], saved["pad"])
    assert saved[key] == reference


@pytest.mark.slow
def test_hf_engine_completions_do_not_depend_on_the_mesh_or_the_batch(runs):
    """The same completions on 1x1, dp 4 (a prompt a rank) and tp 2 x dp 2; a rank's prompts reversed
    or sampled one by one give each prompt the same completions; another generation other ones. Some
    of them end with EOS and some are cut at max_completion_length: both sides of the cut rule ran."""
    for name in ("dp4", "2x2"):
        assert runs[name]["completions"] == runs["1x1"]["completions"], name
        assert runs[name]["generation_1"] == runs["1x1"]["generation_1"], name
    assert all(runs[name]["batching_agrees"] for name in SCENARIO)
    assert runs["1x1"]["completions"] != runs["1x1"]["generation_1"]
    flags = [
        truncated for completions in runs["1x1"]["completions"].values() for _, truncated, _ in completions
    ]
    assert any(flags) and not all(flags), f"completions all cut or all ended: {flags}"


def checkpoint_order(folder) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The names vLLM's load_weights reads, in the model's order: each of from_pretrained's state dict
    tensors (the tied lm_head left out, as the files leave it) through transformers' reverse
    conversions; and the folder's safetensors, what transformers saved."""
    model = reference_model(folder)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    names = [n for name, tensor in state.items() for n in revert_weight_conversion(model, {name: tensor})]
    files = {}
    for file in folder.glob("*.safetensors"):
        files |= load_file(str(file))
    return names, files


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1x1", "2x2", "moe_2x2_ep2"])
def test_vllm_sync_loads_each_checkpoint_tensor_once_in_the_models_order(models, runs, name):
    """Every rank pushes, one tensor a load_weights call, exactly the tensors of the safetensors files
    transformers saved, under their names (a MoE's experts one tensor each; the padding rows gone),
    in the model's order; in sleep mode the weights are woken before and the prefix cache reset after."""
    names, files = checkpoint_order(models / SCENARIO[name][0])
    assert sorted(names) == sorted(files)
    for rank, result in enumerate(runs[name]["vllm"]):
        events = result["events"]
        loads = [event[1] for event in events if event[0] == "load"]
        assert all(len(pairs) == 1 for pairs in loads), f"rank {rank}: a call with several tensors"
        assert [pairs[0][0] for pairs in loads] == names, f"rank {rank}"
        for ((pushed, tensor),) in loads:
            assert tensor.dtype == files[pushed].dtype and torch.equal(tensor, files[pushed]), (rank, pushed)
        kinds = [event[0] if event[0] != "wake_up" else event for event in events]
        expected = ["sleep", ("wake_up", ("weights",)), *["load"] * len(names), "reset_prefix_cache",
                    ("wake_up", ("kv_cache",)), "generate", "sleep"]  # fmt: skip
        assert kinds == expected, f"rank {rank}: {kinds[:3]} ... {kinds[-5:]}"
        assert result["refused_unsynced"], "a generate after sleep without a sync ran"


@pytest.mark.slow
def test_vllm_completions_are_each_requests_own_with_its_seed_and_logprobs(runs):
    """Each completion is one request (n=1) with the settings and seed of its prompt and number; a
    vLLM tensor-parallel group (tp 2 x dp 2: ranks 0-1 and 2-3) samples all its prompts and each
    rank keeps its own, equal to what one rank gets; the ids are cut at the first EOS, each with
    its log-prob."""
    one = runs["1x1"]["vllm"][0]
    requests = [event for event in one["events"] if event[0] == "generate"][0]
    count = SAMPLING.num_generations
    assert requests[1] == [ids for ids in PROMPTS for _ in range(count)]
    for k, params in enumerate(requests[2]):
        index, j = divmod(k, count)
        digest = hashlib.sha256(f"{SEED}/0/{index}/{j}".encode()).digest()
        assert params["seed"] == int.from_bytes(digest[:8], "little") & (2**63 - 1)
        assert (
            params["n"] == 1
            and params["logprobs"] == 0
            and params["max_tokens"] == SAMPLING.max_completion_length
        )
        settings = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        assert {key: params[key] for key in settings} == {key: getattr(SAMPLING, key) for key in settings}
    eos = runs["1x1"]["eos"]
    for index, completions in one["completions"].items():
        assert len(completions) == count
        for ids, truncated, logprobs in completions:
            assert ids[0] == PROMPTS[index][-1] and len(logprobs) == len(ids)
            assert truncated == (eos[0] not in ids) and (truncated or ids.index(eos[0]) == len(ids) - 1)
    by_rank = runs["2x2"]["vllm"]
    for rank, result in enumerate(by_rank):
        generate = [event for event in result["events"] if event[0] == "generate"][0]
        group = rank // 2 * 2  # the prompts of ranks group and group + 1, in rank order
        assert generate[1] == [PROMPTS[i] for i in (group, group + 1) for _ in range(count)], rank
        assert result["completions"] == {rank: one["completions"][rank]}, rank


def fake_vllm(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))


def test_vllm_refused_without_vllm_naming_the_key_and_the_install(monkeypatch):
    from dtrain.rollout.vllm import check

    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of it fails, whether installed or not
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm: vLLM cannot be imported .*dtrain\[vllm\]"):
        check(RolloutConfig(engine="vllm"))
    check(RolloutConfig(engine="hf"))  # other engines need nothing of vLLM
    check(RolloutConfig(engine="file", path="rollouts.jsonl"))


def test_vllm_refused_without_a_gpu_and_with_bad_settings(monkeypatch):
    from dtrain.rollout.vllm import check

    fake_vllm(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm: no CUDA device"):
        check(RolloutConfig(engine="vllm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"^rollout.vllm_tensor_parallel_size=3: .* world size 4"):
        check(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=3), world_size=4)
    with pytest.raises(ConfigError, match=r"^rollout.vllm_gpu_memory_utilization=1.5"):
        check(RolloutConfig(engine="vllm", vllm_gpu_memory_utilization=1.5))
    check(RolloutConfig(engine="vllm", vllm_tensor_parallel_size=2), world_size=4)


def test_completion_is_cut_as_trl_masks_it():
    """sampling.cut against TRL 1.16's mask (is_eos, first index, `<=`) on every EOS position."""
    from dtrain.rollout.sampling import cut

    eos = [1, 7]
    for row in ([3, 4, 5, 6], [1, 4, 5, 6], [3, 4, 7, 1], [3, 4, 5, 7], [2, 2, 2, 2]):
        ids = torch.tensor([row])
        is_eos = torch.isin(ids, torch.tensor(eos))
        eos_idx = torch.full((1,), ids.size(1), dtype=torch.long)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        mask = torch.arange(ids.size(1))[None] <= eos_idx[:, None]
        completion = cut(row, eos, [float(-i) for i in range(len(row))])
        assert completion.ids == ids[0][mask[0]].tolist()
        assert completion.truncated == (not bool(is_eos.any()))
        assert completion.logprobs == [float(-i) for i in range(len(completion.ids))]


def test_eos_ids_are_trls_the_tokenizers_first_then_the_generation_configs(tmp_path):
    """TRL 1.16: every EOS id the model's generation config declares, the tokenizer's first when absent."""
    from transformers import LlamaConfig

    from dtrain.rollout.sampling import eos_token_ids

    config = LlamaConfig(eos_token_id=1)
    assert eos_token_ids(1, config) == [1]
    assert eos_token_ids(5, config) == [5, 1]
    GenerationConfig(eos_token_id=[9, 1]).save_pretrained(tmp_path)
    assert eos_token_ids(1, config, str(tmp_path)) == [9, 1]
    assert eos_token_ids(4, config, str(tmp_path)) == [4, 9, 1]
