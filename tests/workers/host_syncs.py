"""Host synchronisations of a training step, counted (issue 50): called by tests/workers/perf_mesh.py
in its 4-process launch (2×2: tp 2 × dp 2, gloo).

On a GPU each of these waits for the device, stalling the stream: a read of a tensor's value on the
host (item(), bool(), float(), int(): aten._local_scalar_dense, which every dispatched read goes
through; tolist(), which is not dispatched), a copy to the host (.cpu(), .to("cpu")) and
torch.cuda.synchronize. The CPU cannot see them stall, so they are counted by call site and by phase
(inside a micro-step: its forward and backward; or the rest of the step), around real runs of SFT,
LoRA, a mixture of experts and DPO through the trainer. Each objective's run is made twice, for 1 and
for 3 steps with one log line at the end: what the 2 extra steps do, per step; and what the log
line does.

`.to()` counts where its target is spelled "cpu": a `.to(device)` with the run's device (here the
CPU too) is a copy to the device, which does not wait for it.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.checks import check_config
from dtrain.config import Config, PreferenceConfig
from dtrain.hydra_glue import ASSETS
from dtrain.model import load_model_config
from dtrain.reliability import StepGuard
from dtrain.trainer import train
from tests.helpers import TINY, TINY_MOE, parity_config

MICRO_STEP = "micro-step"
STEP = "step"
LOG = "log"  # the logged step's figures: the trainer's log line (objective.figures, the meter's record)

# Reads of tensors that live on the host on every device: they do not wait for the device.
HOST_TENSOR_READS = {
    "reliability.py:agreed": "the ranks' flags, a CPU tensor on the guard's gloo group",
}


def read_site() -> tuple[str, str]:
    """(the innermost dtrain function on the stack, then the innermost function of all if that is
    another library's: "step.py:optimizer_step > optimizer.py:_get_value"; the phase: MICRO_STEP
    where a dtrain micro_step is on the stack, LOG in the trainer's log line, else STEP)."""
    plumbing = ("host_syncs.py", "/torch/_dynamo/", "/torch/_compile.py", "/torch/utils/_python_dispatch.py")
    frames = [f for f in traceback.extract_stack() if not any(part in f.filename for part in plumbing)]
    ours = [f for f in frames if "/dtrain/" in f.filename] or frames
    sites = [ours[-1]] if ours[-1] is frames[-1] else [ours[-1], frames[-1]]
    site = " > ".join(f"{Path(f.filename).name}:{f.name}" for f in sites)
    if any(f.name == "micro_step" for f in ours):
        return site, MICRO_STEP
    logging = site.startswith("trainer.py:train") or any(f.name in ("figures", "record") for f in ours)
    return site, LOG if logging else STEP


def to_host(args: tuple, kwargs: dict) -> bool:
    """Whether Tensor.to's arguments name the CPU as the target, spelled "cpu"."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.startswith("cpu")


class HostSyncs(TorchDispatchMode):
    """Counts the synchronising calls (module docstring) by (call site, phase)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def count(self) -> None:
        self.sites[read_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        tolist, cpu, to = torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.to

        def counted_to(tensor, *args, **kwargs):
            if to_host(args, kwargs):
                self.count()
            return to(tensor, *args, **kwargs)

        self._patches = [
            mock.patch.object(torch.Tensor, "tolist", lambda t: self.count() or tolist(t)),
            mock.patch.object(torch.Tensor, "cpu", lambda t, *a, **k: self.count() or cpu(t, *a, **k)),
            mock.patch.object(torch.Tensor, "to", counted_to),
            mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: self.count()),
        ]
        for patch in self._patches:
            patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        for patch in self._patches:
            patch.stop()
        return super().__exit__(*exc)


def objective_configs() -> dict[str, Config]:
    """SFT, LoRA, a mixture of experts (Qwen3-MoE, ep 1) and DPO (the embedded preference pairs,
    its precomputed reference), each at tp 2 × dp 2: parity_config's run (2 micro-steps a step)."""
    sft = parity_config(None, dp=2, tp=2)
    lora = parity_config(None, dp=2, tp=2)
    lora.lora.r = 8
    moe = parity_config(None, dp=2, tp=2)
    moe.model.config = dict(model_type="qwen3_moe", **{**TINY, **TINY_MOE})
    base = parity_config(None, dp=2, tp=2)
    dpo = PreferenceConfig(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})
    dpo.data.path, dpo.data.format = str(ASSETS / "dpo_tiny.jsonl"), "preference"
    return {"sft": sft, "lora": lora, "moe": moe, "dpo": dpo}


