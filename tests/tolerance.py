"""The parity tests' one rule for how close dtrain must come to its reference, for every family and
mesh (tests/README.md, "The error model"): fp32 reduction-order noise, RTOL relative, on what a step
computes (losses, grad norms, logits, gradients), and on each trained weight what AdamW can make of
that noise, sized per element from the reference run's own AdamW state (`AdamAllowance`).

Each comparison notes its margin, the largest gap / allowance it saw, for the current test;
tests/conftest.py reports the worst per file after the run (tests/README.md lists them).
"""

from __future__ import annotations

import os

import torch

# Relative float noise of an fp32 step computed in another order (sums split over ranks, micro-batches
# and threads, other kernels): about 170 units in the last place (2^-24), room for sums of a few
# thousand terms in random order and for a result that cancels to a tenth of its terms.
RTOL = 1e-5

MARGINS: dict[str, tuple[float, str]] = {}  # test node id: its worst (gap / allowance, what)


def note_margin(margin: float, what: str) -> None:
    """Keep the current test's worst margin (tests/conftest.py reads MARGINS after each test)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if margin > MARGINS.get(test, (-1.0, ""))[0]:
        MARGINS[test] = (margin, what)


def assert_scalar_close(actual: float, expected: float, what: str, rtol: float = RTOL) -> None:
    """|actual - expected| <= rtol·|expected|: a loss, grad norm or aux loss of one step."""
    allowed = rtol * abs(expected)
    gap = abs(actual - expected)
    note_margin(gap / allowed if allowed else (float("inf") if gap else 0.0), what)
    assert gap <= allowed, (
        f"{what}: {actual!r} differs from {expected!r} by {gap:.3g} (allowed {allowed:.3g})"
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | torch.Tensor, what: str) -> None:
    """Per element: |actual - expected| <= RTOL·|expected| + atol (atol a number or per element)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    gap = (actual - expected).abs()
    allowed = RTOL * expected.abs() + atol
    ratio = torch.where(gap == 0, 0.0, gap / allowed)  # 0/0 (a padding row that stays zero): no gap
    worst = int(ratio.argmax())
    margin = ratio.flatten()[worst].item()
    note_margin(margin, what)
    assert margin <= 1, (
        f"{what}: element {worst} differs by {gap.flatten()[worst].item():.3g} (allowed "
        f"{allowed.flatten()[worst].item() if torch.is_tensor(allowed) else allowed:.3g}; expected "
        f"{expected.flatten()[worst].item():.6g})"
    )


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "logits") -> None:
    """A forward's rounding error on one logit is set by the sizes of what was summed into it, not
    by the logit itself: a logit near zero carries a typical logit's noise, so the absolute part is
    RTOL of the mean logit size."""
    assert_close(actual, expected, RTOL * expected.abs().mean().item(), what)


def assert_weights_close(trained: dict, params: dict, allowance: dict, run: str) -> None:
    """Every trained tensor per element: |trained - reference| <= RTOL·|reference| + the element's
    AdamAllowance (`allowance`, from the reference run)."""
    assert set(trained) == set(params), sorted(set(trained) ^ set(params))
    for name, param in params.items():
        assert_close(trained[name], param, allowance[name], f"{run}: {name}")


class AdamAllowance:
    """How far, per element, another run of the same AdamW recipe may end from this one when every
    gradient it computes differs from this run's by float noise: the parity tests' weight tolerance.
    Call `step()` after each `optimizer.step()`, before the scheduler's step and `zero_grad()`.

    The noise: a gradient element g may differ by eta = RTOL · (|g| + max(RMS of its tensor's
    gradient, RMS of all the gradients)): relative noise, and the scale of the sums it is made of,
    which for a gradient that cancels to almost nothing (Qwen2's k_proj bias, zero in exact
    arithmetic) is not its own; and not at all where this run's is exactly zero (a token absent from
    the step: its embedding row's gradient is zero in any order of summation).

    What AdamW makes of it: an element moves by lr·u, u = m̂ / (sqrt(v̂) + eps), m̂ and sqrt(v̂)
    weighted sums (sqrt(v̂) a weighted L2 norm) of its gradients so far. So the other run's m̂ and
    sqrt(v̂) differ by at most the same weighted sums of eta, dm and dv (triangle inequality), and its
    step by at most lr·(dm + |u|·dv) / (sqrt(v̂) - dv + eps), and never by more than lr·(|u| + U): U is
    the largest |m̂|/sqrt(v̂) any gradients give at that step (Cauchy-Schwarz). Where sqrt(v̂) is far
    above eta that is RTOL-small; where the gradient sits at the noise floor it is all of AdamW's
    step, as it is in fact: such an element's gap can reach lr a step however exact the rest is. Each
    step adds RTOL of itself for its own rounding. Weight decay only shrinks earlier differences, and
    is left out (an upper bound)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> None:
        self.optimizer, self.named = optimizer, named
        self.total = {name: torch.zeros_like(param) for name, param in named.items()}
        self.noise: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name: (eta's EMAs as m's and v's)

    @torch.no_grad()
    def step(self) -> None:
        grads = {name: param.grad for name, param in self.named.items() if param.grad is not None}
        floor = torch.cat([grad.flatten() for grad in grads.values()]).pow(2).mean().sqrt()
        group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        for name, grad in grads.items():
            param = self.named[name]
            group, state = group_of[id(param)], self.optimizer.state[param]
            (beta1, beta2), eps, lr, t = group["betas"], group["eps"], group["lr"], int(state["step"])
            eta = RTOL * (grad.abs() + torch.maximum(grad.pow(2).mean().sqrt(), floor)) * (grad != 0)
            noise_m, noise_v = self.noise.get(name, (torch.zeros_like(grad), torch.zeros_like(grad)))
            noise_m = beta1 * noise_m + (1 - beta1) * eta
            noise_v = beta2 * noise_v + (1 - beta2) * eta.pow(2)
            self.noise[name] = noise_m, noise_v
            root_v = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt()
            u = (state["exp_avg"] / (1 - beta1**t) / (root_v + eps)).abs()
            dm, dv = noise_m / (1 - beta1**t), (noise_v / (1 - beta2**t)).sqrt()
            first_order = (dm + u * dv) / (root_v - dv + eps).clamp_min(0)  # inf where no room: the cap
            self.total[name] += lr * (
                torch.minimum(first_order, u + adam_ratio_bound(beta1, beta2, t)) + RTOL * u
            )

    def allowance(self) -> dict[str, torch.Tensor]:
        return {name: total.clone() for name, total in self.total.items()}


def adam_ratio_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m̂|/sqrt(v̂) of AdamW at step t over all gradient histories: by Cauchy-Schwarz,
    sqrt(sum_k w1_k² / w2_k) over m̂'s and v̂'s weights w1_k, w2_k of the gradient k steps back."""
    w1 = [(1 - beta1) * beta1**k / (1 - beta1**t) for k in range(t)]
    w2 = [(1 - beta2) * beta2**k / (1 - beta2**t) for k in range(t)]
    return sum(a * a / b for a, b in zip(w1, w2, strict=True)) ** 0.5
