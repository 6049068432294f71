"""Every metric a run logs (metrics.jsonl, TensorBoard, wandb), with what it means: the one table the
docs' metrics reference is generated from (scripts/docs_reference.py), and that the tests hold every
logged key against (`undescribed`). `<name>` stands for a reward function's name (a reward server's
holds slashes: remote:HOST:PORT/PATH), `<k>` for pass@k's
k, `<bucket>` for a margin bucket (0-0.5, ..., 4-inf); a key with the `eval/` prefix is the held-out
evaluation's value of the key after it."""

from __future__ import annotations

import re
from collections.abc import Iterable

# pattern -> meaning; grouped as the reference shows them
METRICS: dict[str, str] = {
    # ---------------------------------------------------------------- the step
    "step": "the GRPO step (one generation batch, num_iterations updates on it)",
    "time": "seconds since the run (or its resume) started",
    "loss": "the policy loss as optimised (loss_type's normalisation), averaged over the step's updates",
    "grad_norm": "the gradient's global norm before clipping (max_grad_norm)",
    "learning_rate": "the learning rate of the step's last update",
    "skipped_update": "1 when an update was skipped for a non-finite loss or gradient",
    "update_rolled_back": "1 when an update was undone for non-finite weights",
    "kl": "mean per-token KL to the reference (beta > 0), nats",
    "entropy": "mean token entropy of the sampled completions under the policy, nats",
    "policy_loss": "the loss without the entropy bonus (entropy_coef, target_entropy), summed as loss is",
    "entropy/coef": "the entropy bonus's coefficient applied this step (entropy_coef, target_entropy)",
    "entropy/next_coef": "the coefficient the next step starts from (TRL's entropy_coef after the step)",
    "entropy/target": "target_entropy or entropy_target: the entropy the adaptive bonus aims at, nats",
    # ---------------------------------------------------------------- rewards
    "reward": "mean combined reward of the step's completions (reward_weights applied)",
    "reward_std": "standard deviation of the combined reward over the step's completions",
    "rewards/<name>/mean": "mean of reward function <name> over the step's completions",
    "rewards/<name>/std": "standard deviation of reward function <name>",
    "logged/<name>": "what reward functions logged with log_metric(name, value) (TRL's), the step's mean",
    "reward_errors": "reward calls that failed and were scored None (on_reward_error: unscorable)",
    "frac_reward_zero_std": "share of groups whose G rewards all agree (zero advantages: nothing learned)",
    "num_generation_batches": "generation batches drawn for the step (dynamic_sampling draws more)",
    # ---------------------------------------------------------------- completions
    "completions/mean_length": "mean completion length, tokens",
    "completions/min_length": "shortest completion, tokens",
    "completions/max_length": "longest completion, tokens",
    "completions/clipped_ratio": "share of completions cut at max_completion_length (no EOS)",
    "completions/correct_ratio": "share of the step's completions judged right (a task's answer check)",
    "completions/correct_mean_length": "mean length of the completions judged right, tokens (NaN: none)",
    "completions/incorrect_mean_length": "mean length of the completions judged wrong, tokens (NaN: none)",
    "num_truncated_prompts": "prompts cut to max_prompt_length (from the left)",
    "num_prompts": "prompts evaluated (with eval/)",
    "accuracy": "share of prompts answered right (held-out, greedy; reward models: pairs ranked right)",
    "pass@<k>": "share of prompts with a right answer among k sampled completions (pass_at_k)",
    "turns": "mean policy turns of a multi-turn episode (with eval/)",
    # ---------------------------------------------------------------- clipping and off-policy
    "clip_ratio/low_mean": "share of tokens whose ratio fell below 1 - epsilon (negative advantages)",
    "clip_ratio/low_min": "the smallest share of one completion's tokens below 1 - epsilon",
    "clip_ratio/high_mean": "share of tokens whose ratio rose above 1 + epsilon_high (positive advantages)",
    "clip_ratio/high_max": "the largest share of one completion's tokens above 1 + epsilon_high",
    "clip_ratio/region_mean": "share of tokens outside the clipping range, either side",
    "vespo/phi_seq_mean": "loss_type vespo: mean of its per-sequence weight φ",
    "cispo_clip_ratio": "loss_type cispo: share of tokens whose weight was capped at epsilon_high",
    "sampling/sampling_logp_difference/mean": "mean |log π − log q|, training forward against sampler, nats",
    "sampling/sampling_logp_difference/max": "largest |log π − log q| of a token, nats",
    "sampling/logp_mismatch_share": "share of tokens more than 0.1 nats apart between trainer and sampler",
    "sampling/importance_sampling_ratio/mean": "sampling_correction: mean importance weight π_prox / q",
    "sampling/importance_sampling_ratio/max": "sampling_correction: largest importance weight",
    # ---------------------------------------------------------------- runtime invariants
    "invariants/groups_intact": "1 when every group's rows stayed together through the step",
    "invariants/group_advantage_sum_max": "largest |sum of a group's advantages| (0 by construction)",
    "invariants/loss_weight_error": "the loss normaliser's deviation from its definition (0 by construction)",
    "invariants/first_ratio_max": "largest |ratio − 1| at the first update of a batch (0 when on-policy)",
    "invariants/kl_at_start_max": "largest per-token KL at the first step (0: the reference is the policy)",
    # ---------------------------------------------------------------- time and machine
    "step_time": "seconds the step took",
    "tokens_per_second": "completion tokens sampled per second of the step",
    "timing/sampling": "seconds sampling the step's completions",
    "timing/scoring": "seconds in the reward functions and advantages",
    "timing/reference": "seconds computing old-policy and reference log-probs",
    "timing/update": "seconds in the updates",
    "compile/graphs": "torch_compile: training-pass graphs compiled so far (a pass and shape bucket each)",
    "cpu_threads": "CPU threads the run computes on (num_threads; adapts to other load)",
    "memory/max_allocated_gib": "the GPU's peak allocated memory so far, GiB",
    # ---------------------------------------------------------------- multi-turn episodes
    "env/turns": "mean policy turns of an episode",
    "env/reward": "mean reward the environment paid an episode",
    "env/tool_calls": "tool calls made in the step's episodes",
    "env/tool_errors": "tool calls that raised (the error text went back to the policy)",
    "env/tool_timeouts": "tool calls stopped at tool_timeout",
    "env/malformed_calls": "tool calls the policy wrote that could not be parsed",
    # ---------------------------------------------------------------- curriculum
    "curriculum/active": "share of prompts in the active pool",
    "curriculum/solved": "share of prompts set aside as solved",
    "curriculum/failed": "share of prompts set aside as failed",
    # ---------------------------------------------------------------- asynchronous GRPO
    "async/staleness": "weight versions between the batch's sampler and the policy it trains (exact)",
    "async/weight_version": "the weight version the batch was sampled with",
    "async/queue_wait_s": "seconds the trainer waited for the batch",
    "async/worker_wait_s": "seconds the rollout worker waited for the batch's weights",
    "async/weight_sync_s": "seconds publishing and loading the weights",
    "async/worker": "which rollout worker sampled the batch (rollout_workers)",
    # ---------------------------------------------------------------- distillation
    "distill/kl": "opd/gkd: per-token reverse KL of the student to the teacher, nats",
    "distill/divergence": "gkd: the generalised JSD (gkd_beta) to the teacher, nats a token",
    "distill/on_policy": "gkd: 1 when the step's batch was the student's own samples (lmbda)",
    "distill/teacher_logps": "opd/gkd: mean teacher log-prob of the completion tokens",
    # ---------------------------------------------------------------- the warm start (sft_metrics.jsonl)
    "sft_step": "the supervised warm start's step",
    "sft/loss": "the warm start's cross-entropy on the answer tokens, nats a token",
    # ---------------------------------------------------------------- reward models
    "margin": "reward model: mean score of the chosen minus the rejected response",
    "chosen_rewards": "reward model: mean score of the chosen responses",
    "rejected_rewards": "reward model: mean score of the rejected responses",
    "num_pairs": "reward model: preference pairs evaluated",
    "calibration/<bucket>/count": "reward model: pairs whose |score margin| falls in the bucket (lo-hi)",
    "calibration/<bucket>/accuracy": "reward model: share of the bucket's pairs ranked right",
    "num_truncated": "reward model: pairs longer than max_length, cut to it (long_pairs: truncate)",
    "num_dropped": "reward model: pairs longer than max_length, dropped (long_pairs: drop)",
}


