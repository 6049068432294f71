"""Activation checkpointing in the lean forward: what the training forward keeps for the backward, and
what the backward costs, with `gradient_checkpointing` off and on, side by side in one process.

For each setting, the engine's training forward (`PolicyEngine.logps`, entropies too) over one
micro-batch of a randomly initialised Llama, then its backward:

* kept: the bytes the forward leaves allocated for the backward, as the CPU allocator reports them to
  `torch.profiler` (everything autograd saves, what checkpointed layers keep, the outputs), against
  the doctor's forecast of the same (`memory_forecast.activation_bytes`, less the one layer's tensors
  that exist only while it is recomputed);
* forward + backward time: median of --repeats after one warm-up.

    python benchmarks/checkpointing.py              # writes benchmarks/results/checkpointing.json
    python benchmarks/checkpointing.py --smoke      # tiny, nothing written unless --out
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types
from pathlib import Path

import torch

# name -> hidden, layers, heads, kv heads, intermediate, vocabulary, rows, G, prompt tokens, completion tokens
SETUPS = {
    "default": (512, 8, 8, 2, 1536, 32000, 8, 4, 32, 256),
    "smoke": (64, 2, 4, 2, 96, 300, 4, 2, 4, 16),
}


def build(setup: str, checkpointing: bool) -> tuple[torch.nn.Module, types.SimpleNamespace, int]:
    from transformers import LlamaForCausalLM

    from grpokit.models.hf import llama_config

    H, layers, heads, kv, intermediate, V, b, G, Lp, T = SETUPS[setup]
    config = llama_config(
        H, layers, heads, V, 2048, intermediate, num_key_value_heads=kv, attention_dropout=0.0
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    batch = types.SimpleNamespace(
        prompt_ids=torch.randint(3, V, (b // G, Lp), generator=g).repeat_interleave(G, 0),
        prompt_mask=torch.ones(b, Lp, dtype=torch.bool),
        completion_ids=torch.randint(3, V, (b, T), generator=g),
        completion_mask=torch.ones(b, T, dtype=torch.bool),
        completion_attention=None,
    )
    return model, batch, G


def measure(setup: str, checkpointing: bool, repeats: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from grpokit.engine import EngineSpec, PolicyEngine
    from grpokit.models import ModelShape, StepShape
    from grpokit.models.memory_forecast import activation_bytes, forward_passes, layer_bytes

    model, batch, G = build(setup, checkpointing)
    engine = PolicyEngine.create(
        model,
        types.SimpleNamespace(eos_token_id=2, pad_token_id=0),
        EngineSpec(group_size=G),
    )
    b, T = batch.completion_ids.shape
    rows = slice(0, b)

    def forward_backward() -> None:
        out = engine.logps(batch, rows, entropy=True)
        (out.logps.sum() + out.entropy.sum()).backward()
        model.zero_grad(set_to_none=True)

    forward_backward()  # warm-up: the rotary table, the allocator
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        forward_backward()
        times.append(time.perf_counter() - began)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = engine.logps(batch, rows, entropy=True)
    held = sum(event.self_cpu_memory_usage for event in prof.events())
    del kept
    shape = ModelShape.of(model)
    step = StepShape(
        rows=b,
        micro_batch_size=b,
        prompt_length=batch.prompt_ids.shape[1],
        completion_length=T,
        group_size=G,
        gradient_checkpointing=checkpointing,
    )
    forecast = activation_bytes(shape, step)
    if checkpointing:
        forecast -= sum(layer_bytes(shape, step, p, True) for p in forward_passes(shape, step))
    return {
        "gradient_checkpointing": checkpointing,
        "kept_bytes": held,
        "forecast_kept_bytes": forecast,
        "forward_backward_s": {"median": statistics.median(times), "all": times},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (2 with --smoke)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    setup = "smoke" if args.smoke else "default"
    repeats = args.repeats or (2 if args.smoke else 5)
    H, layers, heads, kv, intermediate, V, b, G, Lp, T = SETUPS[setup]
    off, on = measure(setup, False, repeats), measure(setup, True, repeats)
    result = {
        "command": "python benchmarks/checkpointing.py" + (" --smoke" if args.smoke else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "model": f"Llama, hidden {H}, {layers} layers, {heads} heads ({kv} KV), intermediate "
        f"{intermediate}, V {V}",
        "work": f"{b} rows in groups of {G}, prompts of {Lp} tokens, completions of {T}",
        "off": off,
        "on": on,
        "kept_ratio": on["kept_bytes"] / off["kept_bytes"],
        "time_ratio": on["forward_backward_s"]["median"] / off["forward_backward_s"]["median"],
    }
    out = args.out or (None if args.smoke else str(Path(__file__).parent / "results" / "checkpointing.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    for side in (off, on):
        gib = 2**30
        print(
            f"checkpointing {'on ' if side['gradient_checkpointing'] else 'off'}: kept "
            f"{side['kept_bytes'] / gib:.3f} GiB (forecast {side['forecast_kept_bytes'] / gib:.3f}), "
            f"forward + backward {side['forward_backward_s']['median']:.3f} s"
        )
    print(f"kept on/off {result['kept_ratio']:.3f}, time on/off {result['time_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
