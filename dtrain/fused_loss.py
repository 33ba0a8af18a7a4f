"""Fused vocab-parallel linear cross-entropy (`parallel.loss_impl=fused`).

lm_head's matmul, the vocab-parallel softmax statistics, the summed loss and, in the same pass, the
gradients w.r.t. the hidden states and the head weight, chunk by chunk over the local sequence. Only
one chunk's logits (rows × vocab / tp, fp32) is alive at a time and nothing is recomputed in
backward, which only scales the two saved gradients by the upstream gradient.

Per chunk, on each tp rank (its vocabulary shard of the head weight, padded rows left out):
logits = h @ W_local.T (fp32) → row max, all-reduced (MAX) over tp → Σ exp(logit − max) and the
target's logit (from the rank that owns the target id, 0 elsewhere), all-reduced (SUM) in one
collective → loss = log Σ + max − target logit on supervised rows → the logits buffer becomes, in
place, softmax − one-hot (zero on ignored rows) → grad_h = that @ W_local (partial over tp:
reduce-scattered back to the sequence shard, or all-reduced without sequence parallel) and
grad_W_local += that.T @ h (fp32). Under sequence parallel each chunk of the local shard is
all-gathered over tp, one chunk at a time, as lm_head's own input hook would.

Memory of one chunk (R rows: micro batch × chunk positions, × tp when gathered; V = local vocab
rows): the fp32 logits, R·V·4 bytes, reused in place for the softmax and its gradient; in bf16 also
the bf16 copy of that gradient for the two matmuls (R·V·2); then R·H-sized pieces (the gathered
chunk, its gradient). The saved gradients are the hidden states' (fp32) and the head weight's
(fp32 accumulator), what the dense path's backward makes anyway. docs/estimate.md measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from dtrain.loss import IGNORE


@dataclass(frozen=True)
class Layout:
    """Where this rank's part of the head and of the hidden states sit."""

    group: object | None  # the tp process group; None without TP (tp = 1: no collective at all)
    tp: int
    tp_rank: int
    sequence_sharded: bool  # hidden holds this rank's sequence shard (sequence parallel)
    vocab_start: int  # the first vocabulary id of this rank's weight rows
    real_rows: int  # this rank's rows below vocab_size; the rest are padding (never a logit)


def head_layout(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> Layout:
    """The layout of a head weight (a DTensor Shard(0) over tp, or a plain tensor at tp = 1) and its
    input (a DTensor Shard(1) under sequence parallel, else the same full sequence on every rank)."""
    rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else weight.shape[0]
    if not isinstance(weight, DTensor) or weight.device_mesh.size() == 1:
        return Layout(None, 1, 0, False, 0, min(rows, vocab_size))
    mesh = weight.device_mesh
    sharded = [dim for dim, p in enumerate(weight.placements) if p.is_shard(0)]
    if mesh.ndim != 1 or len(sharded) != 1:
        raise ValueError(f"fused loss: the head weight must be Shard(0) over tp, got {weight.placements}")
    # The padded vocabulary splits evenly: plain ints from the mesh (the planner runs under fake mode).
    tp, tp_rank = mesh.size(0), mesh.get_local_rank(0)
    start = tp_rank * rows
    real = max(0, min(rows, vocab_size - start))
    if real == 0:
        raise ValueError(f"fused loss: tp rank {tp_rank} holds only padded vocabulary rows")
    sequence_sharded = isinstance(hidden, DTensor) and any(p.is_shard(1) for p in hidden.placements)
    return Layout(mesh.get_group(0), tp, tp_rank, sequence_sharded, start, real)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_size: int
) -> torch.Tensor:
    """Σ cross-entropy(hidden @ weight.T, labels) over supervised tokens, as a plain fp32 scalar.
    hidden: (batch, seq, hidden) final hidden states (a DTensor under TP); weight: the head weight
    (a DTensor Shard(0) under TP, FSDP-unsharded); labels: (batch, seq) over the whole sequence.
    Gradients reach `weight` (a DTensor gradient with its placements) and `hidden` through the
    differentiable to_local(), so FSDP2's reduce-scatter and tied embeddings see them as usual."""
    layout = head_layout(hidden, weight, vocab_size)
    local_hidden, local_weight = _local_operands(hidden, weight)
    grads = torch.is_grad_enabled() and (local_hidden.requires_grad or local_weight.requires_grad)
    with torch.autocast(local_hidden.device.type, enabled=False):  # the dtypes are set: _local_operands
        return _FusedLinearCrossEntropy.apply(local_hidden, local_weight, labels, layout, chunk, grads)


