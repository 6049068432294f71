"""The GRPO training loop, top to bottom.

One step: take P prompts -> sample G completions each -> score them -> group-relative advantages
-> (old-policy log-probs if the policy moves during the step; reference log-probs if beta ≠ 0)
-> μ = num_iterations optimizer steps over the batch in micro-batches -> log, evaluate, save.

Deliberate choices, where TRL differs or is silent:
* one generation batch per step, consumed by num_iterations optimizer steps (TRL additionally
  has steps_per_generation); old log-probs are computed exactly when num_iterations > 1;
* loss normalisers are right across micro-batches: dapo/cispo/vespo divide by the token count of
  the whole batch (num_items_in_batch), the per-batch means (grpo, bnpo, dr_grpo, luspo, sapo)
  are averaged over the micro-batches;
* every step's sampling seed derives from (seed, step), so a resumed run draws exactly what an
  uninterrupted one would;
* DAPO dynamic sampling is bounded (max_resample_batches) and reports how many batches it drew.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import GRPOConfig, to_yaml
from ..data import (
    PromptSampler,
    answer_checker,
    columns_of,
    data_alphabet,
    get_task,
    has_answers,
    load_prompts,
    render_prompt,
    require_answers,
    sft_rows,
)
from ..models import (
    LeanLlamaDecoder,
    check_lora_targets,
    last_hidden_states,
    lm_head_of,
    make_reference,
    reference_model,
    require_peft,
    should_sync,
    sync_reference,
)
from ..ops import (
    LOSS_TYPES,
    TokenLogps,
    group_advantages,
    grpo_loss,
    linear_logps,
    token_logps,
    token_logps_and_entropy,
)
from ..rewards import score_completions
from ..rollout import SAMPLERS, Sampler, SamplingParams
from . import distributed
from .checkpoint import claim_output_dir, restore_distributed, save_distributed
from .evaluation import evaluate
from .metrics import ZeroSpreadWatch, check_reporters, warn, write_sft_metrics
from .optim import apply_update, make_optimizer, make_scheduler
from .run import (
    Run,
    RunResult,
    StopSignals,
    check_known_characters,
    latest_checkpoint,
    lora_from_config,
    policy_and_tokenizer,
    prepare_output_dir,
    seed_everything,
)
from .sft import run_sft


@dataclass(frozen=True)
class Batch:
    """One generation batch, B = P·G rows; rows p·G … p·G+G−1 share a prompt."""

    prompt_ids: torch.Tensor  # [B, Lp] left-padded
    prompt_mask: torch.Tensor  # [B, Lp] bool
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool (after mask_truncated_completions)
    advantages: torch.Tensor  # [B]
    prompts: list[str]  # [B]
    completions: list[str]  # [B]
    rewards: torch.Tensor  # [B]


@dataclass(frozen=True)
class TrainResult(RunResult):
    phase: str = "grpo"  # where it ended: "grpo", or before any checkpoint: "set-up", "warm start"


def _pad_cat(tensors: Sequence[torch.Tensor], value: int | bool, left: bool) -> torch.Tensor:
    """Concatenate [n_i, L_i] tensors along rows, padding the width to the largest L."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), value)
        padded.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(padded, dim=0)


def _merge(parts: Sequence[tuple[Batch, list[int]]], G: int, pad_id: int) -> Batch:
    """The chosen groups of several generation batches, as one batch."""
    rows = [[g * G + i for g in groups for i in range(G)] for _, groups in parts]
    pick = [(b, r) for (b, _), r in zip(parts, rows, strict=True) if r]
    if len(pick) == 1 and pick[0][1] == list(range(len(pick[0][0].prompts))):
        return pick[0][0]  # one whole batch (no dynamic sampling): nothing to merge
    return Batch(
        prompt_ids=_pad_cat([b.prompt_ids[r] for b, r in pick], pad_id, left=True),
        prompt_mask=_pad_cat([b.prompt_mask[r] for b, r in pick], False, left=True),
        completion_ids=_pad_cat([b.completion_ids[r] for b, r in pick], pad_id, left=False),
        completion_mask=_pad_cat([b.completion_mask[r] for b, r in pick], False, left=False),
        advantages=torch.cat([b.advantages[r] for b, r in pick]),
        prompts=[b.prompts[i] for b, r in pick for i in r],
        completions=[b.completions[i] for b, r in pick for i in r],
        rewards=torch.cat([b.rewards[r] for b, r in pick]),
    )


