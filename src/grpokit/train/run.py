"""The scaffold every training loop runs in (GRPO, reward model), and the set-up they share.

A run, in order (all of it inside `with exclusive_output_dir(d, output_dir):`, rundir.py: the
run directory's lock, taken before anything looks at the directory and released when the run returns
or raises):

    replacing = claim_output_dir(...)          # before any work: refuse to mix with an earlier run
    ... load and validate the input, build the model ...
    checkpoint = latest_checkpoint(control, compare, d, on_event)   # resume=true: the newest intact one
    prepare_output_dir(d, control, replacing, resuming=checkpoint is not None)  # clear an earlier run, config
    run = Run.open(control, d, emit, stop, Starting(checkpoint, restore, evaluate))   # resume or evaluate
    step = run.start
    with run:                                  # the metrics writer is closed however the loop ends
        for step in range(run.start + 1, control.max_steps + 1):
            ... one update ...
            run.log(step, metrics)             # every logging_steps
            run.evaluate_if_due(step)          # every eval_steps, and at the last step
            if run.finish_step(step, skipped, save):   # checkpoint, skip guard, stop signal
                break
    return run.result(TrainResult, step)       # a RunResult

`control` is the run's `config.plan.RunControl`: its directory, length and cadence. Also here:
seeding, the policy and tokenizer a `ModelSpec` names, LoRA adapters, SIGINT/SIGTERM handling and
the guard against runs of non-finite updates.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..config.plan import LoraSpec, ModelSpec, RunControl
from ..models import build_policy, char_tokenizer, load_policy
from . import distributed
from .checkpoint import CHECKPOINT_PREFIX, newest_intact_checkpoint
from .events import Emit, EventKind
from .metrics import MetricsWriter, NullWriter, truncate_metrics_after, warn
from .run_files import check_run_files
from .rundir import clear_earlier_run, clear_staging

Result = TypeVar("Result", bound="RunResult")

# ----------------------------------------------------------------------------- set-up


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def policy_tokenizer(spec: ModelSpec, alphabet: str | None) -> Any:
    """The tokenizer `policy_and_tokenizer` would give, without the model (a hub id's or a directory's,
    or the tiny model's over the task's alphabet)."""
    if spec.name != "tiny":
        from ..models import load_tokenizer

        return load_tokenizer(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if alphabet is None:
        raise ValueError(
            "model='tiny' needs a built-in task or a dataset (their characters make the tokenizer)"
        )
    return char_tokenizer(alphabet)


def policy_and_tokenizer(spec: ModelSpec, alphabet: str | None, max_seq_len: int) -> tuple[Any, Any]:
    """Load the model (a hub id or a local directory), or build the tiny Llama over the task's alphabet;
    its weights in the master dtype (float32, or the compute dtype with master_weights=dtype)."""
    if spec.name != "tiny":
        loaded = load_policy(
            spec.name,
            revision=spec.revision,
            dtype=spec.stored,
            gradient_checkpointing=spec.gradient_checkpointing,
            trust_remote_code=spec.trust_remote_code,
        )
        return loaded.model, loaded.tokenizer
    if alphabet is None:
        raise ValueError(
            "model='tiny' needs a built-in task or a dataset (their characters make the tokenizer); "
            "set task, dataset or model."
        )
    tokenizer = char_tokenizer(alphabet)
    model = build_policy(
        **asdict(spec.tiny),  # its hidden_size, num_layers, num_heads and intermediate_size
        vocab_size=len(tokenizer),
        dropout=0.0,
        max_seq_len=max_seq_len,
        seed=spec.seed,
    ).to(getattr(torch, spec.stored))
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tokenizer


def check_known_characters(
    tokenizer: Any, model_name: str, parts: list[tuple[str, Any]], columns: list[str]
) -> None:
    """With a character tokenizer, every character of `columns` of every (source, rows) part must be
    in its vocabulary (else it would silently become <unk>): one DataError naming the first one."""
    from ..data import check_characters
    from ..models import char_vocabulary

    known = char_vocabulary(tokenizer)
    if known is None:
        return
    model = "model: tiny" if model_name == "tiny" else repr(str(model_name))
    for source, rows in parts:
        check_characters(rows, known, columns=columns, source=source, model=model)


def add_lora(model: Any, spec: LoraSpec) -> Any:
    """`model` with LoRA adapters as `spec` says (target_modules None: every linear projection except
    the LM head)."""
    from ..models import apply_lora

    return apply_lora(
        model,
        r=spec.r,
        alpha=spec.alpha,
        dropout=spec.dropout,
        target_modules=list(spec.target_modules) if spec.target_modules else "all-linear",
    )


# ----------------------------------------------------------------------------- signals and skipped updates


class TooManySkips(RuntimeError):
    """Training stopped: too many consecutive updates were skipped, for a non-finite loss or gradient,
    or rolled back because they made the weights non-finite."""


class StopSignals:
    """SIGINT / SIGTERM become a request that the loop honours once the current update is done
    (it then saves a checkpoint and stops), or at once while a reward function runs (the GRPO loop
    drops that step and saves the one before: `should_stop` reads `.signal`). A second Ctrl-C stops
    at once."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        import signal

        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def skip_guard(consecutive: int, skipped: bool, limit: int, step: int) -> int:
    """Count consecutive skipped updates; past `limit`, say why training cannot go on."""
    consecutive = consecutive + 1 if skipped else 0
    if consecutive >= limit:
        raise TooManySkips(
            f"{consecutive} consecutive updates had a non-finite loss or gradient norm, or made the "
            f"weights non-finite and were undone (the last at step {step}); "
            f"training stopped and checkpoint-{step} holds the last good weights. Lower learning_rate or "
            "max_grad_norm, check the reward functions for extreme values, or raise max_consecutive_skips."
        )
    return consecutive


