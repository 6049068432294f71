"""The acceptance check for refactors: the same short trainings, run with the code of a base revision
and with the current working tree, give the same numbers bit for bit.

    python3 scripts/same_numbers.py [--base REV] [--steps 20]
        [--paths main,tool_addition,rlhf_addition,opd,gkd,async_k0,async_k1,async_k2,server]
        [--current REV] [--threads 1] [--keep]

The base revision (default b614b97) is checked out once as a detached git worktree in the temporary
directory ($TMPDIR or /tmp: grpokit-base-<sha>, reused while it is a clean checkout of that commit);
the working tree of this repository is never touched. `--current REV` compares the base with another
revision instead of the working tree (`--current b614b97`: base against base, the check that two runs of
the same code agree on this machine).

Each path is one short training (`python3 -m grpokit train PRESET key=value ...`), run twice, one
after the other, never at once: with the base's src/ and with the current src/, each in a fresh
process that puts that src/ first on sys.path (and as PYTHONPATH), drops any editable-install finder,
and checks and prints which grpokit it imported. Both runs get the same command, seed, threads
(`num_threads` and OMP/MKL threads pinned, 1 by default), device=cpu and PYTHONHASHSEED, each into its
own temporary output_dir. Then every value of every row of metrics.jsonl, sft_metrics.jsonl (the warm
start) and alerts.jsonl must be equal (exact float equality, NaN equal to NaN, 0.0 not -0.0), except
the fields that measure the machine (EXCLUDED), and every tensor of the final checkpoint's
*.safetensors must be equal byte for byte (same names, dtypes, shapes).

The paths (STEPS = --steps; every run: progress=false overwrite=true device=cpu num_threads=N):
  main           `train addition` (the README's first command) with a short warm start: sft_steps=40
                 (target accuracy kept: probed every 10 steps), STEPS GRPO steps, 32 held-out prompts
                 evaluated every 10 steps, a checkpoint every 10 steps
  tool_addition  `train tool_addition`: multi-turn episodes with the calc tool, from a warmed-up policy
                 (a fixture made once by the base code and cached: the preset's warm start to its 35%
                 target, then 1 GRPO step), sft_steps=0, 8 prompts a step in micro-batches of 32
  rlhf_addition  `reward reward_addition_rlhf` for 10 steps (32 pairs a step in micro-batches of 16),
                 compared too; then `train rlhf_addition` on both sides with the reward model the base
                 side trained, sft_steps=0, 16 prompts a step
  opd, gkd       `train addition loss_type=opd|gkd teacher_model=T`, T the base side's main run (its
                 final checkpoint; made for the purpose when main is not among --paths), sft_steps=0,
                 16 prompts a step (gkd: lmbda 0.5, on- and off-policy steps both)
  async_k0/1/2   `train addition max_staleness=k` (a rollout worker samples and scores), from the teacher
                 T, sft_steps=0, 16 prompts a step (the async/*_s waits measure the machine: excluded)
  server         the same with max_staleness=1 and rollout_server_urls: a `grpokit serve-policy T`
                 process of each side's own code samples
The fixtures (tool warm start, reward model, teacher) come from the base code and are the same files
on both sides, so that each path's comparison isolates that path's own code.

Prints one line per path (`main: 20 steps, 35 metrics equal (...), 39 tensors equal`) or its first
difference (file, step, key, both values) and exits 1 if anything differs or a run fails; the run
directories are then kept (--keep keeps them always). Each current-side run imports the working tree
as it is when that run starts. Cost: the ten runs (and the reward model's two) take about 200 s of CPU
at num_threads=1, so about 3.5 minutes on an idle 2-core CPU; the tool warm start adds about 55 s the
first time. Measured against b614b97 with other work on the same two cores (load 8-9): 473 s wall.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = "b614b97"
PATHS = ("main", "tool_addition", "rlhf_addition", "opd", "gkd", "async_k0", "async_k1", "async_k2", "server")
REWARD_MODEL_STEPS = 10

# fields that measure the machine, not the computation: wall-clock timestamps and durations, throughput,
# and the GPU's memory (logged on a GPU only). cpu_threads stays compared: num_threads pins it.
EXCLUDED_KEYS = ("time", "step_time", "tokens_per_second")
# (asynchronous runs: the seconds each side waited for the other and for the weights)
EXCLUDED_KEYS += ("async/queue_wait_s", "async/worker_wait_s", "async/weight_sync_s")
EXCLUDED_PREFIXES = ("timing/", "memory/")
# alerts.jsonl's prose (its numbers, step, name, value and threshold, are compared)
EXCLUDED_TEXT = ("advice",)
METRIC_FILES = ("metrics.jsonl", "sft_metrics.jsonl", "alerts.jsonl")

# Run in the child: import grpokit from SRC (argv[1]) and nowhere else, write where it came from to
# argv[2], then run `python -m grpokit` with the remaining arguments.
BOOT = r"""
import os, runpy, sys
src, where = os.path.realpath(sys.argv[1]), sys.argv[2]
del sys.argv[1:3]
sys.path.insert(0, src)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
import grpokit
found = os.path.realpath(grpokit.__file__)
with open(where, "w") as out:
    out.write(found)