def generate_and_score(cfg: GRPOConfig, ctx: _Context, step: int) -> tuple[Batch, dict[str, Any]]:
    """Sample, score and compute advantages; with dynamic sampling, keep drawing batches until P
    groups with differing rewards are collected (or the bound is hit, then fill with the rest)."""
    d = ctx.dist
    G, P = cfg.num_generations, cfg.prompts_per_step // d.world_size  # this rank's complete groups
    informative: list[tuple[Batch, list[int]]] = []
    leftovers: list[tuple[Batch, list[int]]] = []
    metrics: dict[str, Any] = {}
    attempts = cfg.max_resample_batches if cfg.dynamic_sampling else 1
    for attempt in range(attempts):
        rows = ctx.prompts.next_batch()[d.rank * P : (d.rank + 1) * P]  # every rank reads the same order
        prompts = [render_prompt(r[cfg.prompt_column], ctx.tokenizer) for r in rows]
        params = replace(ctx.sampling, seed=cfg.seed * 1_000_003 + step * 101 + attempt + 7919 * d.rank)
        rollout = ctx.sampler.sample(prompts, params)
        mask = rollout.completion_mask
        if cfg.mask_truncated_completions:
            mask = mask & ~rollout.truncated[:, None]
        scores = score_completions(
            ctx.reward_funcs,
            [p for p in prompts for _ in range(G)],
            rollout.completions,
            columns=columns_of(rows, cfg.prompt_column, repeat=G),
            completion_ids=[
                ids[m].tolist()
                for ids, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
            ],
            weights=cfg.reward_weights,
            on_error=cfg.on_reward_error,
        )
        adv = group_advantages(scores.rewards, G, scale=cfg.scale_rewards)
        batch = Batch(
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            mask,
            adv.advantages,
            [p for p in prompts for _ in range(G)],
            rollout.completions,
            scores.rewards,
        )
        if attempt == 0:  # TRL's metric names, on the first (unfiltered) generation batch
            lengths = rollout.completion_mask.sum(-1).float()
            metrics |= {
                "reward": torch.nanmean(scores.rewards),
                "reward_std": scores.rewards[~scores.rewards.isnan()].std(),
                "frac_reward_zero_std": adv.is_std_zero.float().mean(),
                "completions/mean_length": lengths.mean(),
                "completions/min_length": lengths.min(),
                "completions/max_length": lengths.max(),
                "completions/clipped_ratio": rollout.truncated.float().mean(),
                "num_truncated_prompts": rollout.num_truncated_prompts,
                "reward_errors": scores.num_failed,
            } | scores.metrics()
        zero = adv.is_std_zero.reshape(-1, G)[:, 0].tolist()
        informative.append((batch, [g for g in range(P) if not zero[g] or not cfg.dynamic_sampling]))
        leftovers.append((batch, [g for g in range(P) if zero[g] and cfg.dynamic_sampling]))
        enough = sum(len(g) for _, g in informative) >= P
        if not distributed.any_rank(d, not enough):  # all ranks draw the same number of batches
            break
    metrics["num_generation_batches"] = attempt + 1
    chosen, need = [], P
    for batch, groups in informative + leftovers:
        chosen.append((batch, groups[:need]))
        need -= len(chosen[-1][1])
    return _merge(chosen, G, ctx.tokenizer.pad_token_id), metrics


