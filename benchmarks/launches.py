"""Operator calls of one policy-update micro-batch and one reference pass (issue 53, point 4): the
launches a GPU pays for one by one, counted on the CPU with torch's profiler (every aten operator
call the dispatcher sees, nested calls included, as `key_averages` counts them).

The model is a Llama of Qwen2.5-0.5B's layer count (24) with its shapes scaled down (hidden 64,
4 heads, intermediate 256, V = 512): the count of calls depends on the layers and the code path, not
on the widths. The micro-batch is 16 completions of 32 tokens after prompts of 16 tokens, through
the engine as training runs it: `PolicyEngine.logps` with entropies, `grpo_loss` (dapo, beta 0.04)
and its backward for the update; `frozen_logps` of the reference for the reference pass.

    python benchmarks/launches.py [--layers 24] [--out FILE]

Prints a JSON object: the calls of each piece, with the ten most frequent operators.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any


def count_calls(fn: Any) -> dict[str, Any]:
    """`fn()` once under torch's profiler (CPU): its operator calls in all, and the most frequent."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    top = sorted(events, key=lambda e: e.count, reverse=True)[:10]
    return {"calls": sum(e.count for e in events), "top": {e.key: e.count for e in top}}


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpokit.engine import EngineSpec, PolicyEngine
    from grpokit.models import build_policy, char_tokenizer
    from grpokit.ops import grpo_loss
    from grpokit.rollout import SamplingParams
    from grpokit.train.batch import Batch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=16, help="completions in the micro-batch")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    alphabet = "".join(chr(0x4E00 + i) for i in range(512 - 4))  # + <pad> <bos> <eos> <unk>
    tokenizer = char_tokenizer(alphabet)
    model = build_policy(
        hidden_size=64,
        num_layers=args.layers,
        num_heads=4,
        vocab_size=len(tokenizer),
        dropout=0.0,
        max_seq_len=16 + args.tokens + 8,
        seed=0,
        intermediate_size=256,
    )
    reference = copy.deepcopy(model).requires_grad_(False)
    G = 8
    engine = PolicyEngine.create(
        model, tokenizer, EngineSpec(group_size=G), device=torch.device("cpu"), reference=reference
    )
    prompts = [
        "".join(alphabet[(7 * p + 3 * i) % len(alphabet)] for i in range(16)) for p in range(args.rows // G)
    ]
    rollout = engine.generate(
        prompts, SamplingParams(num_generations=G, max_completion_length=args.tokens, seed=1)
    )
    B = rollout.completion_ids.shape[0]
    batch = Batch(
        prompt_ids=rollout.prompt_ids,
        prompt_mask=rollout.prompt_mask,
        completion_ids=rollout.completion_ids,
        completion_mask=rollout.completion_mask,
        advantages=torch.randn(B),
        sampling_logps=rollout.sampling_logps,
        prompts=[p for p in prompts for _ in range(G)],
        completions=rollout.completions,
        rewards=torch.zeros(B),
    )
    ref = engine.frozen_logps(batch, B, reference=True)

    def update_micro_batch() -> None:
        stats = engine.logps(batch, slice(0, B), entropy=True)
        out = grpo_loss(
            stats.logps,
            batch.advantages,
            batch.completion_mask,
            ref_logps=ref,
            entropies=stats.entropy.detach(),
            loss_type="dapo",
            beta=0.04,
            num_items_in_batch=batch.completion_mask.sum(),
        )
        out.loss.backward()

    update_micro_batch()  # (a warm-up: first-call work is not the steady state)
    result = {
        "model": f"Llama, {args.layers} layers, hidden 64, 4 heads, intermediate 256, V = {len(tokenizer)}",
        "work": f"{B} completions x {rollout.completion_ids.shape[1]} tokens, prompts of "
        f"{rollout.prompt_ids.shape[1]} tokens",
        "mode": "eager",
        "update_micro_batch": count_calls(update_micro_batch),
        "reference_pass": count_calls(lambda: engine.frozen_logps(batch, B, reference=True)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