if not found.startswith(src + os.sep):
    sys.exit(f"same_numbers: grpokit was imported from {found}, not from {src}")
sys.argv[0] = "grpokit"
runpy.run_module("grpokit", run_name="__main__", alter_sys=True)
"""


def excluded(key: str) -> bool:
    return key in EXCLUDED_KEYS or key in EXCLUDED_TEXT or key.startswith(EXCLUDED_PREFIXES)


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def worktree(rev: str) -> Path:
    """A clean detached worktree of `rev` in the temporary directory, made once and then reused."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = Path(tempfile.gettempdir()) / f"grpokit-base-{sha[:12]}"
    if path.exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
        changed = (
            git("status", "--porcelain", "--untracked-files=no", cwd=path) if head.returncode == 0 else "?"
        )
        if head.stdout.strip() == sha and not changed:
            return path
        remove = f"git worktree remove --force {path}"
        sys.exit(f"{path} exists but is not a clean checkout of {sha[:12]}: remove it ({remove})")
    git("worktree", "add", "--force", "--detach", str(path), sha)  # --force: a registered path since deleted
    return path


@dataclass
class Side:
    name: str  # base | current
    src: Path
    label: str  # what the user named: a revision or "working tree"


def child_env(src: Path, threads: int) -> dict[str, str]:
    """The environment both sides run in: this one without Python, thread, rank and GPU settings of its
    own, and with the same pinned ones."""
    drop = ("PYTHON", "OMP_", "MKL_", "CUDA_VISIBLE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        PYTHONPATH=str(src),
        PYTHONNOUSERSITE="1",
        PYTHONHASHSEED="0",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
    )
    return env


