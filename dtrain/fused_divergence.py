"""Fused vocab-parallel divergence between two vocab-sharded heads (dtrain.distill).

For every scored token (labels != IGNORE) the divergence between the student's and the teacher's
next-token distributions at a temperature T, over the whole vocabulary, computed from their final
hidden states and their heads (of two widths; one vocabulary) chunk by chunk, as
dtrain/fused_loss.py computes the cross-entropy: neither full logits nor a gathered head exist.

Logits: z = softcap · tanh(scale · h @ W.T / softcap) / T (the scale and the final softcap where the
family has them: Granite's 1 / logits_scaling, Gemma's final_logit_softcapping; TRL 1.16's order),
p = softmax(z). The divergence, TRL's (beta as its `beta`, branching on 0 and 1 exactly as it does):

- beta = 0: KL(p_t ‖ p_s) (forward KL); beta = 1: KL(p_s ‖ p_t) (reverse KL);
- else the generalized JSD: beta · KL(p_t ‖ m) + (1 − beta) · KL(p_s ‖ m), m = (1 − beta) p_s + beta p_t.

Optionally (`nll_weight` w > 0) w × the cross-entropy of the labels under the student's logits at
T = 1 (dtrain.distill's sft_weight), in the same pass.

Per chunk, on each tp rank (its vocabulary shard of both heads, padded rows left out): only the
chunk's scored rows are projected (prompt and padding positions cost nothing); both logits in fp32 →
row max all-reduced (MAX) over tp → Σ exp all-reduced (SUM) → log-probabilities of this rank's
columns → each row's partial sums of the divergence (and the student's entropy, and the NLL's
target logit) all-reduced (SUM) → the gradient w.r.t. the student's logits, in a chunk buffer
(beta = 1 and the mixture need the row's divergence first: one more all-reduce) → grad_h = that @
W_s (reduce-scattered back to the sequence shard under sequence parallel, else all-reduced) and
grad_W_s += that.T @ h. The teacher gets no gradient. The helpers (chunk rows and targets, the
collectives, fp32 matmuls) are dtrain/fused_loss.py's.

Memory of one chunk (R scored rows, × tp when gathered under sequence parallel; V = local vocabulary
rows): at most four fp32 [R, V] buffers (five with a softcap, whose derivative is kept), in bf16 the
bf16 copy of the gradient (R·V·2), and R·H-sized pieces. The saved gradients are the student hidden
states' (fp32) and its head's (fp32 accumulator), as the fused cross-entropy saves. Nothing grows
with the sequence beyond them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from dtrain.fused_loss import (
    Layout,
    _addmm_fp32_,
    _all_reduce,
    _chunk_rows,
    _mm_fp32,
    _owned,
    _reduce_rows,
    chunk_targets,
    head_layout,
)
from dtrain.loss import IGNORE

# The figures the function returns beside the loss, each a sum over the scored tokens.
FIGURES = ("divergence", "nll", "entropy")


@dataclass(frozen=True)
class Logits:
    """How a model's logits come out of its head: z = softcap · tanh(scale · x / softcap), or scale · x
    without a softcap (x = h @ W.T)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model_config: object) -> Logits:
        """The family's post-processing of lm_head's output, as its HF forward applies it: Granite's
        division by logits_scaling, Gemma's final_logit_softcapping."""
        scaling = getattr(model_config, "logits_scaling", None) or 1.0
        softcap = getattr(model_config, "final_logit_softcapping", None)
        return cls(1.0 / scaling, softcap or None)


@dataclass(frozen=True)
class Divergence:
    """What to compute: TRL's beta, the temperature, the NLL's weight, each head's logits."""

    beta: float
    temperature: float = 1.0
    nll_weight: float = 0.0
    student: Logits = Logits()
    teacher: Logits = Logits()


