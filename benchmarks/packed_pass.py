"""The padding-free packed pass against the padded ones (issue 28, point 2): the states that score
completion tokens, forward and backward, of one micro-batch through each route of the lean decoder,
alternating, on ragged batches.

Routes: `shared` (`shared_prefix`: each prompt once per group, completions padded to T), `padded`
(every row prompt + completion padded to Lp + T), `padding_free` (`padding_free`: each prompt once
per group, only the completions' real tokens). Work: a Llama of hidden 256, 4 layers, 4 heads (2 KV
heads), V = 512, built from a config; P prompts × G completions; prompts of Lp tokens with some left padding;
completion lengths drawn uniformly between `short`·T and T (the raggedness). Reported per case: the
median seconds of forward + backward over --repeats after a warm-up, the tokens each route runs
through the layers, and the speed-up of `padding_free` over the better padded route. The auto rule
in `models/backend.py` (`padding_free_pays`) is printed beside each case, to check against the
measured winner.

    python benchmarks/packed_pass.py [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

CASES = [  # P, G, Lp, T, short (completion lengths uniform in [short·T, T])
    (2, 8, 32, 128, 1.0),
    (2, 8, 32, 128, 0.8),
    (2, 8, 32, 128, 0.5),
    (2, 8, 32, 128, 0.1),
    (2, 8, 128, 64, 0.5),
    (4, 4, 16, 256, 0.25),
    (2, 8, 16, 8, 0.5),  # short completions: shared_prefix packs each group in one pass
    (2, 8, 16, 16, 0.5),
    (2, 8, 16, 32, 0.5),
]


def build(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=1024, vocab_size=512, max_position_embeddings=1024,
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


def batch(P: int, G: int, Lp: int, T: int, short: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 512, (P, Lp), generator=g)
    prompt_mask = torch.ones(P, Lp, dtype=torch.bool)
    for p in range(P):
        prompt_mask[p, : int(torch.randint(0, Lp // 4 + 1, (1,), generator=g))] = False  # left padding
    lengths = torch.randint(max(1, int(short * T)), T + 1, (P * G,), generator=g)
    suffix_mask = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    return {
        "prompt": prompt,
        "prompt_mask": prompt_mask,
        "suffix": torch.randint(3, 512, (P * G, T), generator=g) * suffix_mask,
        "suffix_mask": suffix_mask,
    }


def routes(decoder: Any, work: dict[str, torch.Tensor], G: int) -> dict[str, Any]:
    prompt, prompt_mask, suffix, suffix_mask = (
        work[k] for k in ("prompt", "prompt_mask", "suffix", "suffix_mask")
    )
    rows_prompt = prompt.repeat_interleave(G, 0)
    rows_mask = prompt_mask.repeat_interleave(G, 0)
    Lp, T = prompt.shape[1], suffix.shape[1]

    def padded() -> torch.Tensor:
        ids = torch.cat([rows_prompt, suffix], 1)
        mask = torch.cat([rows_mask, suffix_mask], 1)
        return decoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, Lp - 1 : Lp - 1 + T]

    return {
        "shared": lambda: decoder.shared_prefix(prompt, prompt_mask, suffix, suffix_mask, G),
        "padded": padded,
        "padding_free": lambda: decoder.padding_free(prompt, prompt_mask, suffix, suffix_mask, G),
    }


def main(argv: list[str] | None = None) -> int:
    from grpokit.models import lean_decoder
    from grpokit.models.backend import padding_free_pays

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N cases (the suite runs 1)")
    parser.add_argument("--out", default="benchmarks/results/packed_pass.json")
    args = parser.parse_args(argv)
    model = build()
    decoder = lean_decoder(model)
    results: list[dict[str, Any]] = []
    for P, G, Lp, T, short in CASES[: args.cases]:
        work = batch(P, G, Lp, T, short, seed=1)
        fns = routes(decoder, work, G)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for repeat in range(args.repeats + 1):  # alternating routes; the first round is a warm-up
            for name, fn in fns.items():
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                fn().float().pow(2).mean().backward()
                if repeat:
                    times[name].append(time.perf_counter() - start)
        real = int(work["suffix_mask"].sum())
        tokens = {
            "shared": P * Lp + P * G * T,
            "padded": P * G * (Lp + T),
            "padding_free": P * Lp + real,
        }
        medians = {name: statistics.median(t) for name, t in times.items()}
        best_padded = min(medians["shared"], medians["padded"])
        chosen = padding_free_pays(work["suffix_mask"])
        results.append({
            "P": P, "G": G, "Lp": Lp, "T": T, "short": short,
            "real_completion_share": round(real / (P * G * T), 3),
            "median_s": {k: round(v, 4) for k, v in medians.items()},
            "tokens": tokens,
            "padding_free_speedup": round(best_padded / medians["padding_free"], 3),
            "auto_takes_padding_free": chosen,
            "padding_free_fastest": medians["padding_free"] < best_padded,
        })  # fmt: skip
        row = results[-1]
        print(
            f"P={P} G={G} Lp={Lp} T={T} real share {row['real_completion_share']:.2f}: "
            + " ".join(f"{k} {v:.3f}s" for k, v in row["median_s"].items())
            + f" | speed-up {row['padding_free_speedup']:.2f}x, auto packs: {chosen}"
        )
    out = {
        "command": "python benchmarks/packed_pass.py",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