def children_cpu() -> float:
    """User and system CPU seconds of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class RunFailed(Exception):
    pass


@dataclass
class Harness:
    base: Side
    current: Side
    work: Path  # this invocation's run directories
    cache: Path  # fixtures made by the base code, kept between invocations
    steps: int
    threads: int
    base_runs: dict[str, Path] = field(default_factory=dict)
    cpu_seconds: float = 0.0  # of every run: the wall time on an idle machine, at num_threads=1

    def run(self, side: Side, name: str, args: list[str]) -> Path:
        """`python -m grpokit ARGS` with `side`'s code into work/runs/NAME-SIDE; its output_dir."""
        out = self.work / "runs" / f"{name}-{side.name}"
        return self.run_into(side, out, args)

    def run_into(self, side: Side, out: Path, args: list[str]) -> Path:
        log, where = out.with_suffix(".log"), out.with_suffix(".where")
        out.parent.mkdir(parents=True, exist_ok=True)
        cwd = self.work / "cwd"  # empty: no file there shadows a preset's name
        cwd.mkdir(exist_ok=True)
        common = ["progress=false", "overwrite=true", "device=cpu", f"num_threads={self.threads}"]
        cmd = [sys.executable, "-c", BOOT, str(side.src), str(where), *args, f"output_dir={out}", *common]
        began, cpu = time.perf_counter(), children_cpu()
        with log.open("w") as stream:
            env = child_env(side.src, self.threads)
            done = subprocess.run(cmd, cwd=cwd, env=env, stdout=stream, stderr=subprocess.STDOUT)
        seconds, cpu = time.perf_counter() - began, children_cpu() - cpu
        self.cpu_seconds += cpu
        imported = where.read_text() if where.is_file() else "(not imported)"
        print(f"    {side.name:7s} {out.name:22s} {seconds:5.1f} s ({cpu:5.1f} s CPU)  grpokit: {imported}")
        if done.returncode:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RunFailed(f"{out.name} exited {done.returncode} (log {log}):\n{tail}")
        return out

    @contextlib.contextmanager
    def server(self, side: Side, model: Path) -> Iterator[str]:
        """`grpokit serve-policy MODEL` with `side`'s code on a free port, for as long as the block
        runs; its http://HOST:PORT."""
        where = self.work / f"server-{side.name}.where"
        args = ["serve-policy", str(model), "--port", "0", "device=cpu", f"num_threads={self.threads}"]
        command = [sys.executable, "-c", BOOT, str(side.src), str(where), *args]
        log = (self.work / f"server-{side.name}.log").open("w")
        env = child_env(side.src, self.threads)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert process.stdout is not None
            first = process.stdout.readline()  # "... at http://HOST:PORT/v1 ..." once it listens
            found = re.search(r"at (http://\S+)/v1 ", first)
            if found is None:
                raise RunFailed(f"serve-policy ({side.name}) did not start: {first.strip()} (log {log.name})")
            yield found.group(1)
        finally:
            process.kill()
            process.wait(timeout=30)
            log.close()

    def both(self, name: str, args: list[str]) -> tuple[Path, Path]:
        """The same command with the base's code, then with the current code."""
        base = self.run(self.base, name, args)
        self.base_runs[name] = base
        return base, self.run(self.current, name, args)

    def short(self) -> list[str]:
        return [
            f"max_steps={self.steps}",
            "num_eval_prompts=32",
            "eval_steps=10",
            "save_steps=10",
            "log_completions_steps=10",
        ]

    def main_args(self) -> list[str]:
        return ["train", "addition", *self.short(), "sft_steps=40"]

    def teacher(self) -> Path:
        """The base side's main run's final checkpoint (run here when main was not compared)."""
        if "main" not in self.base_runs:
            self.base_runs["main"] = self.run(self.base, "main", self.main_args())
        return final_checkpoint(self.base_runs["main"])

    def tool_start(self) -> Path:
        """tool_addition's policy after the preset's warm start and 1 GRPO step, made once by the base
        code and cached (about a minute): GRPO from the untrained policy earns no reward at all."""
        args = ["train", "tool_addition", "max_steps=1", "sft_steps=150", "num_eval_prompts=8"]
        args += ["eval_steps=0", "save_steps=0", "prompts_per_step=8", "micro_batch_size=64"]
        out = self.cache / "tool_warm_start"
        stamp = out.parent / "tool_warm_start.json"
        made = {"args": args, "threads": self.threads}
        if not (stamp.is_file() and json.loads(stamp.read_text()) == made):
            shutil.rmtree(out, ignore_errors=True)
            print(f"    making the tool warm start (cached in {out})")
            self.run_into(self.base, out, args)
            stamp.write_text(json.dumps(made))
        return final_checkpoint(out)


# ---------------------------------------------------------------------------------------------------
# the paths: each returns [(what, base run, current run)] to compare


def path_main(h: Harness) -> list[tuple[str, Path, Path]]:
    return [("", *h.both("main", h.main_args()))]


def path_tool_addition(h: Harness) -> list[tuple[str, Path, Path]]:
    start = h.tool_start()
    args = ["train", "tool_addition", *h.short(), f"model={start}", "sft_steps=0"]
    args += ["prompts_per_step=8", "micro_batch_size=32"]  # 64 rows: 2 micro-batches accumulate
    return [("", *h.both("tool_addition", args))]


def path_rlhf_addition(h: Harness) -> list[tuple[str, Path, Path]]:
    reward = ["reward", "reward_addition_rlhf", f"max_steps={REWARD_MODEL_STEPS}", "batch_size=32"]
    reward += ["micro_batch_size=16", "num_eval_pairs=32", "eval_steps=5", "save_steps=5", "warmup_steps=2"]
    rm_base, rm_current = h.both("reward_model", reward)
    model = final_checkpoint(rm_base)
    args = ["train", "rlhf_addition", *h.short(), f"reward_funcs=[{{model: {model}}}]"]
    args += ["sft_steps=0", "prompts_per_step=16"]
    return [("reward model", rm_base, rm_current), ("", *h.both("rlhf_addition", args))]


def distillation(h: Harness, loss_type: str) -> list[tuple[str, Path, Path]]:
    args = ["train", "addition", *h.short(), f"loss_type={loss_type}", f"teacher_model={h.teacher()}"]
    args += ["sft_steps=0", "prompts_per_step=16"]
    return [("", *h.both(loss_type, args))]


def path_async(h: Harness, k: int) -> list[tuple[str, Path, Path]]:
    """`train addition max_staleness=k` from the main run's policy: the rollout worker samples and
    scores, the trainer trains the batch of each step with exactly version max(0, s − 1 − k)."""
    args = ["train", "addition", *h.short(), f"model={h.teacher()}", "sft_steps=0", "prompts_per_step=16"]
    return [("", *h.both(f"async_k{k}", [*args, f"max_staleness={k}"]))]


