"""One optimizer step of a GRPO step: the loss over micro-batches, gradients accumulated, then the
update (`optim.apply_update`), with what the first update proves about itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..config.plan import LossSpec
from ..engine import PolicyEngine
from ..ops import LossOutput, distillation_advantages, grpo_loss, loss_weight
from . import distributed, optim
from .batch import Batch, pad_cat
from .before_update import LogpsBeforeUpdate, bounded_weights, mismatch_metrics, ratio_metrics
from .distill import gkd_loss
from .trainee import Phase, StepParams, StepProgress, Update


class FirstUpdateChecks:
    """What the first update of a step proves about itself from the log-probs it computes anyway (no
    extra forward), as `invariants/*` and `sampling/*` metrics:

    * `invariants/first_ratio_max`: max |π_θ/π_old − 1| over the counted tokens, where old log-probs
      exist (μ > 1). The policy has not moved yet, so it is 1 to round-off: old log-probs from the
      rollout or from a forward of the same weights, either way;
    * `invariants/kl_at_start_max` (step 1 of a run, β ≠ 0): max |log π_θ − log π_ref|. The reference
      is the starting policy, so 0 to round-off; anything else is a stale or different reference;
    * the sampler/training mismatch (`mismatch_metrics`) when no pass before the update measured it and
      the sampler draws from the loss's own distribution (no top-k, top-p, min-p or repetition penalty),
      and with sampling weights taken in the update (`LogpsBeforeUpdate.weights_in_update`), their
      ratios before the bounds;
    * a teacher's log-probs (opd): the student's reverse KL to it and the teacher's mean log-prob."""

    def __init__(self, before: LogpsBeforeUpdate, step: int, mismatch: bool) -> None:
        self.before, self.mismatch = before, mismatch or before.weights_in_update
        self.kl = step == 1 and before.ref is not None
        self.ratio: list[torch.Tensor] = []  # per micro-batch: max |ratio − 1| (0-d, on the device)
        self.gap: list[torch.Tensor] = []  # per micro-batch: max |log π_θ − log π_ref|
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (logps, q, mask)
        self.distill: list[torch.Tensor] = []  # per micro-batch: [Σ log π_S − log π_T, Σ log π_T, count]

    def add(self, logps: torch.Tensor, batch: Batch, rows: slice) -> None:
        """The micro-batch `rows`' training log-probs [b, T]."""
        logps, mask = logps.detach().float(), batch.completion_mask[rows]  # [b, T]
        before = self.before
        if before.old is not None:
            excess = ((logps - before.old[rows]).exp() - 1.0).abs()  # [b, T]
            self.ratio.append(torch.where(mask, excess, 0.0).amax())
        if self.kl:
            assert before.ref is not None
            gap = (logps - before.ref[rows]).abs()  # [b, T]
            self.gap.append(torch.where(mask, gap, 0.0).amax())
        if self.mismatch:
            self.parts.append((logps, batch.sampling_logps[rows], mask))
        if before.teacher is not None:  # the reverse KL's sample and the teacher's log-prob, summed
            gap = (logps - before.teacher[rows])[mask]  # [n]
            self.distill.append(
                torch.stack([gap.sum(), before.teacher[rows][mask].sum(), gap.new_tensor(gap.numel())])
            )

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.ratio:
            out["invariants/first_ratio_max"] = torch.stack(self.ratio).max()
        if self.gap:
            out["invariants/kl_at_start_max"] = torch.stack(self.gap).max()
        if self.parts:
            logps, q, mask = (pad_cat([p[i] for p in self.parts], 0, left=False) for i in range(3))
            out |= mismatch_metrics(logps, q, mask.bool())
            if self.before.weights_in_update:
                out |= ratio_metrics(logps, q, mask.bool())
        if self.distill:  # opd: the student's reverse KL to the teacher, k1 at the sampled tokens
            gap, teacher, count = torch.stack(self.distill).sum(0)
            out["distill/kl"] = gap / count.clamp(min=1.0)
            out["distill/teacher_logps"] = teacher / count.clamp(min=1.0)
        return out


