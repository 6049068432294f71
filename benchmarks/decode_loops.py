"""grpokit's decode loops side by side (issue 15): `decode_loop` eager, static, compiled and, on a GPU,
cuda_graph, against transformers' `generate`, on the same model, prompts and seed, alternating runs.

Setups (models built from configs, character tokenizers: nothing is downloaded):

* `addition` (CPU): the main job's shape, a 0.8M-parameter Llama (hidden 128, 4 layers, 12-token
  alphabet), 32 prompts × 8 completions × 4 tokens;
* `v32k` (CPU): hidden 256, 4 layers, V = 32000, 4 × 8 × 128 tokens;
* `0.5b` (GPU): the 0.47B Llama of `gpu_throughput.py` (hidden 1024, 24 layers, V = 32000), bf16
  autocast with float32 master weights, 8 × 8 × 256 tokens and 64 × 8 × 256 (512 rows).

A random model almost never draws EOS, so every row runs the full length (compaction has no work:
this measures the step itself). Reported per loop: the median seconds per rollout over --repeats
after a warm-up rollout (whose time, compile and graph capture included, is reported apart),
completion tokens per second, the ratio to the eager loop and to `generate`, and on a GPU the
fraction of the weight-read floor (every decode step reads the bf16 weights once: bytes ÷ the
device's memory bandwidth, --bandwidth-tbs).

    python benchmarks/decode_loops.py [--setup addition|v32k|0.5b] [--rows 64,512] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SETUPS = {  # hidden, layers, heads, intermediate, vocab (0: the addition alphabet), prompt tokens, T
    "addition": (128, 4, 4, 512, 0, 8, 4),
    "v32k": (256, 4, 4, 1024, 32000, 16, 128),
    "0.5b": (1024, 24, 16, 4096, 32000, 64, 256),
    "tiny": (32, 2, 4, 64, 0, 6, 6),  # the test suite's smoke run
}
BANDWIDTH_TBS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}


class _Generate:
    """transformers' `generate` on the same work (sampled, no log-probs recorded: its fastest form)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def sample(self, prompts: list[str], params: Any) -> Any:
        import torch

        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(
                **{k: v.to(self.model.device) for k, v in enc.items()}, do_sample=True, top_k=0, top_p=1.0,
                max_new_tokens=params.max_completion_length, num_return_sequences=params.num_generations,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
            )  # fmt: skip
        return type("Out", (), {"completion_ids": out})


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpokit.models import Precision, backend_of, build_policy, char_tokenizer, enable_fast_matmul
    from grpokit.rollout import Decoder, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(SETUPS), default="addition")
    parser.add_argument("--device", default=None, help="default: cuda for 0.5b, else cpu")
    parser.add_argument("--rows", default=None, help="P·G values, comma-separated (G = 8)")
    parser.add_argument("--loops", default=None, help="default: eager,static,compiled (+cuda_graph on a GPU)")
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth-tbs", type=float, default=None, help="the device's memory bandwidth")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/decode_loops_<setup>.json")
    args = parser.parse_args(argv)

    hidden, layers, heads, intermediate, vocab, prompt_tokens, T = SETUPS[args.setup]
    device = torch.device(args.device or ("cuda" if args.setup == "0.5b" else "cpu"))
    cuda = device.type == "cuda"
    precision = Precision.of("bfloat16" if cuda else "float32")
    enable_fast_matmul(device)
    G = 8
    default_rows = {"0.5b": "64,512", "addition": "256"}.get(args.setup, "32")
    rows = [int(r) for r in (args.rows or default_rows).split(",")]
    loops = (args.loops or ("eager,static,compiled" + (",cuda_graph" if cuda else ""))).split(",")
    # CJK characters for a large vocabulary (char_tokenizer adds <pad> <bos> <eos> <unk>), else addition's
    alphabet = "".join(chr(0x4E00 + i) for i in range(vocab - 4)) if vocab else "0123456789+="
    tokenizer = char_tokenizer(alphabet)
    model = build_policy(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        vocab_size=len(tokenizer),
        dropout=0.0,
        max_seq_len=prompt_tokens + T + 8,
        seed=0,
        intermediate_size=intermediate,
    ).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(0)
    weight_bytes = 2 * sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)  # bf16 reads
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    bandwidth = args.bandwidth_tbs or next((v for k, v in BANDWIDTH_TBS.items() if k in name), None)
    results: dict[str, Any] = {
        "setup": args.setup,
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens": T,
        "runs": [],
    }
    for B in rows:
        prompts = [
            "".join(alphabet[int(i)] for i in torch.randint(0, len(alphabet), (prompt_tokens,), generator=g))
            for _ in range(B // G)
        ]
        params = SamplingParams(num_generations=G, max_completion_length=T, seed=1)
        samplers: dict[str, Any] = {}
        first: dict[str, float] = {}
        for loop in loops + (["generate"] if args.generate else []):
            sampler = (
                _Generate(model, tokenizer)
                if loop == "generate"
                else Decoder(backend_of(model), tokenizer, loop)
            )
            began = time.perf_counter()
            with precision.autocast(device):
                sampler.sample(prompts, params)
            sync()
            first[loop] = time.perf_counter() - began  # compile and capture included
            samplers[loop] = sampler
        times: dict[str, list[float]] = {loop: [] for loop in samplers}
        for _ in range(args.repeats):
            for loop, sampler in samplers.items():
                sync()
                began = time.perf_counter()
                with precision.autocast(device):
                    out = sampler.sample(prompts, params)
                sync()
                times[loop].append(time.perf_counter() - began)
                assert out.completion_ids.shape[0] == B
        run: dict[str, Any] = {"rows": B, "loops": {}}
        eager = statistics.median(times["eager"])
        for loop, ts in times.items():
            median = statistics.median(ts)
            entry = {
                "median_s": round(median, 5),
                "min_s": round(min(ts), 5),
                "max_s": round(max(ts), 5),
                "first_s": round(first[loop], 3),
                "tokens_per_s": round(B * T / median, 1),
                "vs_eager": round(median / eager, 3),
            }
            if "generate" in times:
                entry["vs_generate"] = round(median / statistics.median(times["generate"]), 4)
            if cuda and bandwidth:  # T decode steps (prefill included), each reading the weights once
                floor = T * weight_bytes / (bandwidth * 1e12)
                entry["weight_read_floor_fraction"] = round(floor / median, 3)
            run["loops"][loop] = entry
            print(f"rows {B:4d}  {loop:10s}  " + "  ".join(f"{k} {v}" for k, v in entry.items()), flush=True)
        results["runs"].append(run)
    out = Path(args.out or f"benchmarks/results/decode_loops_{args.setup}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