def path_server(h: Harness) -> list[tuple[str, Path, Path]]:
    """max_staleness=1 sampling on a `grpokit serve-policy` server of each side's own code."""
    model = h.teacher()
    args = ["train", "addition", *h.short(), f"model={model}", "sft_steps=0", "prompts_per_step=16"]
    runs = []
    for side in (h.base, h.current):
        with h.server(side, model) as url:
            runs.append(h.run(side, "server", [*args, "max_staleness=1", f"rollout_server_urls=[{url}]"]))
    return [("", *runs)]


RUNNERS = {
    "main": path_main,
    "tool_addition": path_tool_addition,
    "rlhf_addition": path_rlhf_addition,
    "opd": lambda h: distillation(h, "opd"),
    "gkd": lambda h: distillation(h, "gkd"),
    "async_k0": lambda h: path_async(h, 0),
    "async_k1": lambda h: path_async(h, 1),
    "async_k2": lambda h: path_async(h, 2),
    "server": path_server,
}


# ---------------------------------------------------------------------------------------------------
# the comparison


def final_checkpoint(run: Path) -> Path:
    found = [
        (int(m.group(1)), p)
        for p in run.glob("checkpoint-*")
        if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
    ]
    if not found:
        raise RunFailed(f"{run} holds no checkpoint-N directory")
    return max(found)[1]


def same(a: object, b: object) -> bool:
    """Exact equality; NaN equals NaN, and 0.0 is not -0.0 (bitwise, for floats)."""
    if isinstance(a, float) or isinstance(b, float):
        if (
            not isinstance(a, int | float)
            or not isinstance(b, int | float)
            or isinstance(a, bool)
            or isinstance(b, bool)
        ):
            return False
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return type(a) is type(b) and a == b


@dataclass
class Tally:
    """What was compared and found equal, and the first difference (None: none)."""

    steps: int = 0
    keys: dict[str, set[str]] = field(default_factory=dict)  # file -> keys compared
    rows: dict[str, int] = field(default_factory=dict)  # file -> rows compared
    values: int = 0
    tensors: int = 0
    difference: str | None = None

    def differ(self, what: str) -> None:
        if self.difference is None:
            self.difference = what


def read_rows(path: Path) -> list[dict] | None:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.is_file()
        else None
    )


def compare_rows(name: str, base: list[dict], current: list[dict], tally: Tally) -> None:
    keys = tally.keys.setdefault(name, set())
    tally.rows[name] = min(len(base), len(current))
    for row_b, row_c in zip(base, current, strict=False):
        at = row_b.get("step", row_b.get("sft_step", "?"))
        for key in [*row_b, *(k for k in row_c if k not in row_b)]:
            if excluded(key):
                continue
            keys.add(key)
            tally.values += 1
            absent = "(absent)"
            vb, vc = row_b.get(key, absent), row_c.get(key, absent)
            if not same(vb, vc):
                tally.differ(f"{name} step {at}, {key!r}: base {vb!r} != current {vc!r}")
                return
    if len(base) != len(current):
        tally.differ(f"{name}: {len(base)} rows (base) != {len(current)} rows (current)")


def compare_metrics(base: Path, current: Path, tally: Tally) -> None:
    for name in METRIC_FILES:
        rows_b, rows_c = read_rows(base / name), read_rows(current / name)
        if rows_b is None and rows_c is None:
            continue
        if rows_b is None or rows_c is None:
            tally.differ(f"{name}: written by the {'current' if rows_b is None else 'base'} run only")
            return
        compare_rows(name, rows_b, rows_c, tally)
        if tally.difference:
            return
    steps = {r["step"] for r in read_rows(base / "metrics.jsonl") or [] if isinstance(r.get("step"), int)}
    tally.steps = max(steps, default=0)


def compare_tensors(base: Path, current: Path, tally: Tally) -> None:
    import torch
    from safetensors.torch import load_file

    ckpt_b, ckpt_c = final_checkpoint(base), final_checkpoint(current)
    if ckpt_b.name != ckpt_c.name:
        tally.differ(f"final checkpoint: base {ckpt_b.name} != current {ckpt_c.name}")
        return
    files = sorted(p.name for p in ckpt_b.glob("*.safetensors"))
    if files != sorted(p.name for p in ckpt_c.glob("*.safetensors")) or not files:
        tally.differ(f"{ckpt_b.name}: safetensors files differ or are missing ({files})")
        return
    for name in files:
        wb, wc = load_file(ckpt_b / name), load_file(ckpt_c / name)
        if sorted(wb) != sorted(wc):
            tally.differ(f"{ckpt_b.name}/{name}: tensor names differ ({sorted(set(wb) ^ set(wc))[:5]})")
            return
        for key in sorted(wb):
            a, b = wb[key], wc[key]
            if a.dtype != b.dtype or a.shape != b.shape:
                shapes = f"base {a.dtype} {tuple(a.shape)} != current {b.dtype} {tuple(b.shape)}"
                tally.differ(f"{ckpt_b.name} {key}: {shapes}")
                return
            if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
                gap = (a.double() - b.double()).abs()
                tally.differ(
                    f"{ckpt_b.name} {key}: {int((gap != 0).sum())} of {a.numel()} elements differ "
                    f"(max |difference| {gap.nan_to_num(nan=math.inf).max().item():.3g})"
                )
                return
            tally.tensors += 1


