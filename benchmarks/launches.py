"""Operator calls of one policy-update micro-batch and one reference pass (issue 53, point 4): the
launches a GPU pays for one by one, counted on the CPU with torch's profiler (every aten operator
call the dispatcher sees, nested calls included, as `key_averages` counts them; the top-level ones,
which the host dispatches one by one; and the innermost ones that compute), eager against
torch_compile=true.

The model is a Llama of Qwen2.5-0.5B's layer count (24) with its shapes scaled down (hidden 64,
4 heads, intermediate 256, V = 512): the count of calls depends on the layers and the code path, not
on the widths. The micro-batch is 16 completions of 32 tokens after prompts of 16 tokens, through
the engine as training runs it: `PolicyEngine.logps` with entropies, `grpo_loss` (dapo, beta 0.04)
and its backward for the update; `frozen_logps` of the reference for the reference pass.

    python benchmarks/launches.py [--layers 24] [--mode eager|compiled|both] [--out FILE]

Prints a JSON object: the calls of each piece in each mode, with the ten most frequent operators,
and compiled over eager. Compiling the 24 layers takes a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any


def count_calls(fn: Any) -> dict[str, Any]:
    """`fn()` once under torch's profiler (CPU): its operator calls in all (nested ones included, as
    `key_averages` counts them), those made from outside any other operator (`top_level`: what the
    host dispatches one by one), the innermost ones that compute (`kernels`: no view, allocation or
    flag) with a compiled graph's fused kernels (inductor's, recorded by `enable_kernel_profile`): about
    the device kernels a GPU would launch; and the most frequent."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    top = sorted(events, key=lambda e: e.count, reverse=True)[:10]
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top_level = [e for e in aten if not _inside_aten(e)]
    inner = {id(e.cpu_parent) for e in aten if e.cpu_parent is not None}
    kernels = [e for e in aten if id(e) not in inner and e.name.removeprefix("aten::") not in NO_KERNEL]
    kernels += [e for e in prof.events() if "cpp_fused" in e.name]  # a compiled graph's fused kernels
    return {
        "calls": sum(e.count for e in events),
        "top_level": len(top_level),
        "kernels": len(kernels),
        "top": {e.key: e.count for e in top},
    }


# operators that compute nothing: views, allocation, conjugation flags (no kernel on a GPU)
NO_KERNEL = set(
    """
alias as_strided detach empty empty_like empty_strided expand lift_fresh narrow permute reshape
_reshape_alias resolve_conj resolve_neg select slice split squeeze t transpose unbind unsqueeze view
_unsafe_view
""".split()  # noqa: SIM905 - two dozen quoted names would hide them
)


def _inside_aten(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpokit.engine import EngineSpec, PolicyEngine
    from grpokit.models import build_policy, char_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=16, help="completions in the micro-batch")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--mode",
        choices=("eager", "compiled", "both"),
        default="both",
        help="the engine's passes as they run by default, with torch_compile=true, or both",
    )
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
    torch._inductor.config.cpp.enable_kernel_profile = True  # noqa: SLF001 - fused kernels in the profile
    G = 8
    modes = ("eager", "compiled") if args.mode == "both" else (args.mode,)
    result: dict[str, Any] = {
        "model": f"Llama, {args.layers} layers, hidden 64, 4 heads, intermediate 256, V = {len(tokenizer)}"
    }
    for mode in modes:
        engine = PolicyEngine.create(
            copy.deepcopy(model),
            tokenizer,
            EngineSpec(group_size=G, torch_compile=mode == "compiled"),
            device=torch.device("cpu"),
            reference=copy.deepcopy(model).requires_grad_(False),
        )
        result |= measure(engine, alphabet, G, args.rows, args.tokens, mode)
    if len(modes) == 2:
        result["compiled_over_eager"] = {
            piece: {
                key: round(result["compiled"][piece][key] / result["eager"][piece][key], 3)
                for key in ("calls", "top_level", "kernels")
            }
            for piece in ("update_micro_batch", "reference_pass")
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def measure(engine: Any, alphabet: str, G: int, rows: int, tokens: int, mode: str) -> dict[str, Any]:
    """The calls of one update micro-batch and one reference pass of `engine`, after a warm-up of each
    (first-call work, and a compiled engine's compiling, is not the steady state)."""
    import torch

    from grpokit.ops import grpo_loss
    from grpokit.rollout import SamplingParams
    from grpokit.train.batch import Batch

    prompts = [
        "".join(alphabet[(7 * p + 3 * i) % len(alphabet)] for i in range(16)) for p in range(rows // G)
    ]
    rollout = engine.generate(
        prompts, SamplingParams(num_generations=G, max_completion_length=tokens, seed=1)
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

    loss = grpo_loss if engine.compiled is None else engine.compiled.loss(grpo_loss)  # as update.py

    def update_micro_batch() -> None:
        stats = engine.logps(batch, slice(0, B), entropy=True)
        out = loss(
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

    def reference_pass() -> None:
        engine.frozen_logps(batch, B, reference=True)

    # the update's micro-batches share one optimizer step's weights, as update.py runs them: under
    # mixed precision their compute-dtype copies are made in the first (the warm-up) and reused
    with engine.weights_cast_once():
        update_micro_batch()  # warm-ups (a compiled engine compiles here)
        reference_pass()
        return {
            mode: {
                "work": f"{B} completions x {rollout.completion_ids.shape[1]} tokens, prompts of "
                f"{rollout.prompt_ids.shape[1]} tokens",
                "update_micro_batch": count_calls(update_micro_batch),
                "reference_pass": count_calls(reference_pass),
            }
        }


if __name__ == "__main__":
    raise SystemExit(main())
