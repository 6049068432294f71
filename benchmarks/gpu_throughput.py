"""Throughput and model FLOPs utilisation (MFU) of the pieces of a grpokit GRPO step on one device
(issue 7, benchmark (d)), for a ~0.47B-parameter Llama built from a config (hidden 1024, 24 layers,
16 heads, intermediate 4096, V = 32000: nothing is downloaded; a character tokenizer over CJK
characters provides the vocabulary).

Each piece runs on one batch of P prompts × G completions of exactly T new tokens (a random model
almost never draws EOS), as in the trainer:

* sampling: the engine's decode loop (lean backend, KV cache, prompt prefilled once per group);
* reference pass: `frozen_logps` (log-probs from hidden states and the LM head, prompts shared);
* policy update: `completion_stats` with entropies, `grpo_loss` (dapo, beta 0.04), backward,
  gradient clipping and the fused AdamW step.

Model FLOPs count the matrix products and attention: per token, 2·N_mm forward (N_mm = parameters
that multiply: every weight but the embedding table) plus 4·layers·hidden·(context) for attention;
a training token costs 3× its forward. MFU = achieved FLOP/s ÷ the device's peak dense bf16 FLOP/s
(--peak-tflops, or a table of known GPUs); on a CPU it is left out. On CUDA the weights are bf16;
on a CPU float32. Medians over --repeats after one warm-up, with the spread.

    python benchmarks/gpu_throughput.py [--device cuda] [--size 0.5b|tiny] [--out FILE]

`--size tiny --device cpu` runs the same code on a small model in seconds (the test suite does).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

SIZES = {  # hidden, layers, heads, intermediate, vocab
    "0.5b": (1024, 24, 16, 4096, 32000),
    "tiny": (64, 2, 4, 128, 512),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def model_flops_per_token(model: Any, context: float, train: bool) -> float:
    """2·N_mm + 4·layers·hidden·context forward (×3 with the backward pass)."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    multiplying = sum(p.numel() for p in model.parameters()) - embedding
    if getattr(config, "tie_word_embeddings", False):
        multiplying += embedding  # the tied head still multiplies
    forward = 2 * multiplying + 4 * config.num_hidden_layers * config.hidden_size * context
    return 3 * forward if train else forward