def compare(base: Path, current: Path) -> Tally:
    tally = Tally()
    compare_metrics(base, current, tally)
    if tally.difference is None:
        compare_tensors(base, current, tally)
    return tally


def summary(tally: Tally) -> str:
    metrics = len(tally.keys.get("metrics.jsonl", ()))
    files = ", ".join(f"{name} {tally.rows[name]} rows/{len(keys)} keys" for name, keys in tally.keys.items())
    return (
        f"{tally.steps} steps, {metrics} metrics equal ({tally.values} values: {files}), "
        f"{tally.tensors} tensors equal"
    )


# ---------------------------------------------------------------------------------------------------


def check_path(h: Harness, path: str) -> bool:
    """Run and compare one path; print its line. True when everything is equal."""
    print(f"{path}:", flush=True)
    began = time.perf_counter()
    try:
        pairs = RUNNERS[path](h)
        tallies = [(what, compare(b, c)) for what, b, c in pairs]
    except RunFailed as error:
        print(f"{path}: FAILED: {error}", flush=True)
        return False
    parts, ok = [], True
    for what, tally in tallies:
        prefix = f"{what}: " if what else ""
        if tally.difference:
            ok = False
            parts.append(f"{prefix}DIFFERS at {tally.difference}")
        else:
            parts.append(f"{prefix}{summary(tally)}")
    print(f"{path}: {'; '.join(reversed(parts))}  [{time.perf_counter() - began:.0f} s]", flush=True)
    return ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=BASE, help=f"the revision to compare with (default {BASE})")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps of every run (default 20)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--current", help="compare with this revision's code instead of the working tree")
    parser.add_argument("--threads", type=int, default=1, help="num_threads of every run (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories even when all is equal")
    args = parser.parse_args()
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        parser.error(f"--paths: unknown {unknown}; the paths are {', '.join(PATHS)}")
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads take a positive number")
    return args


def main() -> int:
    args = parse_args()
    began = time.perf_counter()
    base_tree = worktree(args.base)
    base = Side(
        "base", base_tree / "src", f"{args.base} ({git('rev-parse', '--short=12', 'HEAD', cwd=base_tree)})"
    )
    if args.current:
        current_tree = worktree(args.current)
        sha = git("rev-parse", "--short=12", "HEAD", cwd=current_tree)
        current = Side("current", current_tree / "src", f"{args.current} ({sha})")
    else:
        changed = len(git("status", "--porcelain", "--untracked-files=no", "--", "src").splitlines())
        current = Side(
            "current",
            REPO / "src",
            f"the working tree of {REPO} ({changed} files of src/ changed since HEAD)",
        )
    work = Path(tempfile.mkdtemp(prefix="grpokit-same-numbers-"))
    cache = (
        Path(tempfile.gettempdir())
        / f"grpokit-same-numbers-cache-{base_tree.name.removeprefix('grpokit-base-')}"
    )
    cache.mkdir(exist_ok=True)
    print(f"base:    {base.label}: {base.src}")
    print(f"current: {current.label}: {current.src}")
    measured = [*EXCLUDED_KEYS, *(p + "*" for p in EXCLUDED_PREFIXES)]
    print(f"excluded (they measure the machine): {', '.join(measured)}")
    print(f"excluded (prose): alerts.jsonl {', '.join(EXCLUDED_TEXT)}")
    print(f"runs in {work}; {args.steps} steps, num_threads={args.threads}", flush=True)
    h = Harness(base, current, work, cache, args.steps, args.threads)
    results = [check_path(h, path) for path in args.paths]
    ok = all(results)
    seconds = time.perf_counter() - began
    verdict = "all equal" if ok else "DIFFERENT"
    print(
        f"{verdict}: {sum(results)} of {len(results)} paths equal in {seconds:.0f} s "
        f"(the runs used {h.cpu_seconds:.0f} s of CPU)"
    )
    if ok and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"run directories kept in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