def _local_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The local hidden states and head weight, in the one dtype the head computes in: autocast's
    where it is on (a bf16 run without FSDP: parallelize.apply_autocast), else the weight's (fp32, or
    FSDP's gathered bf16). Without FSDP the hidden states may be fp32 (autocast's residual stream)
    and the head bf16 (a frozen LoRA base). The casts are autograd's: gradients come back in each
    operand's own dtype."""
    local_hidden = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    local_weight = weight.to_local() if isinstance(weight, DTensor) else weight
    device = local_hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else local_weight.dtype
    return local_hidden.to(dtype), local_weight.to(dtype)


class FusedLinearCrossEntropy(nn.Module):
    """fused_linear_cross_entropy as a module without parameters: memory trackers see modules, so
    the loss shows as a phase of its own (dtrain.estimate reports its temporaries)."""

    def __init__(self, chunk: int, vocab_size: int) -> None:
        super().__init__()
        self.chunk, self.vocab_size = chunk, vocab_size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, labels, self.chunk, self.vocab_size)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, layout: Layout, chunk: int, grads: bool):  # noqa: ANN001, ANN205
        batch, local_len, width = hidden.shape
        head = weight[: layout.real_rows]  # a view: the padded rows get no logit and a zero gradient
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, local_len, chunk):
            stop = min(start + chunk, local_len)
            rows = _chunk_rows(hidden, start, stop, layout)  # rank-major under SP, as the targets
            targets = chunk_targets(labels, layout, local_len, start, stop)
            loss, grad_logits = _chunk_loss(rows, head, targets, layout, grads)
            total += loss
            if grads:
                low = grad_logits.to(head.dtype)  # no copy in fp32
                _addmm_fp32_(grad_weight[: layout.real_rows], low.T, rows)
                grad_rows = _reduce_rows(_mm_fp32(low, head), layout)
                grad_hidden[:, start:stop] = grad_rows.view(batch, stop - start, width)
                del low, grad_logits
        if grads:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):  # noqa: ANN001, ANN205
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # In place: the saved gradients serve this one backward (once_differentiable).
        grad_hidden = grad_hidden.mul_(grad_loss).to(hidden_dtype)
        grad_weight = grad_weight.mul_(grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    vocab_size: int,
    sum_sq: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of `labels` under lm_head(hidden), [batch, seq] fp32 over the whole
    (unsharded) sequence, 0 where labels is IGNORE, the same on every tp rank (dtrain.dpo: a
    sequence's log-probability is a sum of them). Forward, per chunk: the head matmul, the row max
    and Σ exp all-reduced over tp and the target's logit from the rank that owns it, as in
    fused_linear_cross_entropy; each row's log-sum-exp is kept. Its gradient is a per-token upstream
    gradient g known only after the whole forward (it depends on the sequence sums), so backward
    recomputes each chunk's logits (one more head matmul: with the two of the gradients, 4 head
    matmuls a token where the fused loss has 3; about 2·hidden·vocab FLOPs a token, some 2 % of a
    Llama-3-8B step) and forms g · (one-hot − softmax) in that chunk's buffer. `sum_sq` (dtrain.dpo's
    WPO weights): also log Σ_v p_v² of every position, without gradient, from the same chunks' sums
    (Σ exp(2·(logit − max)) beside Σ exp(logit − max)): (logps, log_sum_sq)."""
    layout = head_layout(hidden, weight, vocab_size)
    local_hidden, local_weight = _local_operands(hidden, weight)
    with torch.autocast(local_hidden.device.type, enabled=False):  # the dtypes are set: _local_operands
        logps, log_sum_sq = _FusedTokenLogProbs.apply(
            local_hidden, local_weight, labels, layout, chunk, sum_sq
        )
    return (logps, log_sum_sq) if sum_sq else logps


class _FusedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, layout: Layout, chunk: int, sum_sq: bool):  # noqa: ANN001, ANN205
        local_len = hidden.shape[1]
        head = weight[: layout.real_rows]
        logps = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        log_sums = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        log_sum_sq = torch.zeros(labels.shape if sum_sq else (), dtype=torch.float32, device=hidden.device)
        for start in range(0, local_len, chunk):
            stop = min(start + chunk, local_len)
            targets = chunk_targets(labels, layout, local_len, start, stop)
            logits = _mm_fp32(_chunk_rows(hidden, start, stop, layout), head.T)
            owned, index = _owned(targets, layout)
            target_logit = logits.gather(1, index).squeeze(1) * owned
            row_max = _all_reduce(logits.amax(1), "max", layout)
            exps = logits.sub_(row_max.unsqueeze(1)).exp_()
            parts = [exps.sum(1), target_logit] + ([exps.square().sum(1)] if sum_sq else [])
            sums, target_logit, *squares = _all_reduce(torch.stack(parts), "sum", layout)
            log_sum = sums.log() + row_max
            logp = torch.where(targets != IGNORE, target_logit - log_sum, 0.0)
            outputs = [(logps, logp), (log_sums, log_sum)]
            if sum_sq:  # log Σ p² = log Σ exp(2·(logit − max)) − 2 · log Σ exp(logit − max)
                outputs.append((log_sum_sq, squares[0].log() - 2 * sums.log()))
            for full, values in outputs:
                _chunk_view(full, layout, local_len, start, stop).copy_(_chunk_shape(values, labels, layout))
        ctx.save_for_backward(hidden, weight, labels, log_sums)
        ctx.layout, ctx.chunk = layout, chunk
        ctx.mark_non_differentiable(log_sum_sq)
        return logps, log_sum_sq

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_log_sum_sq):  # noqa: ANN001, ANN205
        hidden, weight, labels, log_sums = ctx.saved_tensors
        layout, (batch, local_len, width) = ctx.layout, hidden.shape
        head = weight[: layout.real_rows]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, local_len, ctx.chunk):
            stop = min(start + ctx.chunk, local_len)
            rows = _chunk_rows(hidden, start, stop, layout)
            targets = chunk_targets(labels, layout, local_len, start, stop)
            upstream = chunk_targets(grad_logps, layout, local_len, start, stop) * (targets != IGNORE)
            log_sum = chunk_targets(log_sums, layout, local_len, start, stop)
            # d logp / d logits = one-hot − softmax: the recomputed logits become −g·softmax, + g at targets
            grad_logits = _mm_fp32(rows, head.T).sub_(log_sum.unsqueeze(1)).exp_()
            grad_logits.mul_(-upstream.unsqueeze(1))
            owned, index = _owned(targets, layout)
            grad_logits.scatter_add_(1, index, (upstream * owned).unsqueeze(1))
            low = grad_logits.to(head.dtype)
            if ctx.needs_input_grad[1]:  # a frozen head (LoRA) takes none
                _addmm_fp32_(grad_weight[: layout.real_rows], low.T, rows)
            grad_rows = _reduce_rows(_mm_fp32(low, head), layout)
            grad_hidden[:, start:stop] = grad_rows.view(batch, stop - start, width)
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


@torch.no_grad()
def fused_token_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_size: int
) -> torch.Tensor:
    """The entropy of softmax(lm_head(hidden)) at each position whose label is not IGNORE, [batch, seq]
    fp32 like fused_token_logps (0 elsewhere), without the full logits and without gradients (a
    metric: dtrain.grpo's `entropy`): per chunk the head matmul, the row max all-reduced over tp, then
    Σ e and Σ e·(logit − max) (e = exp(logit − max)) in one all-reduce; entropy = log Σ e − Σ e·(logit −
    max) / Σ e."""
    layout = head_layout(hidden, weight, vocab_size)
    local_hidden = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    local_weight = weight.to_local() if isinstance(weight, DTensor) else weight
    head, local_len = local_weight[: layout.real_rows], local_hidden.shape[1]
    entropy = torch.zeros(labels.shape, dtype=torch.float32, device=local_hidden.device)
    for start in range(0, local_len, chunk):
        stop = min(start + chunk, local_len)
        targets = chunk_targets(labels, layout, local_len, start, stop)
        shifted = _mm_fp32(_chunk_rows(local_hidden, start, stop, layout), head.T)
        shifted.sub_(_all_reduce(shifted.amax(1), "max", layout).unsqueeze(1))
        exp = shifted.exp()
        sums, weighted = _all_reduce(torch.stack([exp.sum(1), (exp * shifted).sum(1)]), "sum", layout)
        values = torch.where(targets != IGNORE, sums.log() - weighted / sums, 0.0)
        _chunk_view(entropy, layout, local_len, start, stop).copy_(_chunk_shape(values, labels, layout))
    return entropy


def _chunk_rows(hidden: torch.Tensor, start: int, stop: int, layout: Layout) -> torch.Tensor:
    """The chunk's hidden rows, flattened; under sequence parallel every tp rank's, rank-major."""
    rows = hidden[:, start:stop].reshape(-1, hidden.shape[2])
    if layout.sequence_sharded:
        rows = _wait(funcol.all_gather_single(rows.contiguous(), 0, layout.group))
    return rows


def _chunk_view(full: torch.Tensor, layout: Layout, local_len: int, start: int, stop: int) -> torch.Tensor:
    """The positions of `full` ([batch, seq]) that chunk_targets flattens, as a [batch, tp, chunk] view."""
    tp = layout.tp if layout.sequence_sharded else 1
    return full.view(full.shape[0], tp, local_len)[:, :, start:stop]


def _chunk_shape(values: torch.Tensor, labels: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A chunk's per-row values (chunk_targets' order) as [batch, tp, chunk], _chunk_view's shape."""
    tp = layout.tp if layout.sequence_sharded else 1
    return values.view(tp, labels.shape[0], -1).transpose(0, 1)


def chunk_targets(
    labels: torch.Tensor, layout: Layout, local_len: int, start: int, stop: int
) -> torch.Tensor:
    """The target ids of the chunk's rows, flattened: under sequence parallel every tp rank's
    positions [start, stop) of its shard, rank-major (the all-gather's order), else a plain slice."""
    if not layout.sequence_sharded:
        return labels[:, start:stop].reshape(-1)
    batch = labels.shape[0]
    shards = labels.view(batch, layout.tp, local_len)[:, :, start:stop]
    return shards.transpose(0, 1).reshape(-1)


def _chunk_loss(
    rows: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, layout: Layout, grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's summed loss and (grads) d loss / d logits, in the logits' own buffer."""
    logits = _mm_fp32(rows, head.T)  # (rows, real vocabulary rows of this rank), fp32
    owned, index = _owned(targets, layout)
    target_logit = logits.gather(1, index).squeeze(1) * owned
    row_max = _all_reduce(logits.amax(1), "max", layout)
    logits.sub_(row_max.unsqueeze(1)).exp_()
    sums, target_logit = _all_reduce(torch.stack([logits.sum(1), target_logit]), "sum", layout)
    supervised = targets != IGNORE
    loss = torch.where(supervised, sums.log() + row_max - target_logit, 0.0).sum()
    if not grads:
        return loss, None
    logits.mul_((supervised / sums).unsqueeze(1))  # softmax on supervised rows, 0 on ignored ones
    logits.scatter_add_(1, index, -(owned & supervised).to(logits.dtype).unsqueeze(1))  # − one-hot
    return loss, logits


def _owned(targets: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets fall in this rank's vocabulary shard (IGNORE, < 0, never does), and each one's
    column there (clamped: a safe index for the others), [rows, 1]."""
    local = targets - layout.vocab_start
    owned = (local >= 0) & (local < layout.real_rows)
    return owned, local.clamp(0, layout.real_rows - 1).unsqueeze(1)


def _all_reduce(tensor: torch.Tensor, op: str, layout: Layout) -> torch.Tensor:
    if layout.group is None:
        return tensor
    return _wait(funcol.all_reduce(tensor, op, layout.group))


def _reduce_rows(grad_rows: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Sum the tp ranks' partial gradients of the chunk's rows (each rank saw only its vocabulary
    shard): back to this rank's own rows under sequence parallel, else to all of them."""
    if layout.group is None:
        return grad_rows
    if layout.sequence_sharded:
        return _wait(funcol.reduce_scatter_single(grad_rows, "sum", 0, layout.group))
    return _wait(funcol.all_reduce(grad_rows, "sum", layout.group))


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


# Whether matmuls with an fp32 output (out_dtype) run for bf16 inputs, by (device type, tensor type):
# CUDA has them; the CPU does not (then the product is cast); fake tensors (the planner) take CUDA's way.
_DTYPE_OUT: dict[tuple[str, type], bool] = {}


def _dtype_out(tensor: torch.Tensor) -> bool:
    return _DTYPE_OUT.get((tensor.device.type, type(tensor)), True)


def _no_dtype_out(tensor: torch.Tensor) -> None:
    _DTYPE_OUT[(tensor.device.type, type(tensor))] = False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 (fp32 accumulation and output, also for bf16 inputs)."""
    if a.dtype == torch.float32:
        return a @ b
    if _dtype_out(a):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except NotImplementedError:
            _no_dtype_out(a)
    return (a @ b).float()


def _addmm_fp32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32) += a @ b in place: no weight-sized temporary where out_dtype is supported."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if _dtype_out(a):
        try:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            return
        except NotImplementedError:
            _no_dtype_out(a)
    out.add_(a @ b)