@dataclass(frozen=True)
class UpdateOptions:
    """What one optimizer step of a step adds to the loss and reports: `checks`, on the first update,
    what it proves (`FirstUpdateChecks`, `invariants/loss_weight_error`); `entropy_coef`,
    target_entropy's bonus coefficient for this step."""

    checks: FirstUpdateChecks | None = None
    entropy_coef: float = 0.0
    progress: StepProgress | None = None  # the step's: marks the optimizer's phase


def optimizer_step(
    engine: PolicyEngine,
    update: Update,
    batch: Batch,
    before: LogpsBeforeUpdate,
    params: StepParams,
    d: distributed.Dist,
    this: UpdateOptions | None = None,
) -> dict[str, Any]:
    """One optimizer step over the whole batch: gradients zeroed, accumulated over micro-batches
    (`accumulate_gradients`), then applied (`optim.apply_update`: clipping, the finite checks, the
    schedule). While the optimizer applies them, the step's progress says so (`Phase.OPTIMIZER`): an
    error there may leave the weights half updated."""
    update.optimizer.zero_grad(set_to_none=True)
    with engine.weights_cast_once():  # (closed before the optimizer changes the weights)
        totals = accumulate_gradients(engine, batch, before, params, d, this)
    progress = this.progress if this is not None else None
    if progress is not None:
        progress.phase = Phase.OPTIMIZER
    totals |= optim.apply_update(
        engine.train_module, update.optimizer, update.scheduler, totals["loss"], params.spec.max_grad_norm, d
    )
    if progress is not None:
        progress.phase, progress.updates = Phase.UPDATE, progress.updates + 1
    return totals


def policy_loss(
    engine: PolicyEngine,
    batch: Batch,
    rows: slice,
    before: LogpsBeforeUpdate,
    params: StepParams,
    num_items: torch.Tensor,
    entropy_coef: float,
) -> tuple[LossOutput, torch.Tensor]:
    """The GRPO-family loss of the micro-batch `rows` (`ops.grpo_loss`), and the policy's log-probs of
    its tokens [b, T] (for the first update's checks)."""
    stats = engine.logps(batch, rows, entropy=True)  # [b, T]
    advantages = batch.advantages[rows]  # [b]
    if before.teacher is not None:  # teacher: logps (opd): the teacher's reverse KL joins them, per token
        student = stats.logps if before.old is None else before.old[rows]  # the policy that sampled
        advantages = distillation_advantages(
            advantages,
            student,
            before.teacher[rows],
            batch.completion_mask[rows],
            coef=params.spec.distill_coef,
        )  # [b, T]
    weights = None if before.weights is None else before.weights[rows]
    if before.weights_in_update:  # π_old is this forward's policy (one optimizer step on the batch)
        q, mask = batch.sampling_logps[rows], batch.completion_mask[rows]  # [b, T]
        weights = bounded_weights(stats.logps.detach(), q, mask, params)
    loss = grpo_loss if engine.compiled is None else engine.compiled.loss(grpo_loss)
    out = loss(
        stats.logps,
        advantages,
        batch.completion_mask[rows],
        old_logps=None if before.old is None else before.old[rows],
        ref_logps=None if before.ref is None else before.ref[rows],
        entropies=stats.entropy if entropy_coef else stats.entropy.detach(),  # the bonus's gradient
        sampling_weights=weights,
        # the off-policy mask's q: the sampler's own log-probs (a rollout server's, an older version's)
        off_policy_logps=batch.sampling_logps[rows] if params.loss.off_policy_mask_threshold else None,
        num_items_in_batch=num_items,
        entropy_coef=entropy_coef,
        entropy_bonus="as_loss" if params.spec.entropy is None else params.spec.entropy.bonus,
        **asdict(params.loss),  # loss_type, beta, epsilon, ...: grpo_loss's own names
    )
    return out, stats.logps


