"""Launched by tests/test_checkpoint.py by run_worker (1 process, 4, then 1 again): an uninterrupted
run that checkpoints at step 4, resumes of that checkpoint on other meshes, exports, and a load of the
checkpoint into another architecture, and resumes whose train.seed or data.shuffle differ from the
checkpoint's. Checkpoints written without FSDP resume on other meshes too (plain tensors on 1×1,
tp's DTensors on 1×4: parallelize wraps nothing where FSDP has one rank): the first 1-process launch
trains on 1×1 and saves at step 4, the 4-process launch resumes that at 2×2 and 1×4, and its 1×4
resume of the 2×2 checkpoint saves at step 6, which 2×2 resumes and the last 1-process launch
resumes at 1×1 (with the 2×2 checkpoint's own 1×1 resume). The HF import of the sharded folder
and the fp32 export record, on every rank, how many elements each tensor's safetensors reads
returned and how many each write carried (a wrapper around safetensors' safe_open and DCP's
HuggingFaceStorageWriter.write_data). Rank 0 saves `<out>/<name>.pt`."""

from __future__ import annotations

import collections
import contextlib
import math
from unittest import mock

import safetensors
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from dtrain.checks import check_config
from dtrain.config import ConfigError
from dtrain.data.formats import load_tokenizer
from dtrain.distributed import init_distributed
from dtrain.export import export_hf
from dtrain.model import canonical_name, load_model_config
from dtrain.trainer import train
from tests.helpers import full_logits, parity_config, save_results, sharded_model, worker_args

STEPS = 8


def run(
    name,
    out,
    model_dir,
    dp,
    tp,
    device,
    resume_from=None,
    every=0,
    steps=STEPS,
    changes=None,
    **model_overrides,
):
    """Train (resuming `resume_from` if given); `changes`: {"section.key": value} set on the config."""
    config = parity_config(model_dir, dp, tp)
    for dotted, value in (changes or {}).items():
        section, key = dotted.split(".")
        setattr(getattr(config, section), key, value)
    config.train.max_steps = steps
    config.checkpoint.every = every
    config.checkpoint.dir = str(out / "checkpoints")
    config.model.config.update(model_overrides)
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    return train(config, shape, model_config, device, out / name, resolved, resume_from)


@contextlib.contextmanager
def recorded_reads():
    """{safetensors key: elements this rank read of it} while the block runs: every safe_open handle
    (DCP's HF reader opens them through the module's attribute) counts what get_slice(...)[...] and
    get_tensor return; header reads (keys, shapes) count nothing."""
    reads = collections.Counter()
    real = safetensors.safe_open

    class Slice:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def __getitem__(self, index):
            tensor = self.inner[index]
            reads[self.key] += tensor.numel()
            return tensor

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, key):
            return Slice(key, self.inner.get_slice(key))

        def get_tensor(self, key):
            tensor = self.inner.get_tensor(key)
            reads[key] += tensor.numel()
            return tensor

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with mock.patch.object(safetensors, "safe_open", lambda *args, **kwargs: Handle(real(*args, **kwargs))):
        yield reads


@contextlib.contextmanager
def recorded_writes():
    """{tensor name: elements this rank's export writes of it}, from the write plan DCP hands this
    rank's HuggingFaceStorageWriter."""
    writes = collections.Counter()
    real = HuggingFaceStorageWriter.write_data

    def write_data(self, plan, planner):
        for item in plan.items:
            if item.tensor_data is not None:
                writes[item.index.fqn] += math.prod(item.tensor_data.chunk.sizes)
        return real(self, plan, planner)

    with mock.patch.object(HuggingFaceStorageWriter, "write_data", write_data):
        yield writes


def shard_sizes(model) -> dict[str, tuple[int, int]]:
    """{name: (elements of this rank's shard, elements of the whole tensor)}."""
    return {
        canonical_name(name): (param.to_local().numel(), param.numel())
        for name, param in model.named_parameters()
    }


def gathered(value):
    """Every rank's value, in rank order (collective: every rank calls it)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    args = worker_args()
    out = args.out
    device = init_distributed(timeout_s=300)
    step4 = out / "checkpoints" / "step-00000004"
    step4_1x1 = out / "w1x1" / "checkpoints" / "step-00000004"  # written on 1×1 (the first launch)
    step6_1x4 = out / "resume_1x4" / "checkpoints" / "step-00000006"  # written on 1×4
    results = {}
    if dist.get_world_size() == 1 and not step4.exists():  # the first launch: 1×1 writes a checkpoint
        run("w1x1", out / "w1x1", args.untied, 1, 1, device, every=4)  # the whole schedule's steps
    elif dist.get_world_size() == 4:
        full = run("full", out, args.untied, 2, 2, device, every=4)
        # the export before any forward: the root module's parameters would stay gathered after one
        with recorded_writes() as writes:
            export_hf(full.model, load_tokenizer(str(args.untied)), out / "hf_untied", "fp32")
        results["export_writes"] = gathered((dict(writes), shard_sizes(full.model)))
        results["full"] = {"history": full.history, "logits": full_logits(full.model)}
        for name, (dp, tp) in {"resume_2x2": (2, 2), "resume_1x4": (1, 4), "resume_4x1": (4, 1)}.items():
            every = 2 if name == "resume_1x4" else 0  # step6_1x4
            results[name] = {
                "history": run(name, out / name, args.untied, dp, tp, device, step4, every=every).history
            }
        for name, (dp, tp, checkpoint) in {
            "resume_2x2_from_1x1": (2, 2, step4_1x1),
            "resume_1x4_from_1x1": (1, 4, step4_1x1),
            "resume_2x2_from_1x4": (2, 2, step6_1x4),
        }.items():
            history = run(name, out / name, args.untied, dp, tp, device, checkpoint).history
            results[name] = {"history": history}
        tied = run("tied", out / "tied", args.tied, 2, 2, device, steps=3)
        results["tied"] = {"logits": full_logits(tied.model)}
        export_hf(tied.model, load_tokenizer(str(args.tied)), out / "hf_tied", "fp32")
        with recorded_reads() as reads:
            imported = sharded_model(parity_config(out / "sharded", 2, 2), device)
        # the shards before any forward: the root module's parameters stay gathered after one
        reads = gathered((dict(reads), shard_sizes(imported)))
        results["sharded_import"] = {"logits": full_logits(imported), "reads": reads}
        try:
            run("other_arch", out / "other", None, 2, 2, device, step4, intermediate_size=96)
            results["other_arch"] = {"error": None}
        except ConfigError as error:
            results["other_arch"] = {"error": str(error)}
        for dotted, value in (("train.seed", 7), ("data.shuffle", False)):  # the checkpoint's: 0, true
            name = f"changed_{dotted.split('.')[1]}"
            try:
                run(name, out / name, args.untied, 2, 2, device, step4, changes={dotted: value})
                results[name] = {"error": None}
            except ConfigError as error:
                results[name] = {"error": str(error)}
    else:
        for name, checkpoint in {"resume_1x1": step4, "resume_1x1_from_1x4": step6_1x4}.items():
            results[name] = {"history": run(name, out / name, args.untied, 1, 1, device, checkpoint).history}
    save_results(results, out)


if __name__ == "__main__":
    main()