def timed(fn: Any, repeats: int, sync: Any) -> dict[str, float]:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def profile_table(pieces: dict[str, Any], sync: Any) -> str:
    """torch.profiler's operator table (by device time, else CPU time) of one reference pass and one
    policy update, each under its own label."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for key in ("reference_pass", "policy_update"):
            with record_function(key):
                pieces[key][0]()
            sync()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpokit.engine import EngineSpec, PolicyEngine
    from grpokit.models import Precision, build_policy, char_tokenizer, enable_fast_matmul
    from grpokit.ops import grpo_loss
    from grpokit.rollout import SamplingParams
    from grpokit.train.batch import Batch
    from grpokit.train.optim import clip_grad_norm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--decode-loop", default="auto", help="eager|static|compiled|cuda_graph (auto: by device)"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/gpu_throughput_<size>.json")
    parser.add_argument(
        "--profile", default=None, help="write a profiler table of one reference pass and update"
    )
    parser.add_argument(
        "--torch-compile", action="store_true", help="the training passes compiled (torch_compile=true)"
    )
    parser.add_argument("--compile-backend", default=None, help="torch_compile_backend (default: inductor)")
    parser.add_argument(
        "--pieces", default="sampling,reference_pass,policy_update", help="comma-separated pieces to time"
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # as the trainer runs: float32 master weights, bf16 autocast on a GPU (TF32 where autocast does not reach)
    dtype_name = "bfloat16" if cuda else "float32"
    precision = Precision.of(dtype_name)
    dtype = precision.compute
    enable_fast_matmul(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    hidden, layers, heads, intermediate, vocab = SIZES[args.size]
    alphabet = "".join(chr(0x4E00 + i) for i in range(vocab - 4))  # + <pad> <bos> <eos> <unk>
    tokenizer = char_tokenizer(alphabet)
    model = build_policy(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        vocab_size=len(tokenizer),
        dropout=0.0,
        max_seq_len=args.prompt_tokens + args.tokens + 8,
        seed=0,
        intermediate_size=intermediate,
    ).to(device=device)
    reference = copy.deepcopy(model)  # the frozen reference policy, as the trainer keeps one
    reference.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    prompts = [
        "".join(alphabet[int(i)] for i in torch.randint(0, len(alphabet), (args.prompt_tokens,), generator=g))
        for _ in range(args.prompts)
    ]
    G, T = args.generations, args.tokens
    params = SamplingParams(num_generations=G, max_completion_length=T, seed=1)
    engine = PolicyEngine.create(
        model,
        tokenizer,
        EngineSpec(
            dtype=dtype_name,
            group_size=G,
            decode_loop=args.decode_loop,
            torch_compile=args.torch_compile,
            torch_compile_backend=args.compile_backend,
        ),
        device=device,
        reference=reference,
    )
    rollout = engine.generate(prompts, params)
    B = rollout.completion_ids.shape[0]
    batch = Batch(
        prompt_ids=rollout.prompt_ids.to(device),
        prompt_mask=rollout.prompt_mask.to(device),
        completion_ids=rollout.completion_ids.to(device),
        completion_mask=rollout.completion_mask.to(device),
        advantages=torch.randn(B, generator=g).to(device),
        sampling_logps=rollout.sampling_logps.to(device),
        prompts=[p for p in prompts for _ in range(G)],
        completions=rollout.completions,
        rewards=torch.zeros(B),
    )
    ref = engine.frozen_logps(batch, args.micro_batch, reference=True)
    micro = args.micro_batch
    loss = grpo_loss if engine.compiled is None else engine.compiled.loss(grpo_loss)  # as train/update.py

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        n_micro = B // micro
        with engine.weights_cast_once():  # one compute-dtype copy for the micro-batches, as update.py
            for start in range(0, B, micro):
                micro_batch(slice(start, start + micro), n_micro)
        clip_grad_norm(model, 1.0)
        optimizer.step()

    def micro_batch(rows: slice, n_micro: int) -> None:
        stats = engine.logps(batch, rows, entropy=True)
        out = loss(
            stats.logps,
            batch.advantages[rows],
            batch.completion_mask[rows],
            ref_logps=ref[rows],
            entropies=stats.entropy.detach(),
            loss_type="dapo",
            beta=0.04,
            num_items_in_batch=batch.completion_mask.sum(),
        )
        (out.loss / n_micro).backward()

    tokens = int(batch.completion_mask.sum())  # trained / scored completion tokens
    generated = B * rollout.completion_ids.shape[1]
    width = rollout.prompt_ids.shape[1]
    pieces = {
        "sampling": (
            lambda: engine.generate(prompts, params),
            generated,
            model_flops_per_token(model, width + T / 2, train=False),
        ),
        "reference_pass": (
            lambda: engine.frozen_logps(batch, micro, reference=True),
            tokens,
            model_flops_per_token(model, width + T / 2, train=False),
        ),
        "policy_update": (update, tokens, model_flops_per_token(model, width + T / 2, train=True)),
    }
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    results: dict[str, Any] = {
        "device": name,
        "dtype": str(dtype),
        "parameters": sum(p.numel() for p in model.parameters()),
        "work": f"{args.prompts} prompts x {G} completions x {T} tokens, prompts of {width} tokens",
        "peak_tflops": peak,
        "decode_loop": engine.decoder.loop,
        "torch_compile": args.torch_compile,
    }
    pieces = {k: v for k, v in pieces.items() if k in args.pieces.split(",")}
    for key, (fn, count, flops) in pieces.items():
        t = timed(fn, args.repeats, sync)
        achieved = count * flops / t["median"]
        results[key] = t | {
            "tokens_per_second": count / t["median"],
            "model_tflops": achieved / 1e12,
            "mfu": achieved / (peak * 1e12) if peak and cuda else None,
        }
    if args.profile:
        Path(args.profile).write_text(profile_table(pieces, sync))
    if cuda:
        results["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    out = Path(args.out or f"benchmarks/results/gpu_throughput_{args.size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