def _regex(pattern: str) -> re.Pattern[str]:
    text = re.escape(pattern)
    for placeholder, matches in (
        ("<name>", r".+"),
        ("<k>", r"\d+"),
        ("<bucket>", r"[0-9.]+-(?:[0-9.]+|inf)"),
    ):
        text = text.replace(re.escape(placeholder), matches)
    return re.compile(text)


_PATTERNS = [(_regex(p), p) for p in METRICS]


def describe(key: str) -> str | None:
    """The meaning of a logged key (an eval/ key: the held-out value of the key after it), or None."""
    base = key.removeprefix("eval/")
    for regex, pattern in _PATTERNS:
        if regex.fullmatch(base):
            return ("held-out: " if key != base else "") + METRICS[pattern]
    return None


def undescribed(keys: Iterable[str]) -> list[str]:
    """The keys `describe` does not know, sorted: a metric logged without a reference entry."""
    return sorted({k for k in keys if describe(k) is None})


def metrics_reference() -> str:
    """The docs' metrics page (docs/reference/metrics.md)."""
    lines = [
        "# Metrics reference",
        "",
        "Generated from `grpokit/train/metric_names.py` (`python3 scripts/docs_reference.py`): every metric "
        "a run logs to metrics.jsonl (and TensorBoard, wandb). `<name>` is a reward function's name, `<k>` "
        "pass@k's k; with the `eval/` prefix, the held-out evaluation's value. The suite fails when a run "
        "logs a key this table lacks.",
        "",
        "| metric | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{pattern}` | {meaning} |" for pattern, meaning in METRICS.items()]
    return "\n".join(lines) + "\n"