def completion_stats(
    model: Any,
    batch: Batch,
    rows: slice,
    temperature: float,
    *,
    fused: bool,
    with_entropy: bool,
    group_size: int = 1,
) -> TokenLogps:
    """Log-probs (and entropies) of the completion tokens of `rows`, from one forward pass. [b, T]

    fused: take them from the decoder's hidden states and the LM head chunk by chunk
    (`ops.linear_logps`), never forming the [b, T, V] logits; used whenever the model exposes a
    plain linear head (`models.lm_head_of`), else the logits path below. With the lean Llama
    decoder and whole groups of `group_size` rows sharing a prompt, each prompt is run once and its
    keys and values shared by the group's completions (`LeanLlamaDecoder.shared_prefix`).
    """
    prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]  # [b, Lp]
    targets, target_mask = batch.completion_ids[rows], batch.completion_mask[rows]  # [b, T]
    T = targets.shape[1]
    ids = torch.cat([prompt_ids, targets], dim=1)  # [b, Lp+T]
    attention = torch.cat([prompt_mask, target_mask], dim=1).long()  # [b, Lp+T]
    head = lm_head_of(model) if fused else None
    if head is None:
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=T + 1).logits
        logits = logits[:, :-1]  # [b, T, V]: position t scores targets[:, t]
        if with_entropy:
            return token_logps_and_entropy(logits, targets, temperature)
        logps = token_logps(logits, targets, temperature)
        return TokenLogps(logps=logps, entropy=logps.new_empty(0))
    G = group_size
    if isinstance(head.decoder, LeanLlamaDecoder) and _whole_groups(prompt_ids, prompt_mask, G):
        hidden = head.decoder.shared_prefix(prompt_ids[::G], prompt_mask[::G], targets, target_mask, G)
    else:
        hidden = last_hidden_states(head, ids, attention, T + 1)[:, :-1]  # [b, T, H] scores targets
    out = linear_logps(
        hidden, head.weight, targets, temperature=temperature, bias=head.bias, return_entropy=with_entropy
    )
    return out if isinstance(out, TokenLogps) else TokenLogps(logps=out, entropy=out.new_empty(0))


def _whole_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, G: int) -> bool:
    """Whether rows come in whole groups of G that share one prompt (checked, not assumed)."""
    b = prompt_ids.shape[0]
    if G < 2 or b % G:
        return False
    first_ids = prompt_ids[::G].repeat_interleave(G, 0)  # [b, Lp]
    first_mask = prompt_mask[::G].repeat_interleave(G, 0)  # [b, Lp]
    return bool(torch.equal(first_ids, prompt_ids) and torch.equal(first_mask, prompt_mask))


def frozen_logps(
    model: Any,
    batch: Batch,
    micro: int,
    temperature: float,
    fused: bool,
    group_size: int = 1,
    inference: bool = True,
) -> torch.Tensor:
    """log-probs under a model that does not train in this step (old or reference policy). [B, T]

    With `inference` the passes run in inference mode (cheaper per operation than no_grad; not under
    FSDP, whose unsharded parameters must stay ordinary tensors); the concatenation runs outside it,
    so the result is an ordinary tensor that the loss may use under autograd."""
    B = batch.completion_ids.shape[0]
    with torch.inference_mode() if inference else torch.no_grad():
        parts = [  # no entropies: nothing reads them for a frozen policy
            completion_stats(
                model,
                batch,
                slice(s, s + micro),
                temperature,
                fused=fused,
                with_entropy=False,
                group_size=group_size,
            ).logps
            for s in range(0, B, micro)
        ]
    with torch.no_grad():
        return torch.cat(parts)


def optimizer_step(
    cfg: GRPOConfig, ctx: _Context, batch: Batch, old: torch.Tensor | None, ref: torch.Tensor | None
) -> dict[str, Any]:
    """One optimizer step over the whole batch, accumulating gradients over micro-batches."""
    B, micro = batch.completion_ids.shape[0], cfg.micro_batch_size
    n_micro = B // micro
    per_batch_mean = LOSS_TYPES[cfg.loss_type].aggregation != "global_token_mean"
    num_items = distributed.all_reduce_sum(ctx.dist, batch.completion_mask.sum())  # tokens on all ranks
    scale = distributed.loss_scale(ctx.dist, global_normaliser=not per_batch_mean)
    ctx.optimizer.zero_grad(set_to_none=True)
    totals: dict[str, torch.Tensor] = {}
    for start in range(0, B, micro):
        rows = slice(start, start + micro)
        stats = completion_stats(
            ctx.model,
            batch,
            rows,
            ctx.logps_temperature,
            fused=ctx.fused_logps,
            with_entropy=True,
            group_size=cfg.num_generations,
        )
        out = grpo_loss(
            stats.logps,
            batch.advantages[rows],
            batch.completion_mask[rows],
            old_logps=None if old is None else old[rows],
            ref_logps=None if ref is None else ref[rows],
            entropies=stats.entropy.detach(),
            loss_type=cfg.loss_type,
            beta=cfg.beta,
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            delta=cfg.delta,
            importance_sampling_level=cfg.importance_sampling_level,
            top_entropy_quantile=cfg.top_entropy_quantile,
            max_completion_length=ctx.max_completion_length,
            num_items_in_batch=num_items,
            use_bias_correction_kl=cfg.use_bias_correction_kl,
        )
        loss = out.loss / n_micro if per_batch_mean else out.loss
        (loss * scale).backward()  # ranks' gradients are averaged: scale undoes it for global counts
        # the objective is the sum of what was back-propagated; metrics are micro-batch means
        totals["loss"] = totals.get("loss", 0.0) + loss.detach()
        for key, value in out.metrics.items():
            totals[key] = totals.get(key, 0.0) + value / n_micro
    return totals | apply_update(
        ctx.model, ctx.optimizer, ctx.scheduler, totals["loss"], cfg.max_grad_norm, ctx.dist
    )


