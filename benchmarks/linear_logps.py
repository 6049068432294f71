"""Log-prob + loss, forward and backward, from the last hidden state and the LM head: grpokit's
`ops.linear_logps` (chunked, never forming [N, V] logits) against the naive
`log_softmax(hidden @ Wᵀ).gather(ids)`, each in its own fresh process.

Peak memory is the kernel's resident-set high-water mark (VmHWM) beyond the inputs, reset with
/proc/self/clear_refs once hidden, weight and ids exist; it includes the gradients of hidden and
weight, which both methods must produce. Time is the median of --repeats calls after one warm-up
call (the first, measured call is the memory probe). Values and gradients are compared with the
naive float64 result on a slice, to show both compute the same thing.

    python benchmarks/linear_logps.py                                  # V = 152k, 4096 tokens, H = 896
    python benchmarks/linear_logps.py --vocab 32000 --hidden 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from logps_memory import _status_kib  # the same VmRSS/VmHWM reader (this folder is on sys.path)


def _loss(logps, advantages):
    from grpokit.ops import grpo_loss

    mask = logps.new_ones(logps.shape, dtype=bool)
    return grpo_loss(logps, advantages, mask, old_logps=logps.detach(), loss_type="dapo").loss


def _step(method: str, hidden, weight, ids, advantages):
    import torch

    from grpokit.ops import linear_logps

    hidden.grad = weight.grad = None
    if method == "grpokit":
        logps = linear_logps(hidden, weight, ids)
    else:
        logits = hidden @ weight.T  # [B, T, V]
        logps = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    _loss(logps, advantages).backward()
    return logps


def measure(method: str, tokens: int, vocab: int, hidden_size: int, repeats: int) -> dict:
    import torch

    torch.manual_seed(0)
    B = 4  # sequences; tokens are split evenly
    hidden = torch.randn(B, tokens // B, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) / hidden_size**0.5).requires_grad_()
    ids = torch.randint(0, vocab, (B, tokens // B))
    advantages = torch.randn(B)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    began = time.perf_counter()
    _step(method, hidden, weight, ids, advantages)
    first = time.perf_counter() - began
    peak_extra = max(_status_kib("VmHWM") - base, 0) * 1024
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        _step(method, hidden, weight, ids, advantages)
        times.append(time.perf_counter() - began)
    # agreement with float64 on the first 16 tokens of each sequence (same loss, same inputs)
    h64 = hidden.detach()[:, :16].double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.T, -1).gather(-1, ids[:, :16, None]).squeeze(-1)
    h32 = hidden.detach()[:, :16].clone().requires_grad_()
    w32 = weight.detach().clone().requires_grad_()
    if method == "grpokit":
        from grpokit.ops import linear_logps

        ours = linear_logps(h32, w32, ids[:, :16])
    else:
        ours = torch.log_softmax(h32 @ w32.T, -1).gather(-1, ids[:, :16, None]).squeeze(-1)
    _loss(ref, advantages.double()).backward()
    _loss(ours, advantages).backward()

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max())

    return {
        "method": method,
        "tokens": tokens,
        "vocab": vocab,
        "hidden": hidden_size,
        "naive_logits_bytes": tokens * vocab * 4,
        "peak_extra_bytes": peak_extra,
        "first_call_seconds": first,
        "median_seconds": statistics.median(times),
        "min_seconds": min(times),
        "max_seconds": max(times),
        "max_rel_error_vs_float64": {
            "logps": rel(ours, ref),
            "grad_hidden": rel(h32.grad, h64.grad),
            "grad_weight": rel(w32.grad, w64.grad),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", choices=["grpokit", "naive"], help="measure one method in this process")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    sizes = (args.tokens, args.vocab, args.hidden, args.repeats)
    if args.method:
        print(json.dumps(measure(args.method, *sizes)))
        return 0
    results = {}
    for method in ("grpokit", "naive"):
        cmd = [sys.executable, __file__, "--method", method, "--tokens", str(args.tokens)]
        cmd += ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--repeats", str(args.repeats)]
        results[method] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    ours, naive = results["grpokit"], results["naive"]
    summary = {
        "results": results,
        "peak_ratio": ours["peak_extra_bytes"] / naive["peak_extra_bytes"],
        "time_ratio": ours["median_seconds"] / naive["median_seconds"],
    }
    for r in results.values():
        print(
            f"{r['method']:8s} peak beyond inputs {r['peak_extra_bytes'] / 2**20:9.1f} MiB, "
            f"median {r['median_seconds']:.2f} s ({r['min_seconds']:.2f}–{r['max_seconds']:.2f}), "
            f"max rel. error vs float64 {max(r['max_rel_error_vs_float64'].values()):.1e}"
        )
    print(f"ratios grpokit/naive: peak {summary['peak_ratio']:.3f}, time {summary['time_ratio']:.2f}")
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
