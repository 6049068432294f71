"""AdamW, the learning-rate schedule, gradient clipping and the guarded optimizer update that every
trainer (GRPO, reward model; the warm start's schedule) shares."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..config.plan import OptimizerSpec
from . import distributed


def make_optimizer(params: Any, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """AdamW over the parameters that train."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=spec.learning_rate,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        fused=True,  # one kernel over all parameters (CPU and CUDA), deterministic
    )


def lr_factor(step: int, *, kind: str, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the peak learning rate after `step` optimizer steps: linear warm-up, then
    constant, linear decay to 0, or cosine decay to 0 at max_steps (as transformers' schedules)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def make_scheduler(
    optimizer: torch.optim.Optimizer, spec: OptimizerSpec
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up, then the spec's schedule over its `total_updates` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s, kind=spec.schedule, warmup_steps=spec.warmup_steps, max_steps=spec.total_updates
        ),
    )


def clip_grad_norm(model: Any, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, bit for bit, without its
    per-call grouping of tensors when every gradient is a plain tensor of one device and dtype (the
    usual case; a fifth of its time on a 0.66M-parameter model). DTensor (FSDP) or mixed gradients
    use torch's."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    first = grads[0] if grads else None
    if first is None or any(
        type(g) is not torch.Tensor or g.dtype != first.dtype or g.device != first.device for g in grads
    ):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # noqa: SLF001 - as torch
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # noqa: SLF001
    return total


def apply_update(
    model: Any, optimizer: Any, scheduler: Any, loss: torch.Tensor, max_grad_norm: float, d: Any = None
) -> dict[str, Any]:
    """Clip and apply the accumulated gradients, unless the loss or the gradient norm is not finite,
    or the update would make a weight non-finite (an extreme learning rate, say): then nothing is
    left changed in the weights, the optimizer state or the schedule, and `skipped_update` is 1
    (`update_rolled_back` is 1 when the update had been applied and was undone). Under several
    processes every decision is taken together, so every rank skips the same steps.

    Guarding the weights costs next to nothing when `update_stays_finite` can prove that the AdamW
    step keeps every weight finite (the usual case: a few float operations, and every
    REMEASURE_EVERY updates one pass reading the weights and first moments; no copy). Only when it
    cannot (a non-finite or huge learning rate, weights near overflow, another optimizer) are the
    weights and optimizer state copied before the step, checked after it, and restored if it
    destroyed them."""
    grad_norm = clip_grad_norm(model, max_grad_norm)
    learning_rate = optimizer.param_groups[0]["lr"]  # the rate this update uses
    if distributed.any_rank(d, not bool(torch.isfinite(loss).all() & torch.isfinite(grad_norm))):
        optimizer.zero_grad(set_to_none=True)
        return _outcome(grad_norm, learning_rate, skipped=True)
    # every clipped gradient element is at most max_grad_norm (no clipping: the norm itself)
    # (min with the norm itself: a huge max_grad_norm, which switches clipping off, must not make
    # every update unprovable and so copied)
    grad_bound = min(max_grad_norm, float(grad_norm))
    proven = _prove(optimizer, grad_bound)
    unproven = distributed.any_rank(d, proven is None)  # every rank copies, checks and restores alike
    backup = _backup(optimizer) if unproven else None
    optimizer.step()
    if proven is not None and not unproven:
        _BOUNDS[optimizer] = proven  # what bounds the weights and first moments now
    if backup is not None:
        destroyed = distributed.any_rank(d, not weights_finite(_trainable(optimizer)))
        _BOUNDS.pop(optimizer, None)  # measured afresh next time
        if destroyed:
            _restore(optimizer, backup)
            optimizer.zero_grad(set_to_none=True)
            return _outcome(grad_norm, learning_rate, skipped=True, rolled_back=True)
    scheduler.step()
    return _outcome(grad_norm, learning_rate, skipped=False)


def _outcome(
    grad_norm: torch.Tensor, learning_rate: float, *, skipped: bool, rolled_back: bool = False
) -> dict[str, Any]:
    """`apply_update`'s metrics."""
    return {
        "grad_norm": grad_norm,
        "learning_rate": learning_rate,
        "skipped_update": float(skipped),
        "update_rolled_back": float(rolled_back),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard under FSDP; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _trainable(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def weights_finite(params: list[torch.Tensor]) -> bool:
    """Whether every value of `params` (this rank's part) is finite: one fused 2-norm per tensor and
    one host sync. (A finite tensor whose 2-norm overflows float32 counts as destroyed: its values
    would be beyond ~1e19, which no trained weight is.)"""
    local = [_local(p).detach() for p in params if _local(p).numel()]
    if not local:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(local))).all())  # noqa: SLF001


REMEASURE_EVERY = 16  # updates between measurements of the weights and first moments


@dataclass
class _Bounds:
    """Per parameter group, bounds on the largest |weight| and |first moment| after the last update,
    and how many updates ago they were measured."""

    groups: list[tuple[float, float]]
    age: int


# optimizer -> its _Bounds (weakly: an optimizer no longer used is not kept alive)
_BOUNDS: weakref.WeakKeyDictionary[Any, _Bounds] = weakref.WeakKeyDictionary()


