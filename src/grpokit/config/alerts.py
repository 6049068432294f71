"""The training-health alerts' thresholds: the one table of their names, defaults and meanings.

`alert_thresholds: {name: value}` overrides any of them; `train/alerts.py` applies them. It lives in the
config (no torch) so that the option can be checked against the names before any work."""

from __future__ import annotations

# name -> (default threshold, what the threshold means)
ALERT_THRESHOLDS: dict[str, tuple[float, str]] = {
    "entropy_collapse": (
        0.1,
        "mean token entropy (5-step mean) below this share of its first steps' value while the reward "
        "has not risen",
    ),
    "length_growth": (1.5, "mean completion length (5-step mean) this many times its first steps' value"),
    "truncation_share": (
        0.5,
        "with length_growth: the share of completions cut at max_completion_length (5-step mean) at "
        "least this",
    ),
    "clip_ratio": (0.2, "share of tokens whose ratio left the clipping range (clip_ratio/region_mean)"),
    "kl": (1.0, "mean per-token KL to the reference, in nats"),
    "zero_spread": (0.5, "share of groups whose G rewards all agree, for 10 steps in a row"),
    "reward_hacking": (
        0.1,
        "held-out accuracy this far below its best while the training reward is above its value then",
    ),
    "logp_mismatch": (0.1, "mean |log π − log q| between the training forward and the sampler, in nats"),
}