@dataclass
class _Context:
    """What the step functions share; built once by `train_grpo`."""

    model: Any
    tokenizer: Any
    reference: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    prompts: PromptSampler
    sampler: Sampler
    sampling: SamplingParams
    reward_funcs: list[Callable[..., Any]]
    max_completion_length: int
    logps_temperature: float
    fused_logps: bool = False  # log-probs from hidden states and the LM head (`completion_stats`)
    dist: distributed.Dist = distributed.Dist()


@dataclass(frozen=True)
class _Data:
    """What the run trains and evaluates on, resolved from the arguments or the config."""

    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_funcs: list[Callable[..., Any]]
    is_correct: Callable[[str, dict[str, Any]], bool] | None
    alphabet: str | None  # of the tiny model's character tokenizer: the task's, or the data's own
    max_prompt_length: int | None
    max_completion_length: int
    train_source: str = "the training rows"  # how errors name the data
    eval_source: str = "the held-out rows"


def configured_rewards(cfg: GRPOConfig, task: Any) -> list[Callable[..., Any]]:
    """The reward functions the config names (`reward_funcs`), or the task's reward."""
    from ..rewards import RewardModelFunction, exact_answer, format_tags, load_reward_reference, math_answer

    if cfg.reward_funcs is None:
        return [task.reward] if task else []
    builtins: dict[str, Any] = {
        "exact_answer": exact_answer,
        "math_answer": math_answer,
        "format_tags": format_tags,
    }
    if task is not None:
        builtins["task"] = task.reward
    funcs = []
    for spec in cfg.reward_funcs:
        if "model" in spec:
            funcs.append(
                RewardModelFunction.from_path(
                    spec["model"],
                    batch_size=int(spec.get("batch_size", 64)),
                    device=str(spec.get("device", "cpu")),
                )
            )
        elif "python" in spec:  # your own function, by reference (FILE.py:NAME or package.module:NAME)
            funcs.append(load_reward_reference(spec["python"]))
        elif spec["builtin"] in builtins:
            funcs.append(builtins[spec["builtin"]])
        else:
            raise ValueError(f"unknown builtin reward {spec['builtin']!r}; valid: {', '.join(builtins)}.")
    return funcs


