"""Sampling speed: grpokit's decode loop (`rollout.Decoder`, eager step) against transformers' `generate`
on the same model, prompts and sampling settings, side by side in one process.

Default work (issue 7): 4 prompts × 8 completions × 128 new tokens from a ~20M-parameter Llama with
V = 32000 (a character tokenizer over 31,996 CJK characters, so nothing is downloaded). Both run at
temperature 1 with no early stop (a random model rarely emits EOS; each run is cut at 128 tokens).
Times are medians over --repeats runs after one warm-up run each, alternating the two.

    python benchmarks/sampler_vs_generate.py [--out benchmarks/results/sampler_vs_generate.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpokit.models import backend_of, build_policy, char_tokenizer
    from grpokit.rollout import Decoder, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/sampler_vs_generate.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    alphabet = "".join(chr(0x4E00 + i) for i in range(args.vocab - 4))  # + <pad> <bos> <eos> <unk>
    tokenizer = char_tokenizer(alphabet)
    model = build_policy(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        vocab_size=len(tokenizer),
        intermediate_size=4 * args.hidden,
        max_seq_len=1024,
        dropout=0.0,
        seed=0,
    ).eval()
    params_count = sum(p.numel() for p in model.parameters())
    prompts = [  # 16, 20, 24, 28 characters: left padding in play
        "".join(alphabet[(37 * p + 11 * i) % len(alphabet)] for i in range(16 + 4 * p))
        for p in range(args.prompts)
    ]
    params = SamplingParams(
        num_generations=args.generations, max_completion_length=args.tokens, temperature=1.0
    )
    kv = Decoder(backend_of(model), tokenizer)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)

    def run_kv() -> int:
        return int(kv.sample(prompts, params).completion_mask.sum())

    @torch.no_grad()
    def run_generate() -> int:
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.tokens,
            num_return_sequences=args.generations,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return int((out[:, enc["input_ids"].shape[1] :] != tokenizer.pad_token_id).sum())

    runs = {"grpokit_kv": run_kv, "transformers_generate": run_generate}
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():
            began = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - began)
    summary = {
        "model_parameters": params_count,
        "vocab": len(tokenizer),
        "work": f"{args.prompts} prompts x {args.generations} completions x {args.tokens} tokens",
        **{
            name: {
                "median_seconds": statistics.median(t),
                "min_seconds": min(t),
                "max_seconds": max(t),
                "tokens_per_second": tokens[name] / statistics.median(t),
            }
            for name, t in times.items()
        },
    }
    summary["ratio_kv_over_generate"] = (
        summary["grpokit_kv"]["median_seconds"] / summary["transformers_generate"]["median_seconds"]
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
