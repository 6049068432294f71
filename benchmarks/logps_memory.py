"""Peak memory of per-token log-probs on CPU: grpokit's `token_logps` against the naive
`log_softmax(logits).gather(ids)`, each measured in its own fresh process.

The peak is read from the kernel (VmHWM, the resident-set high-water mark), reset with
/proc/self/clear_refs after the logits exist, so it counts every allocation of the call, whatever
allocator made it. Reported as bytes beyond the logits and as a fraction of the logits' size.

    python benchmarks/logps_memory.py                       # [4, 512, 32000] float32, no_grad
    python benchmarks/logps_memory.py --shape 4 512 32000 --grad
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(method: str, shape: list[int], grad: bool) -> dict:
    """Run one method in this process and return its peak extra resident memory."""
    import torch

    from grpokit.ops import token_logps

    torch.manual_seed(0)
    B, T, V = shape
    logits = torch.randn(B, T, V, requires_grad=grad)
    ids = torch.randint(0, V, (B, T))
    fns = {
        "grpokit": lambda: token_logps(logits, ids),
        "naive": lambda: torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1),
    }
    fn = fns[method]
    # Warm up the code path on a tiny input (kernel selection, lazy imports) without letting a
    # full-size first call leave freed-but-resident pages that the measured call would reuse.
    tiny, tiny_ids = torch.randn(1, 2, 8, requires_grad=grad), torch.zeros(1, 2, dtype=torch.long)
    (token_logps(tiny, tiny_ids) if method == "grpokit" else torch.log_softmax(tiny, -1)).sum()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    start = time.perf_counter()
    if grad:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    logits_bytes = logits.numel() * logits.element_size()
    extra = max(peak - base, 0) * 1024
    return {
        "method": method,
        "shape": shape,
        "grad": grad,
        "logits_bytes": logits_bytes,
        "peak_extra_bytes": extra,
        "peak_extra_fraction": extra / logits_bytes,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[4, 512, 32000], metavar=("B", "T", "V"))
    parser.add_argument("--grad", action="store_true", help="forward and backward instead of no_grad forward")
    parser.add_argument("--method", choices=["grpokit", "naive"], help="measure one method in this process")
    args = parser.parse_args(argv)
    if args.method:
        print(json.dumps(measure(args.method, args.shape, args.grad)))
        return 0
    results = []
    for method in ("grpokit", "naive"):
        cmd = [sys.executable, __file__, "--method", method, "--shape", *map(str, args.shape)]
        cmd += ["--grad"] if args.grad else []
        results.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    for r in results:
        print(
            f"{r['method']:8s} peak beyond logits: {r['peak_extra_bytes'] / 2**20:8.1f} MiB "
            f"({100 * r['peak_extra_fraction']:5.1f}% of the logits' {r['logits_bytes'] / 2**20:.0f} MiB), "
            f"{r['seconds'] * 1000:.0f} ms"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