def correctness_reward(is_correct: Callable[[str, dict[str, Any]], bool]) -> Callable[..., Any]:
    """1.0 for a completion `is_correct` accepts, else 0.0: the reward of an evaluation without one."""

    def correct(prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
        return [1.0 if is_correct(c, row) else 0.0 for c, row in zip(completions, rows, strict=True)]

    return correct


def _own_data(
    cfg: GRPOConfig,
    task: Any,
    train_rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    is_correct: Any,
) -> tuple[str | None, Any]:
    """(alphabet, is_correct) for data that is not a built-in task's: the tiny model's tokenizer over
    the data's own characters, and the exact answer (after strip) when the rows have an answer column."""
    if task is not None:
        return task.alphabet, is_correct
    if is_correct is None and has_answers(eval_rows or train_rows, cfg.answer_column):
        is_correct = answer_checker(cfg.answer_column)
    alphabet = None
    if cfg.model == "tiny":
        alphabet = data_alphabet(
            train_rows, eval_rows, prompt_column=cfg.prompt_column, answer_column=cfg.answer_column
        )
    return alphabet, is_correct


def resolve_data(
    cfg: GRPOConfig,
    train_rows: Any,
    eval_rows: Any,
    reward_funcs: Any,
    is_correct: Any,
    *,
    require_rewards: bool = True,
) -> _Data:
    task = get_task(cfg.task, seed=cfg.seed, num_eval=cfg.num_eval_prompts) if cfg.task else None
    train_source, eval_source = "the training rows", "the held-out rows"
    if train_rows is None:
        if task is None and cfg.dataset is None:
            raise ValueError("nothing to train on: set task or dataset in the config, or pass train rows.")
        train_rows = task.train if task else load_prompts(cfg.dataset, prompt_column=cfg.prompt_column)
        train_source = f"task {cfg.task!r}" if task else str(cfg.dataset)
    if eval_rows is None:
        eval_rows = task.eval if task else []
        eval_source = f"task {cfg.task!r} (held out)" if task else eval_source
        if task is None and cfg.eval_dataset:
            eval_rows = load_prompts(cfg.eval_dataset, prompt_column=cfg.prompt_column)
            eval_source = str(cfg.eval_dataset)
    train_rows, eval_rows = list(train_rows), list(eval_rows)[: cfg.num_eval_prompts]
    if cfg.sft_steps:  # the warm start learns the answers: say so now, not after loading a model
        require_answers(
            train_rows[: cfg.sft_examples],
            cfg.answer_column,
            source=train_source,
            purpose=f"the supervised warm start (sft_steps={cfg.sft_steps})",
        )
    alphabet, is_correct = _own_data(cfg, task, train_rows, eval_rows, is_correct)
    funcs = list(reward_funcs or configured_rewards(cfg, task))
    if not funcs and not require_rewards and is_correct is not None:
        funcs = [correctness_reward(is_correct)]  # evaluation alone: 1.0 for a right answer, else 0.0
    if not funcs:
        raise ValueError("no reward functions: pass reward_funcs, or use a built-in task.")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(cfg.reward_weights)} weights for {len(funcs)} reward functions."
        )
    return _Data(
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_funcs=funcs,
        is_correct=is_correct or (task.is_correct if task else None),
        alphabet=alphabet,
        max_prompt_length=cfg.max_prompt_length or (task.max_prompt_length if task else None),
        max_completion_length=cfg.max_completion_length or (task.max_completion_length if task else 256),
        train_source=train_source,
        eval_source=eval_source,
    )