@dataclass(frozen=True)
class Starting:
    """How a run begins: from `checkpoint` through `restore` (-> start step, eval before), or, when it
    is None, by evaluating the starting policy with `evaluate`."""

    checkpoint: Path | None
    restore: Callable[[Path], tuple[int, dict[str, float]]]
    evaluate: Callable[[], dict[str, float]]


def begin(d: Any, control: RunControl, starting: Starting, emit: Emit) -> tuple[int, dict[str, float], Any]:
    """Resume from the checkpoint (dropping metric rows written after it) or evaluate the starting
    policy; open the metrics writer (rank 0 only) with `control.report_to`. Returns (start step, eval
    before, writer)."""
    output_dir = Path(control.output_dir)
    if starting.checkpoint is not None:
        start, eval_before = starting.restore(starting.checkpoint)
        if d.is_main:  # restored: only now does the run directory change
            write_run_config(output_dir, control.config_yaml)
            truncate_metrics_after(output_dir, start)
        emit(EventKind.RESUMED, start, {"checkpoint": str(starting.checkpoint)})
    else:  # (a fresh start: `claim_output_dir` has refused any earlier metrics, or overwrite cleared them)
        start, eval_before = 0, starting.evaluate()
    writer = (
        MetricsWriter(
            output_dir,
            report_to=list(control.report_to),
            config=dict(control.config_values),
            start_step=start,
        )
        if d.is_main
        else NullWriter()
    )
    if start == 0:
        writer.write(0, eval_before, prefix="eval/")
    emit(EventKind.START, start, eval_before)
    return start, eval_before, writer


# ----------------------------------------------------------------------------- the run scaffold


