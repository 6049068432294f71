"""On-policy distillation on the CPU (issue 27): a 4× smaller student learns 2-digit addition from the
main job's trained policy, against GRPO alone at equal steps, on three seeds.

The teacher is the main job (`grpokit train`, the addition preset: 0.66M parameters) after its 400
steps, trained here unless --teacher names its checkpoint. Each student is the preset's recipe at a
quarter of the parameters (hidden 64, MLP 128: 0.17M): the same supervised warm start to 35% of a
probe, then `--steps` steps of either GRPO on the exact-answer reward alone, or `loss_type=opd` with
the teacher (λ = distill_coef) on top of that same reward, or `--loss-type gkd`: the generalised JSD
to the teacher's whole distributions (β = --gkd-beta), a share --lmbda of the steps on the student's
own samples and the rest on the dataset's answers. Held-out greedy accuracy on the preset's 500
prompts is compared at the end.

    python benchmarks/opd_demo.py [--teacher DIR] [--seeds 1 2 3] [--steps 200] [--out FILE]
        [--loss-type opd|gkd] [--gkd-beta B] [--lmbda L] [--no-reward] [--skip-grpo] [--smoke]

`--smoke` runs the same code at toy size (a 3-step teacher, one seed, 2 steps): the suite runs it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

STUDENT = ["tiny_hidden_size=64", "tiny_intermediate_size=128"]  # 4 layers, 4 heads as the preset
# --smoke: toy sizes, so that the suite runs this very script in seconds
SMOKE = [
    "sft_steps=2",
    "sft_target_accuracy=null",
    "num_eval_prompts=8",
    "prompts_per_step=4",
    "num_generations=4",
    "micro_batch_size=16",
]


def _train(out: Path, *overrides: str) -> dict:
    """`grpokit train` (the addition preset) with `overrides`; its last evaluation's row."""
    cmd = [sys.executable, "-m", "grpokit", "train", f"output_dir={out}", "progress=false", "overwrite=true"]
    subprocess.run([*cmd, *overrides], check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    return {
        "before": evals[0]["eval/accuracy"],
        "after": evals[-1]["eval/accuracy"],
        "steps": evals[-1]["step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, help="the main job's checkpoint (default: train it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--distill-coef", type=float, default=1.0, help="λ of the teacher's reverse KL")
    parser.add_argument("--skip-grpo", action="store_true", help="only the OPD runs (GRPO's are λ-free)")
    parser.add_argument("--no-reward", action="store_true", help="distillation alone: reward_weights [0]")
    parser.add_argument("--loss-type", choices=["opd", "gkd"], default="opd")
    parser.add_argument("--gkd-beta", type=float, default=0.5, help="gkd: β of the generalised JSD")
    parser.add_argument("--lmbda", type=float, default=0.5, help="gkd: the share of on-policy steps")
    parser.add_argument("--teacher-steps", type=int, default=400, help="the main job's length, when trained")
    parser.add_argument("--smoke", action="store_true", help="toy size, for the test suite")
    parser.add_argument("--work", type=Path, default=Path("runs/opd_demo"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "opd_demo.json")
    args = parser.parse_args()
    began = time.time()
    teacher = args.teacher
    toy = SMOKE if args.smoke else []
    if args.smoke:
        args.seeds, args.steps, args.teacher_steps = args.seeds[:1], 2, 3
    if teacher is None:
        length = [f"max_steps={args.teacher_steps}", f"eval_steps={args.teacher_steps}"]
        result = _train(args.work / "teacher", *length, *toy)
        teacher = sorted(
            (args.work / "teacher").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])
        )[-1]
        print(f"teacher: the main job, held-out accuracy {result['before']:.3f} -> {result['after']:.3f}")
    rows = []
    for seed in args.seeds:
        common = [f"seed={seed}", f"max_steps={args.steps}", f"eval_steps={args.steps}", *STUDENT, *toy]
        grpo = None if args.skip_grpo else _train(args.work / f"grpo-{seed}", *common)
        distill = [f"loss_type={args.loss_type}", f"teacher_model={teacher}"]
        if args.loss_type == "opd":
            distill.append(f"distill_coef={args.distill_coef}")
        else:
            distill += [f"gkd_beta={args.gkd_beta}", f"lmbda={args.lmbda}"]
        distill += ["reward_weights=[0.0]"] if args.no_reward else []
        opd = _train(args.work / f"{args.loss_type}-{seed}", *common, *distill)
        rows.append({"seed": seed, "grpo": grpo, args.loss_type: opd})
        alone = "" if grpo is None else f"GRPO alone {grpo['after']:.3f}, "
        how = (
            f"OPD (λ={args.distill_coef:g})"
            if args.loss_type == "opd"
            else f"GKD (β={args.gkd_beta:g}, lmbda={args.lmbda:g})"
        )
        print(
            f"seed {seed}: warm start {opd['before']:.3f}; {alone}{how}"
            f"{'' if args.no_reward else ' + reward'} {opd['after']:.3f} after {args.steps} steps"
        )
    report = {
        "machine": platform.processor() or platform.machine(),
        "teacher": str(teacher),
        "student": STUDENT,
        "loss_type": args.loss_type,
        "distill_coef": args.distill_coef if args.loss_type == "opd" else None,
        "gkd_beta": args.gkd_beta if args.loss_type == "gkd" else None,
        "lmbda": args.lmbda if args.loss_type == "gkd" else None,
        "reward": not args.no_reward,
        "steps": args.steps,
        "seeds": rows,
        "seconds": round(time.time() - began),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