def check_context(cfg: GRPOConfig, model: Any, tokenizer: Any, data: _Data) -> None:
    """Prompt + completion must fit the model's context; say which numbers to change if not."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is None:
        return
    longest = data.max_prompt_length or max(
        (
            len(
                tokenizer(render_prompt(r[cfg.prompt_column], tokenizer), add_special_tokens=False)[
                    "input_ids"
                ]
            )
            for r in data.train_rows[:2000]
        ),
        default=0,
    )
    if longest + data.max_completion_length > context:
        raise ValueError(
            f"prompts of up to {longest} tokens plus max_completion_length={data.max_completion_length} "
            "exceed "
            f"the model's context of {context} tokens; lower max_prompt_length or max_completion_length."
        )


def make_context(
    cfg: GRPOConfig, model: Any, tokenizer: Any, data: _Data, d: distributed.Dist | None = None
) -> _Context:
    d = d or distributed.Dist()
    reference = make_reference(model, cfg.beta)  # a plain copy, before any wrapping
    model = distributed.wrap(d, model, cfg.strategy, cpu_offload=cfg.fsdp_cpu_offload)
    if reference is not None and cfg.strategy == "fsdp":
        reference = distributed.wrap(d, reference, "fsdp", cpu_offload=cfg.fsdp_cpu_offload, trainable=False)
    optimizer = make_optimizer(model.parameters(), cfg)
    sharded = d.enabled and cfg.strategy == "fsdp"
    # DDP generates with the plain module (no communication); FSDP must run every rank's forward
    # passes in lockstep, so the sampler's early exit becomes a collective decision
    sampler = SAMPLERS[cfg.sampler](model if sharded else distributed.unwrap(model), tokenizer)
    if sharded:
        sampler.sync_finished = lambda done: not distributed.any_rank(d, not done)
        sampler.grad_free = torch.no_grad
    sampling = SamplingParams(
        num_generations=cfg.num_generations,
        max_completion_length=data.max_completion_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
        max_prompt_length=data.max_prompt_length,
        prompt_truncation=cfg.prompt_truncation,
    )
    return _Context(
        model=model,
        tokenizer=tokenizer,
        reference=reference,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, cfg, cfg.max_steps * cfg.num_iterations),
        prompts=PromptSampler(data.train_rows, cfg.prompts_per_step, seed=cfg.seed),
        sampler=sampler,
        sampling=sampling,
        reward_funcs=data.reward_funcs,
        max_completion_length=data.max_completion_length,
        logps_temperature=cfg.temperature if cfg.temperature > 0 else 1.0,
        # DDP and FSDP must see the whole model's forward (their hooks live there): logits path
        fused_logps=cfg.fused_logps and not d.enabled and lm_head_of(model) is not None,
        dist=d,
    )


SFT_PROBE_ROWS, SFT_PROBE_EVERY = 256, 10


def warm_start_goal(
    cfg: GRPOConfig, model: Any, tokenizer: Any, data: _Data, probed: list[float]
) -> Callable[[int], bool] | None:
    """With sft_target_accuracy: every SFT_PROBE_EVERY steps, greedy accuracy on the first
    SFT_PROBE_ROWS training prompts (never held-out ones), appended to `probed`; True once it reaches
    the target. Stopping at a measured accuracy, not a step count, makes GRPO start from the same
    place whatever the seed or the CPU's float round-off (a warm start's accuracy climbs steeply, so
    where a fixed step count lands is not reproducible across machines)."""
    if cfg.sft_target_accuracy is None:
        return None
    if data.is_correct is None:
        raise ValueError(
            "sft_target_accuracy needs an exact accuracy to measure: use a built-in task, or rows with an "
            "answer column; or unset sft_target_accuracy to run sft_steps."
        )
    sampler = SAMPLERS[cfg.sampler](model, tokenizer)
    probe = data.train_rows[:SFT_PROBE_ROWS]

    def done(step: int) -> bool:
        if step % SFT_PROBE_EVERY:
            return False
        metrics = evaluate(
            sampler,
            tokenizer,
            probe,
            reward_funcs=[correctness_reward(data.is_correct)],  # accuracy is all it needs
            is_correct=data.is_correct,
            prompt_column=cfg.prompt_column,
            max_prompt_length=data.max_prompt_length,
            max_completion_length=data.max_completion_length,
            batch_size=cfg.micro_batch_size,
        )
        model.train()
        probed.append(metrics["accuracy"])
        return metrics["accuracy"] >= cfg.sft_target_accuracy

    return done


def evaluator(cfg: GRPOConfig, ctx: _Context, data: _Data) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        if not data.eval_rows:
            return {}
        return evaluate(
            ctx.sampler,
            ctx.tokenizer,
            data.eval_rows,
            reward_funcs=data.reward_funcs,
            is_correct=data.is_correct,
            prompt_column=cfg.prompt_column,
            max_prompt_length=data.max_prompt_length,
            max_completion_length=data.max_completion_length,
            pass_at_k=cfg.pass_at_k,
            temperature=cfg.temperature,
            seed=cfg.seed,
            on_reward_error=cfg.on_reward_error,
            batch_size=cfg.micro_batch_size,  # rows per forward pass, as in training
        )

    return run


def save(cfg: GRPOConfig, ctx: _Context, step: int, eval_before: dict[str, float]) -> None:
    extra = {}
    if ctx.reference is not None and cfg.sync_ref_model:
        extra["reference"] = distributed.full_state_dict(ctx.dist, ctx.reference)
    save_distributed(
        ctx.dist,
        cfg.strategy,
        Path(cfg.output_dir),
        step,
        ctx.model,
        ctx.tokenizer,
        ctx.optimizer,
        ctx.scheduler,
        ctx.prompts,
        eval_before,
        to_yaml(cfg),
        cfg.save_total_limit,
        extra,
    )


def restore(cfg: GRPOConfig, ctx: _Context, checkpoint: Path) -> tuple[int, dict[str, float]]:
    """Weights, optimizer, schedule, data position and RNG from `checkpoint`: (step, eval_before)."""
    state = restore_distributed(
        ctx.dist, cfg.strategy, checkpoint, ctx.model, ctx.optimizer, ctx.scheduler, ctx.prompts
    )
    if ctx.reference is not None and "reference" in state:
        distributed.unwrap(ctx.reference).load_state_dict(state["reference"])
    return int(state["step"]), {k: float(v) for k, v in state["eval_before"].items()}


def _stopped_early(emit: Any, stop: StopSignals, output_dir: Path, phase: str) -> TrainResult:
    """A signal arrived before the first GRPO step: nothing to checkpoint, the same command starts over."""
    emit(
        "stopped",
        0,
        {"signal": stop.signal or "a signal on another rank", "phase": phase, "output_dir": str(output_dir)},
    )
    return TrainResult(output_dir, 0, {}, {}, stopped_by=stop.signal or "SIGTERM", phase=phase)


def train_grpo(
    cfg: GRPOConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    reward_funcs: Sequence[Callable[..., Any]] | None = None,
    train_rows: Sequence[dict[str, Any]] | None = None,
    eval_rows: Sequence[dict[str, Any]] | None = None,
    is_correct: Callable[[str, dict[str, Any]], bool] | None = None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Run GRPO as configured. Anything not given comes from the config (task, dataset, model).

    SIGINT and SIGTERM never cut a run short silently: during the warm start it stops after the
    current supervised step and says so (no checkpoint exists yet; the same command starts again);
    during GRPO it finishes the current update, saves a checkpoint and says how to resume."""
    with StopSignals() as stop:
        return _train_grpo(
            cfg,
            stop,
            model=model,
            tokenizer=tokenizer,
            reward_funcs=reward_funcs,
            train_rows=train_rows,
            eval_rows=eval_rows,
            is_correct=is_correct,
            on_event=on_event,
        )