def prepare_output_dir(d: Any, control: RunControl, replacing: bool, resuming: bool = False) -> None:
    """Once every rank has validated its input: delete the earlier run that `overwrite=true` replaces
    (`replacing`, from `claim_output_dir`), create `control.output_dir` and write its config.yaml. A
    resume (`resuming`) writes its config.yaml only once the checkpoint is restored (`begin`): a
    checkpoint refused on the way leaves the run directory as it was."""
    output_dir = Path(control.output_dir)
    distributed.barrier(d)  # every rank has checked the directory and its input before anything is deleted
    if d.is_main:
        if replacing:  # overwrite=true, and the input is valid: only now is the earlier run deleted
            clear_earlier_run(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        clear_staging(output_dir)  # killed runs' half-written checkpoints (under the lock: none is ours)
        if not resuming:
            write_run_config(output_dir, control.config_yaml)
    distributed.barrier(d)


def write_run_config(output_dir: Path, text: str) -> None:
    """output_dir/config.yaml, unless it already holds `text` (a resume's with no option changed)."""
    config = output_dir / "config.yaml"
    if not config.is_file() or config.read_bytes() != text.encode():
        config.write_text(text)


def latest_checkpoint(
    control: RunControl,
    compare: Callable[[Path], list[str]],
    d: Any = None,
    on_event: Emit | None = None,
) -> Path | None:
    """With `resume=true`, the newest intact checkpoint of `control.output_dir`, else None: the run
    starts fresh.

    Intact: its files match its manifest.json (`newest_intact_checkpoint`). Newer ones that do not (a
    truncated state.pt, a flipped byte) are skipped with one warning naming each and what is wrong;
    when none is intact, CheckpointError. A checkpoint written before grpokit wrote manifests is
    taken as it is. The chosen one's config.yaml is then validated, and a config error there stops
    the run (a ConfigError, no fallback: the manifest vouches for the file's bytes, so the error is an
    option this grpokit rejects, which older checkpoints of the run would share), and compared with
    the run's config by `compare(config.yaml)` (`config.resume.resume_changes`: options that cannot
    change are a ConfigError; each one that may and did is said once as a warning). Warnings go to
    `on_event` (else the `grpokit` logger), on rank 0 of `d` only."""
    if not control.resume:
        return None
    check_run_files(Path(control.output_dir))  # the metrics and alerts a resume rewrites: sound, or one line
    chosen, corrupt = newest_intact_checkpoint(Path(control.output_dir))
    if chosen is None:
        return None
    says = d is None or d.is_main  # one warning per run, not one per rank
    step = int(chosen.name[len(CHECKPOINT_PREFIX) :])
    if corrupt and says:
        skipped = "; ".join(corrupt)
        warn(on_event, step, f"damaged checkpoint skipped ({skipped}); resuming from {chosen.name}")
    notes = compare(chosen / "config.yaml")  # validates the checkpoint's config too
    for note in notes if says else []:
        warn(on_event, step, note)
    return chosen


def should_save(step: int, control: RunControl, stopping: bool, skips: int, skipped: bool) -> bool:
    """Whether step `step` ends with a checkpoint: the last step, every `save_steps`, a stop signal
    (on any rank), or a skipped update about to trip the skip guard (`skips` consecutive ones
    before it), so the checkpoint holds the last good weights."""
    return bool(
        step == control.max_steps
        or (control.save_steps and step % control.save_steps == 0)
        or stopping
        or (skipped and skips + 1 >= control.max_consecutive_skips)
    )


@dataclass(frozen=True)
class RunResult:
    """How a run ended (each trainer's result adds its own fields)."""

    output_dir: Path
    steps: int
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    stopped_by: str | None = None  # the signal that ended the run early, if any


@dataclass
class Run:
    """A started run, as the loop sees it: where it started (`start`, `eval_before`), its metrics
    `writer` (closed on leaving `with run:`), the stop request and the count of consecutive skipped
    updates. Its methods are the ends of a step every loop shares; the step itself is the loop's."""

    control: RunControl  # output_dir, max_steps, logging_steps, eval_steps, save_steps, max_consecutive_skips
    d: Any  # distributed.Dist
    emit: Emit  # on_event on rank 0, a no-op elsewhere
    stop: StopSignals
    evaluate: Callable[[], dict[str, float]]
    writer: Any  # MetricsWriter on rank 0, NullWriter elsewhere
    start: int  # the step the run starts after (0, or the checkpoint's)
    eval_before: dict[str, float]
    skips: int = 0  # consecutive skipped updates
    threads: Any = None  # threads.ThreadGovernor: CPU threads, fewer while other processes hold cores

    @classmethod
    def open(
        cls,
        control: RunControl,
        d: Any,
        emit: Emit,
        stop: StopSignals,
        starting: Starting,
        threads: Any = None,
    ) -> Run:
        """Resume from a checkpoint or evaluate the starting model, and open the metrics (`begin`)."""
        start, eval_before, writer = begin(d, control, starting, emit)
        return cls(control, d, emit, stop, starting.evaluate, writer, start, eval_before, threads=threads)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.writer.close()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's metrics, every `logging_steps` steps and at the last."""
        if step % self.control.logging_steps == 0 or step == self.control.max_steps:
            if self.threads is not None:
                metrics = metrics | {"cpu_threads": float(self.threads.current)}
            self.emit(EventKind.STEP, step, self.writer.write(step, metrics))

    def evaluate_if_due(self, step: int) -> dict[str, Any] | None:
        """Evaluate every `eval_steps` steps and at the last; returns the row written (eval/ keys), or
        None when no evaluation was due."""
        every = self.control.eval_steps
        if step == self.control.max_steps or (every and step % every == 0):
            row = self.writer.write(step, self.evaluate(), prefix="eval/")
            self.emit(EventKind.EVAL, step, row)
            return row
        return None

    def finish_step(self, step: int, skipped: bool, save: Callable[[int], None]) -> bool:
        """After the step's metrics and evaluation: `save(step)` where `should_save`, count a skipped
        update (TooManySkips once too many in a row) and, on a stop signal on any rank, say so.
        Returns whether the loop stops here."""
        stopping = distributed.any_rank(self.d, self.stop.signal is not None)  # SIGINT / SIGTERM, any rank
        if should_save(step, self.control, stopping, self.skips, skipped):
            save(step)
        self.skips = skip_guard(self.skips, skipped, self.control.max_consecutive_skips, step)
        self.follow_load(step)
        if stopping:
            self.emit(
                EventKind.STOPPED,
                step,
                {"signal": self.stop.signal or "a signal on another rank", "output_dir": self.output_dir},
            )
        return stopping

    def follow_load(self, step: int) -> None:
        """Let the CPU-thread governor take a load reading (once a window); say a change once."""
        note = self.threads.tick() if self.threads is not None else None
        if note:
            self.emit(EventKind.WARNING, step, {"message": note})

    def result(self, kind: type[Result], steps: int) -> Result:
        """The run's outcome after `steps` steps, as a `kind` (a RunResult)."""
        return kind(
            output_dir=Path(self.control.output_dir),
            steps=steps,
            eval_before=self.eval_before,
            eval_after=self.eval_after,
            stopped_by=self.stop.signal,
        )

    @property
    def output_dir(self) -> str:
        return str(Path(self.control.output_dir))

    @property
    def eval_after(self) -> dict[str, float]:
        """The last evaluation's metrics, without their "eval/" prefix ({} when there was none)."""
        last = self.writer.last_eval
        return {k[len("eval/") :]: v for k, v in last.items() if k.startswith("eval/")}