def accumulate_gradients(
    engine: PolicyEngine,
    batch: Batch,
    before: LogpsBeforeUpdate,
    params: StepParams,
    d: distributed.Dist,
    this: UpdateOptions | None = None,
) -> dict[str, Any]:
    """The loss over the whole batch, a micro-batch at a time, its gradients accumulated in the
    policy's .grad (zeroed by the caller: `optimizer.zero_grad`); returns the loss (`loss`) and the
    loss's metrics. `this`: what is particular to this optimizer step of the step (`UpdateOptions`)."""
    checks, entropy_coef = (this.checks, this.entropy_coef) if this is not None else (None, 0.0)
    B, micro = batch.completion_ids.shape[0], params.spec.micro_batch_size
    n_micro = -(-B // micro)  # (gkd's batch of dataset answers, P rows, may end in a shorter one)
    lp, divergence = params.loss, before.teacher_states is not None  # (teacher: distributions)
    num_items = distributed.all_reduce_sum(d, batch.completion_mask.sum())  # tokens on all ranks
    scale = distributed.loss_scale(d, global_normaliser=lp.variant.global_normaliser)
    # each micro-batch's loss is weighted so: divided by the micro-batch count unless its normaliser
    # is already the whole batch's, and scaled to undo the averaging of gradients over ranks
    factor = (1.0 if lp.variant.global_normaliser else 1.0 / n_micro) * scale
    totals: dict[str, torch.Tensor] = {}
    weight = torch.zeros((), device=batch.completion_mask.device)  # the normaliser's weight in all
    for start in range(0, B, micro):
        rows = slice(start, start + micro)
        if divergence:
            out, logps = gkd_loss(engine, batch, rows, before.teacher_states, params.spec.gkd_beta, num_items)
        else:
            out, logps = policy_loss(engine, batch, rows, before, params, num_items, entropy_coef)
        (out.loss * factor).backward()
        # the objective is the sum of what was back-propagated (before the rank scale); metrics are
        # micro-batch means, averaged; a divergence's are token means, so weighed by the micro-batch's
        # tokens (its last micro-batch may be shorter)
        totals["loss"] = totals.get("loss", 0.0) + out.loss.detach() * factor / scale
        share = 1.0 / n_micro  # (not `weight`: the normaliser's total weight, below)
        if divergence:
            share = batch.completion_mask[rows].sum().double() / batch.completion_mask.sum().clamp(min=1)
        for key, value in out.metrics.items():  # (policy_loss is a loss: summed as the loss is)
            weighed = value * factor / scale if key == "policy_loss" else value * share
            totals[key] = totals.get(key, 0.0) + weighed
        if checks is not None:
            checks.add(logps, batch, rows)
            weight = (
                weight
                + factor
                * loss_weight(
                    batch.completion_mask[rows],
                    loss_type=lp.loss_type,
                    max_completion_length=lp.max_completion_length,
                    num_items_in_batch=num_items,
                ).cpu()
            )
    if checks is not None:
        totals |= checks.metrics()
        totals["invariants/loss_weight_error"] = weight - whole_batch_weight(
            batch.completion_mask, lp, num_items
        )
    return totals


def whole_batch_weight(mask: torch.Tensor, lp: LossSpec, num_items: torch.Tensor) -> torch.Tensor:
    """What the loss's normaliser gives this rank's tokens [B, T] when one process takes the whole
    batch in one micro-batch, as a share of the run's (so averaging over ranks gives the whole). A
    normaliser by the count of every rank's tokens gives them 1 in all: this rank's share is 1 (the
    average over ranks of 1 is 1) when any rank has a token. Means per row or per token of this rank's
    batch average over ranks as they are (ranks hold equal row counts). The loop's sum over micro-batches
    and ranks must equal it: `invariants/loss_weight_error` ≈ 0 whatever the split or world size."""
    if lp.variant.global_normaliser:
        return (num_items > 0).float()
    return loss_weight(mask, loss_type=lp.loss_type, max_completion_length=lp.max_completion_length)