def _train_grpo(  # noqa: C901 - the loop is deliberately one function that reads top to bottom
    cfg: GRPOConfig,
    stop: StopSignals,
    *,
    model: Any,
    tokenizer: Any,
    reward_funcs: Sequence[Callable[..., Any]] | None,
    train_rows: Sequence[dict[str, Any]] | None,
    eval_rows: Sequence[dict[str, Any]] | None,
    is_correct: Callable[[str, dict[str, Any]], bool] | None,
    on_event: Callable[[str, int, dict[str, Any]], None] | None,
) -> TrainResult:
    d = distributed.init()
    emit = (on_event if d.is_main else None) or (lambda kind, step, data: None)  # rank 0 reports
    if cfg.prompts_per_step % d.world_size != 0:
        raise ValueError(
            f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {d.world_size}: "
            "each rank samples complete groups of its own prompts."
        )
    check_reporters(cfg.report_to)  # a missing tensorboard / wandb is said before any work
    # ------------------------------------------------------------------ set-up
    if cfg.use_peft:
        require_peft()
    output_dir = Path(cfg.output_dir)
    replacing = claim_output_dir(output_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    data = resolve_data(cfg, train_rows, eval_rows, reward_funcs, is_correct)
    seed_everything(cfg.seed)
    if model is None:
        max_len = 4 * ((data.max_prompt_length or 64) + data.max_completion_length)
        model, tokenizer = policy_and_tokenizer(cfg, data.alphabet, max_len)
    check_context(cfg, model, tokenizer, data)
    check_known_characters(  # a character tokenizer would read an unknown character as <unk>
        tokenizer,
        cfg.model,
        [(data.train_source, data.train_rows), (data.eval_source, data.eval_rows)],
        [cfg.prompt_column, cfg.answer_column] if cfg.sft_steps else [cfg.prompt_column],
    )
    if cfg.use_peft and cfg.lora_target_modules:
        check_lora_targets(model, cfg.lora_target_modules)
    prepare_output_dir(d, cfg, replacing)  # every rank's input is valid: clear an earlier run, config.yaml
    resume_from = latest_checkpoint(cfg)  # resume=true: the newest checkpoint (its config validated)
    if cfg.sft_steps and resume_from is None:  # a supervised warm start (identical on every rank)
        emit("sft_start", 0, {})
        probed: list[float] = []
        goal = warm_start_goal(cfg, model, tokenizer, data, probed)
        warm = run_sft(
            model,
            tokenizer,
            sft_rows(data.train_rows[: cfg.sft_examples], tokenizer, cfg.prompt_column, cfg.answer_column),
            steps=cfg.sft_steps,
            batch_size=cfg.sft_batch_size,
            learning_rate=cfg.sft_learning_rate,
            warmup_steps=cfg.sft_warmup_steps,
            seed=cfg.seed,
            on_step=lambda s, loss: emit("sft_step", s, {"loss": loss}),
            should_stop=lambda: distributed.any_rank(d, stop.signal is not None),
            done=None if goal is None else lambda s: distributed.any_rank(d, goal(s)),  # ranks agree
        )
        if d.is_main:
            write_sft_metrics(output_dir, warm.losses)
        if probed:
            emit("sft_done", len(warm.losses), {"probe_accuracy": probed[-1], "reached": warm.reached})
        if warm.stopped:
            return _stopped_early(emit, stop, output_dir, "warm start")
    if cfg.use_peft:  # LoRA on the warm-started weights: only the adapters train (reference: adapters off)
        model = lora_from_config(cfg, model)
    ctx = make_context(cfg, model, tokenizer, data, d)  # reference copy, DDP/FSDP wrapping, optimizer
    if stop.signal is not None and resume_from is None:  # Ctrl-C while loading or warming up, before step 1
        return _stopped_early(emit, stop, output_dir, "set-up")
    run = Run.open(
        cfg, d, emit, stop, resume_from, lambda path: restore(cfg, ctx, path), evaluator(cfg, ctx, data)
    )

    # ------------------------------------------------------------------ the loop
    step, zero_spread = run.start, ZeroSpreadWatch()
    with run:  # the metrics writer is closed however the loop ends
        for step in range(run.start + 1, cfg.max_steps + 1):
            began = time.perf_counter()
            if not ctx.model.training:  # (a walk over every module: only when needed)
                ctx.model.train()
            # 1. sample G completions per prompt, score them, group-relative advantages
            batch, metrics = generate_and_score(cfg, ctx, step)
            # 2. the policy that sampled, if updates move the policy within this step; the reference
            old = (
                frozen_logps(
                    ctx.model,
                    batch,
                    cfg.micro_batch_size,
                    ctx.logps_temperature,
                    ctx.fused_logps,
                    cfg.num_generations,
                    inference=not ctx.dist.enabled,
                )
                if cfg.num_iterations > 1
                else None
            )
            ref = None
            if cfg.beta != 0.0:
                with reference_model(ctx.model, ctx.reference) as reference:
                    ref = frozen_logps(
                        reference,
                        batch,
                        cfg.micro_batch_size,
                        ctx.logps_temperature,
                        ctx.fused_logps,
                        cfg.num_generations,
                        inference=not ctx.dist.enabled,
                    )
            # 3. μ optimizer steps on this batch
            skipped = 0.0
            for _ in range(cfg.num_iterations):
                metrics |= optimizer_step(cfg, ctx, batch, old, ref)
                skipped += metrics["skipped_update"]
            metrics["skipped_update"] = skipped  # updates of this step skipped for a non-finite loss
            if (
                cfg.sync_ref_model
                and ctx.reference is not None
                and should_sync(step, cfg.ref_model_sync_steps)
            ):
                sync_reference(ctx.reference, ctx.model, cfg.ref_model_mixup_alpha)
            # 4. report, evaluate, save
            seconds = time.perf_counter() - began
            metrics |= {
                "step_time": seconds,
                "tokens_per_second": batch.completion_mask.sum().item() / seconds,
            }
            metrics = distributed.mean_metrics(d, metrics)  # every rank takes part
            run.log(step, metrics)
            cannot_learn = not cfg.dynamic_sampling and zero_spread.update(
                float(metrics["frac_reward_zero_std"]), float(metrics["reward"])
            )
            if cannot_learn and d.is_main:
                warn(on_event, step, cannot_learn)
            if cfg.log_completions_steps and step % cfg.log_completions_steps == 0:
                emit(
                    "completions",
                    step,
                    {
                        "prompts": batch.prompts,
                        "completions": batch.completions,
                        "rewards": batch.rewards.tolist(),
                    },
                )
            run.evaluate_if_due(step)
            # a checkpoint where due; a stop signal (on any rank) ends the run after it
            if run.finish_step(step, skipped > 0, lambda s: save(cfg, ctx, s, run.eval_before)):
                break
    return run.result(TrainResult, step)