def syncs_of_a_run(config: Config, steps: int, device: torch.device, run_dir: Path) -> collections.Counter:
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=steps))
    config.train.log_every = steps  # one log line, at the end
    model_config = load_model_config(config.model)
    with HostSyncs() as syncs:
        shape = check_config(config, dist.get_world_size(), model_config)
        train(config, shape, model_config, device, run_dir, resolved={})
    return syncs.sites


def syncs_per_step(config: Config, device: torch.device, out: Path) -> tuple[dict, dict]:
    """({(site, phase): syncs per optimizer step}: what 2 more steps add; {site: syncs of the logged
    step} (the one log line of a run))."""
    short, long = (syncs_of_a_run(config, steps, device, out / f"syncs_{steps}") for steps in (1, 3))
    per_step = {key: (long[key] - short[key]) / 2 for key in long | short if long[key] != short[key]}
    return per_step, {site: n for (site, phase), n in long.items() if phase == LOG}


# The stated syncs (docs/benchmark.md, "Host synchronisations"), per optimizer step outside the
# micro-steps: the non-finite gradient check reads the grad norm once (it decides the optimizer step,
# the schedule's step and the guard's count of skips on the host).
STEP_SYNCS = {"reliability.py:should_skip": 1}
# In the log line, once per logged step: the first read waits for the step, the rest find it done.
# The counts the step's figures are over (supervised tokens, filled rows and slots: one tolist), the
# grad norm, the ranks' max of the meter's figures; and each objective's own (SFT: the loss's sum and
# the token count).
LOGGED_SYNCS = {"base.py:figures": 1, "trainer.py:train": 1, "metrics.py:max_over_ranks": 1}
LOGGED_SYNCS_OF = {
    "sft": LOGGED_SYNCS | {"sft.py:reduce": 2},
    "lora": LOGGED_SYNCS | {"sft.py:reduce": 2},
    "moe": LOGGED_SYNCS | {"sft.py:reduce": 2, "router.py:figures": 2},  # the aux loss, the expert load
    "dpo": LOGGED_SYNCS | {"dpo.py:reduce": 3},  # the pair figures (one tolist), the NLL, the tokens
}


def check_host_syncs(device: torch.device, out: Path) -> None:
    """Per optimizer step, for SFT, LoRA, MoE and DPO at tp 2 × dp 2: inside the micro-steps none but
    a mixture of experts' dispatch (its rows per expert on the host, counts.tolist(): one per layer
    and micro-step, inherent to sizing the grouped matmuls' buffers); outside them STEP_SYNCS; in a
    logged step's log line LOGGED_SYNCS_OF; nothing else. The ranks' agreement reads host flags on a
    gloo group of its own (HOST_TENSOR_READS)."""
    wrong = []  # every objective's, then one assertion: what each counted
    for name, config in objective_configs().items():
        per_step, logged = syncs_per_step(config, device, out / name)
        micro_steps = config.train.global_batch_size // (config.train.micro_batch_size * 2)
        expected_micro = {"experts.py:experts_forward": TINY["num_hidden_layers"] * micro_steps}
        micro = {site: n for (site, phase), n in per_step.items() if phase == MICRO_STEP}
        step = {site: n for (site, phase), n in per_step.items() if phase == STEP}
        if (
            micro != (expected_micro if name == "moe" else {})
            or step != STEP_SYNCS | {site: 1 for site in HOST_TENSOR_READS}
            or any(phase == LOG for _, phase in per_step)  # only in the logged step
            or logged != LOGGED_SYNCS_OF[name]
        ):
            wrong.append(f"{name}: host syncs per step {per_step}, in the logged step {logged}")
    assert not wrong, "\n".join(wrong)
    guard = StepGuard(parity_config(None, dp=2, tp=2).train)
    assert guard.group is not dist.group.WORLD and dist.get_backend(guard.group) == "gloo"
    guard.close()