def _measure(optimizer: Any) -> _Bounds:
    """The largest per-tensor 2-norm of each group's weights and first moments (each bounds every
    element of its tensors): one fused pass over them and one host sync."""
    tensors, spans = [], []
    for group in optimizer.param_groups:
        params = [_local(p) for p in group["params"] if _local(p).numel()]
        state = [optimizer.state.get(p, {}) for p in group["params"] if _local(p).numel()]
        moments = [_local(st["exp_avg"]) for st in state if "exp_avg" in st]  # none yet: m = 0
        spans.append((len(tensors), len(params), len(moments)))
        tensors += params + moments
    with torch.no_grad():  # [n] on the host
        norms = torch.stack(torch._foreach_norm(tensors)).double().tolist() if tensors else []  # noqa: SLF001
    groups = []
    for begin, n_params, n_moments in spans:
        weights = norms[begin : begin + n_params]
        moments = norms[begin + n_params : begin + n_params + n_moments]
        groups.append((max(weights, default=0.0), max(moments, default=0.0)))
    return _Bounds(groups, 0)


def update_stays_finite(optimizer: Any, grad_bound: float) -> bool:
    """Whether the next step is proven to keep the weights finite (`_prove`)."""
    return _prove(optimizer, grad_bound) is not None


def _prove(optimizer: Any, grad_bound: float) -> _Bounds | None:
    """The bounds after the next `optimizer.step()` when it provably leaves every weight finite,
    given that no gradient element exceeds `grad_bound` (a bound on the clipped gradients' norm);
    None when that cannot be shown (which does not mean it will fail). Only torch's AdamW (no
    amsgrad) with float hyper-parameters is analysed. Its step, for every element (t ≥ 1 after the
    step's increment):

        m ← β1·m + (1 − β1)·g,   v ← β2·v + (1 − β2)·g²,
        p ← p·(1 − lr·wd) − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

    With ε > 0 the divisor is at least ε and 1 − β1^t ≥ 1 − β1, so with P, M, G bounds on the largest
    |p|, |m|, |g|:  M' = β1·M + (1 − β1)·G  and  P' = P·|1 − lr·wd| + lr/(1 − β1) · M' / ε  bound them
    after the step. v stays ≥ 0 and cannot make a weight non-finite while g² is finite (an infinite v
    only zeroes the term). P' and g² must stay under a quarter of the dtype's largest value.

    P and M are measured (`_measure`) every REMEASURE_EVERY updates and carried by the two recurrences
    in between (`apply_update` keeps them once the step is taken), so a step costs a few float
    operations; between measurements the weights are taken to change only by this optimizer's steps
    (a step this cannot prove drops the bounds: the next call measures)."""
    if type(optimizer) is not torch.optim.AdamW:
        return None
    bounds = _BOUNDS.get(optimizer)
    if bounds is None or bounds.age >= REMEASURE_EVERY or len(bounds.groups) != len(optimizer.param_groups):
        bounds = _measure(optimizer)
    after = []
    for group, (weight, moment) in zip(optimizer.param_groups, bounds.groups, strict=True):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        scalars = (lr, wd, eps, beta1, beta2, grad_bound)
        if group.get("amsgrad") or not all(isinstance(x, (int, float)) for x in scalars):
            return _unproven(optimizer)  # a tensor learning rate (capturable) or amsgrad: not analysed
        if not (all(math.isfinite(x) for x in scalars) and eps > 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1):
            return _unproven(optimizer)
        dtypes = {p.dtype for p in group["params"]} | {torch.float32}  # fused kernels compute in float32
        limit = min((float(torch.finfo(t).max) for t in dtypes), default=math.inf) / 4
        # ε as the kernel holds it: one below a dtype's smallest normal number may round to 0 there,
        # and then 0/0 is NaN for an element whose gradient has always been 0
        eps = min(float(torch.tensor(eps, dtype=t)) for t in dtypes)
        if eps < max(float(torch.finfo(t).tiny) for t in dtypes):
            return _unproven(optimizer)
        moment = beta1 * moment + (1 - beta1) * grad_bound
        weight = weight * abs(1 - lr * wd) + lr / (1 - beta1) * moment / eps
        if not (weight < limit and grad_bound * grad_bound < limit):  # (False for NaN too)
            return _unproven(optimizer)
        after.append((weight, moment))
    return _Bounds(after, bounds.age + 1)


def _unproven(optimizer: Any) -> None:
    _BOUNDS.pop(optimizer, None)


Backup = list[tuple[torch.Tensor, torch.Tensor, dict[str, Any] | None]]  # (weight, its copy, its state's)


def _backup(optimizer: Any) -> Backup:
    """Copies of every trainable weight and its optimizer state (None: it had none yet)."""
    saved = []
    for p in _trainable(optimizer):
        state = optimizer.state.get(p)
        copied = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in (state or {}).items()}
        saved.append((p, p.detach().clone(), copied or None))
    return saved


@torch.no_grad()
def _restore(optimizer: Any, saved: Backup) -> None:
    """Put back what `_backup` copied, bit for bit, into the same tensors (nothing that holds them, a
    sharded optimizer or a compiled step, sees a new object); state created by the step is dropped."""
    for p, weight, state in saved:
        p.copy_(weight)
        if state is None:
            optimizer.state.pop(p, None)
            continue
        current = optimizer.state[p]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and isinstance(current.get(key), torch.Tensor):
                current[key].copy_(value)
            else:
                current[key] = value
