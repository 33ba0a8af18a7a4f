"""The routers of a mixture-of-experts model: each step's routing figures and HF's load-balancing
(aux) loss, read off the routers by forward hooks.

HF's loss (`load_balancing_loss_func`) is E · Σ_e (C_e / (L·N)) · (P_e / (L·N)): C_e the top-k
assignments to expert e and P_e its router probability summed over the L expert layers and the N
tokens it is computed over. Which tokens (`moe.aux_scope`, `moe.aux_mask_padding`):

- `micro_step` (default): the rows of one micro-step, on every rank (its rows, cp parts and, at
  tp > 1, sequence-parallel parts). Each rank counts its tokens' routes in the forward; after the
  forward the counts (L × E numbers) are summed over every rank, and each rank adds
  coef · E/(L·N)² · Σ_e C_e · P_e(its tokens) / A to its loss (A micro-steps a step): the P part stays
  local and differentiable, the gradients summed over ranks are those of HF's loss on the micro-step's
  rows. No extra forward; the step's aux loss is the mean over its micro-steps.
- `global_batch`: the whole step's rows. C is then known only after every micro-step's forward, and
  the gradient needs it, so the step first counts the routes in a forward without gradients
  (`count`); each micro-step then adds coef · E/(L·N)² · Σ_e C_e · P_e(its tokens).

With `aux_mask_padding` (default) the padding slots are left out of C, P and N, as HF leaves out what
the attention mask marks; else every slot counts (HF called without an attention mask).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import MoeConfig
from dtrain.distributed import Parallel
from dtrain.parallel.experts import ROUTERS, experts_modules, num_experts


class RouterStats:
    """Each step's routing, recorded while a micro-batch's forward runs inside `record`: the expert
    counts per layer (for the expert load and the aux loss) and each layer's summed router
    probabilities of that forward (differentiable; aux loss only)."""

    def __init__(
        self, model: nn.Module, routers: list[nn.Module], parallel: Parallel, settings: MoeConfig
    ) -> None:
        config = model.config
        self.num_experts, self.layers, self.top_k = (
            num_experts(config),
            len(routers),
            config.num_experts_per_tok,
        )
        self.index = {id(router): layer for layer, router in enumerate(routers)}
        self.coef = config.router_aux_loss_coef if getattr(config, "output_router_logits", False) else 0.0
        self.scope, self.mask_padding = settings.aux_scope, settings.aux_mask_padding
        # At tp > 1 a router sees its tp rank's sequence-parallel part of each row (moe.py).
        self.tp, self.tp_rank = parallel.tp_size, parallel["tp"].get_local_rank()
        self.recording = False
        self.weight: torch.Tensor | None = None  # per routed token: 1 counted, 0 padding (None: all)
        self.counts = torch.zeros(0)  # [layers, experts]: the step's, summed over ranks if `reduced`
        self.forward_counts = torch.zeros(0)  # this rank's, of the recorded forward
        self.reduced = False
        self.micro_steps = 1
        self.probs: list[torch.Tensor] = []
        self.aux = torch.zeros(())
        for router in routers:
            router.register_forward_hook(self._record)

    @classmethod
    def attach(cls, model: nn.Module, parallel: Parallel, settings: MoeConfig) -> RouterStats | None:
        """Hooks on every router (the experts' sibling `gate`, or ROUTERS' name); None for a model
        without experts."""
        modules, router = dict(model.named_modules()), ROUTERS.get(model.config.model_type, "gate")
        routers = [modules[f"{name.rsplit('.', 1)[0]}.{router}"] for name, _ in experts_modules(model)]
        return cls(model, routers, parallel, settings) if routers else None

    def begin_step(self, micro_batches: list, forward: Any) -> None:
        """Start the step's record; with an aux loss over the global batch, count the whole step's
        routes first (`count`). `forward(micro_batch)` runs the objective's forward."""
        device = micro_batches[0]["input_ids"].device
        self.counts = torch.zeros(self.layers, self.num_experts, device=device)
        self.aux, self.reduced, self.probs = torch.zeros((), device=device), False, []
        self.micro_steps = len(micro_batches)
        if self.coef and self.scope == "global_batch":
            self.count(forward, micro_batches)

    @contextmanager
    def record(self, micro_batch: dict[str, Any]) -> Iterator[None]:
        """Record the routes of the forward run inside (of this rank's part of `micro_batch`); its
        backward (activation checkpointing's recomputed forward) goes inside too, unrecorded."""
        self.recording, self.weight = True, self._token_weight(micro_batch)
        self.forward_counts = torch.zeros(self.layers, self.num_experts, device=self.counts.device)
        try:
            yield
        finally:
            self.recording, self.weight, self.probs = False, None, []

    def _token_weight(self, micro_batch: dict[str, Any]) -> torch.Tensor | None:
        """1.0 for each token the routers see that counts (0.0 padding), in their order: the rows'
        slots flattened, at tp > 1 this tp rank's part of each row (sequence parallel's Shard(1),
        even: checks.check_sequence_split)."""
        if not self.mask_padding:
            return None
        filled = micro_batch["filled"]  # dtrain.step.with_filled_slots
        if self.tp > 1:
            filled = filled.tensor_split(self.tp, dim=1)[self.tp_rank]
        return filled.reshape(-1).float()

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        logits, _, indices = output
        weight = self.weight
        if weight is not None and weight.shape[0] != indices.shape[0]:
            raise RuntimeError(
                f"router of layer {self.index[id(module)]}: {indices.shape[0]} tokens, but the micro-batch "
                f"has {weight.shape[0]} on this rank: its padding cannot be left out"
            )
        probs = None
        if self.coef and torch.is_grad_enabled():
            # also when not recording: activation checkpointing's recomputed forward (inside `record`)
            # must save the tensors the recorded forward saved
            probs = torch.softmax(logits.float(), dim=-1)
            probs = (probs if weight is None else probs * weight[:, None]).sum(0)
        if not self.recording:  # eval, other forwards, and the recomputed forward in backward
            return
        assigned = torch.ones_like(indices, dtype=torch.float) if weight is None else weight[:, None]
        counts = self.forward_counts[self.index[id(module)]]
        counts.index_add_(0, indices.flatten(), assigned.expand(indices.shape).flatten())
        if probs is not None:
            self.probs.append(probs)

    def count(self, forward: Any, micro_batches: list) -> None:
        """moe.aux_scope=global_batch: the step's counts before its first gradient, from a forward of
        every micro-batch without gradients, summed over every rank (each holds other tokens)."""
        with torch.no_grad():
            for micro_batch in micro_batches:
                with self.record(micro_batch):
                    forward(micro_batch)
                self.counts += self.forward_counts
        dist.all_reduce(self.counts)
        self.reduced = True

    def aux_term(self) -> torch.Tensor | None:
        """After the recorded forward: its counts join the step's, and its share of coef · aux (None
        without the aux loss) comes back, to add to its loss."""
        self.recording = False
        if not self.coef:
            self.counts += self.forward_counts  # this rank's: figures() sums them over the ranks
            return None
        if self.scope == "micro_step":
            dist.all_reduce(self.forward_counts)  # the micro-step's counts, every rank's tokens
            self.counts += self.forward_counts
            self.reduced = True
            counts, weight = self.forward_counts, 1.0 / self.micro_steps
        else:  # global_batch: counted by `count`
            counts, weight = self.counts, 1.0
        assigned = counts.sum(0)  # C_e over every layer
        rows = (assigned.sum() / self.top_k).clamp(min=1)  # L·N: each token is assigned top_k times a layer
        share = weight * self.num_experts * (assigned * torch.stack(self.probs).sum(0)).sum() / rows**2
        self.probs = []
        self.aux += share.detach()
        return self.coef * share

    def figures(self) -> dict[str, float]:
        """The step's aux_loss (unscaled, HF's `aux_loss`; with micro_step, the mean over the
        micro-steps) and expert load: the worst layer's busiest expert over its mean (1.0: perfectly
        balanced), over the step's counted tokens. A collective: every rank calls it."""
        aux = self.aux.clone()
        dist.all_reduce(aux)
        counts = self.counts.clone()
        if not self.reduced:
            dist.all_reduce(counts)
        load = (counts.max(dim=1).values / counts.mean(dim=1)).max().item()
        return {**({"aux_loss": aux.item()} if self.coef else {}), "expert_load": load}