def fused_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    settings: Divergence,
    chunk: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over scored tokens of divergence + nll_weight · NLL, a plain fp32 scalar with gradients for
    the student's hidden states and head; the sums of FIGURES, fp32 [3], no gradient). hidden:
    (batch, seq, width) final hidden states (DTensors sharded over the sequence under sequence
    parallel; the two widths may differ); weights: the heads (DTensors Shard(0) over tp, or plain at
    tp = 1; one padded vocabulary); labels: (batch, seq) over the whole (local) sequence."""
    layout = head_layout(student_hidden, student_weight, vocab_size)
    teacher_layout = head_layout(teacher_hidden, teacher_weight, vocab_size)
    if (teacher_layout.vocab_start, teacher_layout.real_rows) != (layout.vocab_start, layout.real_rows):
        raise ValueError("fused divergence: the student's and the teacher's heads are sharded differently")
    if teacher_layout.sequence_sharded != layout.sequence_sharded:
        raise ValueError("fused divergence: one model's hidden states are sequence-sharded, the other's not")
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in (student_hidden, student_weight)]
    teacher = [t.to_local() if isinstance(t, DTensor) else t for t in (teacher_hidden, teacher_weight)]
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in locals_)
    return _FusedDivergence.apply(*locals_, *teacher, labels, layout, settings, chunk, grads)


class FusedDivergence(nn.Module):
    """fused_divergence as a module without parameters: memory trackers see modules, so the loss
    shows as a phase of its own (dtrain.estimate reports its temporaries)."""

    def __init__(self, settings: Divergence, chunk: int, vocab_size: int) -> None:
        super().__init__()
        self.settings, self.chunk, self.vocab_size = settings, chunk, vocab_size

    def forward(
        self,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_divergence(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            labels,
            self.settings,
            self.chunk,
            self.vocab_size,
        )


class _FusedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, labels, layout, settings, chunk, grads):  # noqa: ANN001, ANN205
        batch, local_len, width = hidden.shape
        head, teacher_head = weight[: layout.real_rows], teacher_weight[: layout.real_rows]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if grads else None
        grad_weight = None
        if grads and weight.requires_grad:  # a frozen head (LoRA) takes none
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        sums = torch.zeros(len(FIGURES), dtype=torch.float32, device=hidden.device)
        starts = range(0, local_len, chunk)
        for start, scored in zip(starts, _scored_rows(labels, layout, local_len, chunk), strict=True):
            stop = min(start + chunk, local_len)
            targets = chunk_targets(labels, layout, local_len, start, stop)
            if scored.numel() == 0:  # the same targets on every tp rank: all skip alike
                continue
            rows = _chunk_rows(hidden, start, stop, layout).index_select(0, scored)
            teacher_rows = _chunk_rows(teacher_hidden, start, stop, layout).index_select(0, scored)
            grad_logits = _chunk_divergence(
                _mm_fp32(rows, head.T),
                _mm_fp32(teacher_rows, teacher_head.T),
                targets.index_select(0, scored),
                layout,
                settings,
                sums,
                grads,
            )
            if not grads:
                continue
            low = grad_logits.to(head.dtype)  # no copy in fp32
            del grad_logits
            if grad_weight is not None:
                _addmm_fp32_(grad_weight[: layout.real_rows], low.T, rows)
            every_row = torch.zeros(targets.numel(), width, dtype=torch.float32, device=hidden.device)
            every_row.index_copy_(0, scored, _mm_fp32(low, head))
            grad_rows = _reduce_rows(every_row, layout)
            grad_hidden[:, start:stop] = grad_rows.view(batch, stop - start, width)
            del low
        loss = sums[0] + settings.nll_weight * sums[1]
        if grads:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_sums):  # noqa: ANN001, ANN205
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # In place: the saved gradients serve this one backward (once_differentiable).
        grad_hidden = grad_hidden.mul_(grad_loss).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _scored_rows(labels: torch.Tensor, layout: Layout, local_len: int, chunk: int) -> Iterator[torch.Tensor]:
    """Each chunk's scored rows (chunk_targets' order) as indices on the labels' device, read from the
    device once per call. Fake tensors (the planner) have no values: every row, the most memory."""
    starts = range(0, local_len, chunk)
    if is_fake(labels):
        for start in starts:
            rows = labels.shape[0] * (min(start + chunk, local_len) - start)
            yield torch.arange(rows * (layout.tp if layout.sequence_sharded else 1), device=labels.device)
        return
    chunks = [
        chunk_targets(labels, layout, local_len, start, min(start + chunk, local_len)) for start in starts
    ]
    scored = (torch.cat(chunks) != IGNORE).cpu()  # one wait for the device, not one a chunk
    rows = 0
    for targets in chunks:
        yield scored[rows : rows + targets.numel()].nonzero().squeeze(1).to(labels.device)
        rows += targets.numel()


def _logits_(x: torch.Tensor, logits: Logits, keep_slope: bool) -> torch.Tensor | None:
    """x (fp32 head products) becomes the logits z (before the temperature), in place; returns dz/dx
    where it is not a constant (a softcap, with keep_slope), else None."""
    if logits.softcap is None:
        if logits.scale != 1.0:
            x.mul_(logits.scale)
        return None
    x.mul_(logits.scale / logits.softcap).tanh_()
    slope = None
    if keep_slope:  # d/dx softcap · tanh(scale · x / softcap) = scale · (1 − tanh²)
        slope = torch.square(x).neg_().add_(1.0).mul_(logits.scale)
    x.mul_(logits.softcap)
    return slope


def _log_sum_exp(z: torch.Tensor, layout: Layout, scratch: torch.Tensor) -> torch.Tensor:
    """Each row's log Σ exp(z) over the whole vocabulary (z: this rank's columns); scratch: a buffer
    of z's shape."""
    row_max = _all_reduce(z.amax(1), "max", layout)
    torch.sub(z, row_max.unsqueeze(1), out=scratch)
    return _all_reduce(scratch.exp_().sum(1), "sum", layout).log_().add_(row_max)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[r, v] · b[r, v] per row, without an [R, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    targets: torch.Tensor,
    layout: Layout,
    settings: Divergence,
    sums: torch.Tensor,
    grads: bool,
) -> torch.Tensor | None:
    """One chunk's scored rows: adds the sums of FIGURES to `sums`; returns d loss / d x (the
    student's head products) in one of the chunk's buffers, or None without grads. student, teacher:
    [R, V] fp32 head products x of this rank's columns, overwritten."""
    beta, temperature, weight = settings.beta, settings.temperature, settings.nll_weight
    slope = _logits_(student, settings.student, keep_slope=grads)
    _logits_(teacher, settings.teacher, keep_slope=False)
    scratch = torch.empty_like(student)
    owned, index = _owned(targets, layout)
    partial = []  # each row's sums over this rank's columns, all-reduced in one collective
    plain_sum = None  # the NLL's log-sum-exp at T = 1
    if weight:
        partial.append(student.gather(1, index).squeeze(1) * owned)  # the target's logit at T = 1
        if temperature != 1.0:
            plain_sum = _log_sum_exp(student, layout, scratch)
    if temperature != 1.0:  # TRL multiplies by 1 / T
        student.mul_(1.0 / temperature)
        teacher.mul_(1.0 / temperature)
    log_sum = _log_sum_exp(student, layout, scratch)
    student.sub_(log_sum.unsqueeze(1))  # log p_s
    teacher.sub_(_log_sum_exp(teacher, layout, scratch).unsqueeze(1))  # log p_t
    probs = torch.exp(student, out=scratch)  # p_s
    partial.append(-_row_dot(probs, student))  # the entropy
    if beta == 0:  # KL(t ‖ s) = Σ p_t (log p_t − log p_s)
        log_ratio = student.neg_().add_(teacher)
        p_teacher = teacher.exp_()
        partial.append(_row_dot(p_teacher, log_ratio))
        grad = torch.sub(probs, p_teacher, out=student) if grads else None  # p_s − p_t
    elif beta == 1:  # KL(s ‖ t) = Σ p_s (log p_s − log p_t)
        grad = student.sub_(teacher)
        partial.append(_row_dot(probs, grad))
    else:  # β KL(t ‖ m) + (1 − β) KL(s ‖ m), log m = logaddexp(log p_s + log(1 − β), log p_t + log β)
        log_m = torch.add(student, math.log1p(-beta) - math.log(beta))
        torch.logaddexp(log_m, teacher, out=log_m).add_(math.log(beta))
        grad = student.sub_(log_m)  # log p_s − log m
        kl_student = _row_dot(probs, grad)
        log_m.neg_().add_(teacher)  # log p_t − log m
        kl_teacher = _row_dot(teacher.exp_(), log_m)
        del log_m
        partial.append(beta * kl_teacher + (1 - beta) * kl_student)
        partial.append(kl_student)
    reduced = _all_reduce(torch.stack(partial), "sum", layout)
    if weight:
        target_logit, reduced = reduced[0], reduced[1:]
        plain_sum = log_sum if plain_sum is None else plain_sum  # T = 1: the same log-sum-exp
        sums[1] += (plain_sum - target_logit).sum()
    sums[2] += reduced[0].sum()
    sums[0] += reduced[1].sum()
    if not grads:
        return None
    if beta == 1:  # p_s (log p_s − log p_t − KL(s ‖ t))
        grad.sub_(reduced[1].unsqueeze(1)).mul_(probs)
    elif beta != 0:  # (1 − β) p_s (log p_s − log m − KL(s ‖ m))
        grad.sub_(reduced[2].unsqueeze(1)).mul_(probs).mul_(1 - beta)
    if temperature != 1.0:
        grad.mul_(1.0 / temperature)  # d (z / T) / d z
    if weight:  # + w (softmax(z) − one-hot), z at T = 1: p_s^T renormalised (teacher's buffer is spent)
        plain = probs
        if temperature != 1.0:
            plain = torch.pow(probs, temperature, out=teacher)
            plain.mul_(torch.exp(log_sum * temperature - plain_sum).unsqueeze(1))
        grad.add_(plain, alpha=weight)
        grad.scatter_add_(1, index, (-weight * owned.to(grad.dtype)).unsqueeze(1))
    if slope is not None:
        grad.mul_(slope)
    elif settings.student.scale != 1.0:
        grad.mul_(settings.student.scale)
    return grad
