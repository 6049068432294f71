"""`grpokit sft`: a supervised run of its own, as GRPO's (train/grpo.py) and the reward model's
(train/reward.py) are. Its steps are train/sft.py's; here is the run around them:

    with StopSignals() as stop, exclusive_output_dir(...):   # signals noted, output_dir held (rundir.py)
        replacing = claim_output_dir(...)         # an earlier run: refused (overwrite=true: replaced)
        ... resolve the data as training does, build the model, check its characters ...
        clear_earlier_run(...) if replacing       # only once the input is valid
        run_sft(..., SFTHooks(on_step=report, should_stop=signalled))
        stopped by a signal: checkpoint-<step>/ and config.yaml, then the `stopped` event
        else: final/ and config.yaml, then the held-out accuracy (greedy, through training's engine)

SIGINT / SIGTERM finish the current step, save the model trained so far as checkpoint-<step> and say so
in one line (`progress.stop_message`), as GRPO does; a second Ctrl-C stops at once. Events go to
`on_event(kind, step, data)` (train/events.py): sft_start, sft_step, warning (a change of CPU threads)
and stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config.plan import DataSpec, EngineSpec, EpisodeSpec, Evaluation, RewardSpec, SFTPlan
from ..data import demonstration, require_answers, sft_rows, solution_column
from ..models import Precision, enable_fast_matmul, resolve_device, save_policy
from .distributed import Dist
from .events import Emit, EventKind
from .inputs import RunData, held_out_metrics, probe_engine, resolve_data
from .run import RunResult, StopSignals, check_known_characters, policy_and_tokenizer, seed_everything
from .rundir import (
    CHECKPOINT_PREFIX,
    checkpoint_staging,
    claim_output_dir,
    clear_earlier_run,
    clear_staging,
    exclusive_output_dir,
)
from .sft import SFTHooks, run_sft
from .threads import ThreadGovernor

FINAL = "final"  # the model of a run that ran all its steps


@dataclass(frozen=True)
class SFTRunResult(RunResult):
    """What `train_sft` returns. `saved`: the model's directory (output_dir/final, or checkpoint-<step>
    when a signal stopped the run); `eval_after`: the held-out accuracy ({} without held-out rows, or
    when stopped)."""

    saved: Path | None = None


def train_sft(
    plan: SFTPlan, *, on_event: Callable[[str, int, dict[str, Any]], None] | None = None
) -> SFTRunResult:
    """Supervised training as `plan` says (`config.plan.sft_plan`): cross-entropy on the answers of the
    task or of the dataset's rows. The run holds `plan.output_dir` exclusively until it returns or raises
    (rundir.py), and refuses an earlier run there unless `plan.overwrite`, which replaces it once the
    input is valid. SIGINT / SIGTERM finish the current step, save the model so far and stop
    (`SFTRunResult.stopped_by`)."""
    emit: Emit = on_event or (lambda kind, step, data: None)
    output_dir = Path(plan.output_dir)
    with StopSignals() as stop, exclusive_output_dir(Dist(), output_dir):
        replacing = claim_output_dir(output_dir, resume=None, overwrite=plan.overwrite)
        return _train_sft(plan, replacing, emit, stop)


def sft_data(plan: SFTPlan) -> tuple[RunData, int]:
    """The rows `plan` trains and evaluates on, resolved as training resolves them (exact-answer
    check, alphabet), and the longest prompt plus answer in characters. The user's own rows set the
    lengths themselves (a task's are its own)."""
    spec = plan.data
    if not spec.task and spec.dataset is None:
        raise ValueError("nothing to train on: set task, or dataset to a file of prompt/answer rows.")
    data = resolve_data(spec, EpisodeSpec(), RewardSpec(device=plan.placement.device), require_rewards=False)
    if spec.task:
        return data, (data.max_prompt_length or 0) + data.max_completion_length
    if data.eval_rows:
        require_answers(
            data.eval_rows,
            spec.answer_column,
            source=data.eval_source,
            purpose="the held-out accuracy",
            otherwise="unset eval_dataset",
        )
    rows = [*data.train_rows, *data.eval_rows]
    pairs = [
        (str(r[spec.prompt_column]), demonstration(r, spec.answer_column, spec.answer_format)) for r in rows
    ]
    longest = max(len(a) for _, a in pairs) + 1
    data = replace(data, max_prompt_length=None, max_completion_length=longest)
    return data, max(len(p) for p, _ in pairs) + longest


def _train_sft(plan: SFTPlan, replacing: bool, emit: Emit, stop: StopSignals) -> SFTRunResult:
    """`train_sft` in the output_dir it holds; `replacing`: an earlier run there that overwrite=true
    deletes once the input is valid."""
    output_dir = Path(plan.output_dir)
    data, lengths = sft_data(plan)
    seed_everything(plan.schedule.seed)
    device = resolve_device(plan.placement.device)
    enable_fast_matmul(device)  # TF32 matmuls on a GPU
    precision = Precision.of(plan.model.dtype, plan.model.master_weights)
    with ThreadGovernor.start(plan.placement.num_threads, device) as threads:  # fewer while others hold cores
        model, tokenizer = policy_and_tokenizer(plan.model, data.alphabet, 4 * lengths)
        model = model.to(device=device, dtype=precision.master)
        rows = _checked_rows(plan.data, plan.model.name, data, tokenizer)
        if stop.signal is not None:  # Ctrl-C while loading: nothing written, nothing deleted
            emit(
                EventKind.STOPPED,
                0,
                {"signal": stop.signal, "phase": "sft set-up", "output_dir": str(output_dir)},
            )
            return SFTRunResult(output_dir, 0, {}, {}, stopped_by=stop.signal)
        if replacing:  # the input is valid: only now is the earlier run deleted
            clear_earlier_run(output_dir)
        clear_staging(output_dir)  # a killed run's half-written model (under the lock: none is ours)

        def on_step(step: int, loss: float) -> None:
            emit(EventKind.SFT_STEP, step, {"loss": loss})
            note = threads.tick()
            if note:
                emit(EventKind.WARNING, step, {"message": note})

        emit(EventKind.SFT_START, 0, {})
        hooks = SFTHooks(on_step=on_step, should_stop=lambda: stop.signal is not None)
        trained = run_sft(model, tokenizer, rows, plan.schedule, hooks, precision=precision)
    steps = len(trained.losses)
    if trained.stopped:  # the model so far, where a checkpoint goes, and the one line saying so
        saved = _save(model, tokenizer, plan, f"{CHECKPOINT_PREFIX}{steps}")
        emit(EventKind.STOPPED, steps, {"signal": stop.signal, "phase": "sft", "output_dir": str(output_dir)})
        return SFTRunResult(output_dir, steps, {}, {}, stopped_by=stop.signal, saved=saved)
    saved = _save(model, tokenizer, plan, FINAL)
    if not data.eval_rows:
        return SFTRunResult(output_dir, steps, {}, {}, saved=saved)
    # greedy, through an engine as training's (SFTConfig has no decode options: their defaults)
    engine = probe_engine(EngineSpec(), model, tokenizer, data, device)
    metrics = held_out_metrics(engine, data, Evaluation(prompt_column=plan.data.prompt_column))
    return SFTRunResult(output_dir, steps, {}, metrics, saved=saved)


def _checked_rows(spec: DataSpec, model_name: str, data: RunData, tokenizer: Any) -> list[dict[str, Any]]:
    """The training rows encoded for `run_sft`, once a character tokenizer is known to hold every
    character they and the held-out prompts use (else one DataError naming the first one)."""
    columns = [spec.prompt_column, spec.answer_column, solution_column(spec.answer_column)]  # what it encodes
    check_known_characters(tokenizer, model_name, [(data.train_source, data.train_rows)], columns)
    check_known_characters(tokenizer, model_name, [(data.eval_source, data.eval_rows)], [spec.prompt_column])
    return sft_rows(
        data.train_rows, tokenizer, spec.prompt_column, spec.answer_column, answer_format=spec.answer_format
    )


def _save(model: Any, tokenizer: Any, plan: SFTPlan, name: str) -> Path:
    """The model and tokenizer as output_dir/`name` (written aside, then renamed into place: a run
    stopped mid-write leaves no half-written model there), and the run's config.yaml."""
    output_dir = Path(plan.output_dir)
    staging = checkpoint_staging(output_dir, 0)
    save_policy(model, tokenizer, staging)
    staging.rename(output_dir / name)
    (output_dir / "config.yaml").write_text(plan.config_yaml)
    return output_dir / name
