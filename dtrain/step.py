"""One training step, in the functions the trainer, the planner (dtrain.estimate) and the benchmark
all run, in the order the loop calls them: this rank's part of each micro-batch on its device, the
step's token counts, forward, loss and backward of a micro-batch (`micro_step`, SFT's token loss:
dtrain.objectives.sft.TokenLoss runs it), then clip and AdamW (`optimizer_step`); and the eval loss over
the eval set."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.distributed import Parallel
from dtrain.fused_loss import FusedLinearCrossEntropy
from dtrain.loss import (
    IGNORE,
    chunked_summed_cross_entropy,
    head_detached,
    loss_context,
    summed_cross_entropy,
)
from dtrain.optim import clip_grads, global_grad_norm
from dtrain.parallel.context import CONTEXT_KWARG, shard_sequence
from dtrain.parallel.parallelize import compute_precision
from dtrain.parallel.router import RouterStats


def local_micro_batch(micro_batch: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, Any]:
    """This rank's part of a host micro-batch, on its device: the whole rows, or with context
    parallel its tokens of every row (parallel/context.py); with `filled`, which of its slots hold a
    token (padding is each row's tail: its first `num_tokens` slots do)."""
    on_device = {key: value.to(parallel.device, non_blocking=True) for key, value in micro_batch.items()}
    return shard_sequence(with_filled_slots(on_device), parallel["cp"])


def with_filled_slots(micro_batch: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch with `filled` [rows, slots]: True where a slot holds a token, not padding."""
    slots = torch.arange(micro_batch["input_ids"].shape[1], device=micro_batch["input_ids"].device)
    return {**micro_batch, "filled": slots[None, :] < micro_batch["num_tokens"][:, None]}


def global_counts(
    micro_batches: list[dict[str, Any]], parallel: Parallel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's supervised tokens (the loss is a token mean over them), non-pad slots and slots (for
    the padding fraction and the input throughput: the rows the step really holds, packed or not),
    counted over every micro-batch of every dp and cp rank."""
    counts = sum(
        torch.stack(
            [
                (mb["labels"] != IGNORE).sum(),
                mb["num_tokens"].sum(),
                # a fill on the device, not a copy from the host
                torch.full((), mb["input_ids"].numel(), device=mb["input_ids"].device),
            ]
        )
        for mb in micro_batches
    ).float()
    dist.all_reduce(counts, group=parallel.token_group)
    return counts[0], counts[1], counts[2]


def micro_step(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    tokens: torch.Tensor,
    loss_parallel: bool,
    loss_impl: str = "dense",
    loss_chunk: int = 0,
    router: RouterStats | None = None,
) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; returns its summed loss, detached. A function of
    its own so the logits die with it, and so dtrain.estimate measures exactly this step. `router`
    (a mixture-of-experts model): records the routing, and adds this micro-batch's share of the
    router's aux loss, if the model has one, to what is differentiated."""
    recorded = router.record(micro_batch) if router is not None else contextlib.nullcontext()
    with loss_context(loss_parallel), recorded:
        loss = summed_loss(model, micro_batch, loss_impl, loss_chunk)
        total = loss / tokens
        aux = router.aux_term() if router is not None else None
        (total if aux is None else total + aux).backward()
    return loss.detach()


def summed_loss(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    loss_impl: str = "dense",
    loss_chunk: int = 0,
) -> torch.Tensor:
    """Forward one micro-batch (inside loss_context) and sum its token losses (parallel.loss_impl):
    dense, lm_head's whole logits then cross-entropy; chunked, lm_head + loss `loss_chunk` local
    positions at a time, each chunk recomputed in backward; fused, the head, loss and gradients in
    one pass per chunk (dtrain.fused_loss), nothing recomputed."""
    inputs, labels = model_inputs(model, micro_batch), micro_batch["labels"]
    if loss_impl == "dense":
        return summed_cross_entropy(model(**inputs).logits, labels)
    if loss_impl not in ("chunked", "fused"):
        raise ValueError(f"loss_impl={loss_impl!r}: must be dense, chunked or fused")
    hidden, head = final_hidden_states(model, inputs)
    with compute_precision(model):  # the head in the forward's precision (bf16 under autocast)
        if loss_impl == "chunked":
            return chunked_summed_cross_entropy(head, hidden, labels, loss_chunk)
        return FusedLinearCrossEntropy(loss_chunk, model.config.vocab_size)(hidden, head.weight, labels)


def model_inputs(model: torch.nn.Module, micro_batch: dict[str, Any]) -> dict[str, Any]:
    """The model's forward arguments for a micro-batch: full-length position ids (packed rows restart
    them), no cache, no router logits (dtrain computes the aux loss: RouterStats), and with context
    parallel the ContextShard attention gathers the rest of each row through."""
    inputs = dict(
        input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"], use_cache=False
    )
    if getattr(model.config, "output_router_logits", False):
        inputs["output_router_logits"] = False
    if CONTEXT_KWARG in micro_batch:
        inputs[CONTEXT_KWARG] = micro_batch[CONTEXT_KWARG]
    return inputs


def final_hidden_states(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
    """The model's forward with lm_head detached (loss.head_detached): the final hidden states, and
    the head, for a loss that computes the logits itself (chunked, fused)."""
    with head_detached(model) as head, warnings.catch_warnings():
        # The identity head returns HF's slice of the hidden states, a view: FSDP2 warns against
        # in-place ops on it, and the chunked losses only slice and read it.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        hidden = model(**inputs).logits
    return hidden, head


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: list,
    max_grad_norm: float,
    should_skip: Callable[[torch.Tensor], bool] = lambda grad_norm: False,
) -> tuple[torch.Tensor, bool]:
    """Clip, step (unless should_skip(norm)), drop the gradients. Returns the norm before
    clipping and whether the step was skipped."""
    grad_norm = global_grad_norm(params)
    skipped = should_skip(grad_norm)  # before clipping, which would spread a NaN to every gradient
    if not skipped:
        clip_grads(params, max_grad_norm, grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    micro_batches: list,
    parallel: Parallel,
    loss_parallel: bool,
    loss_impl: str = "dense",
    loss_chunk: int = 0,
) -> dict[str, Any]:
    """eval_loss: the token mean over the whole eval set (every dp and cp rank's share)."""
    model.eval()
    totals = torch.zeros(2, device=parallel.device)
    for mb in micro_batches:
        mb = local_micro_batch(mb, parallel)
        with loss_context(loss_parallel):
            totals[0] += summed_loss(model, mb, loss_impl, loss_chunk)
        totals[1] += (mb["labels"] != IGNORE).sum()
    dist.all_reduce(totals, group=parallel.token_group)
    model.train()
    return {"eval_loss": (totals[0] / totals[1]).item(), "eval_tokens": int(totals[1].item())}
