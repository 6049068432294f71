"""Asynchronous GRPO, the trainer's side: the `BatchSource` (trainee.py) whose batches rollout
workers sample and score while the trainer updates, with an exact staleness (`max_staleness`). The
worker processes are train/rollout_worker.py.

Version v of the weights is the policy after v optimizer steps; a synchronous step s samples with
version s − 1. With max_staleness = k the worker samples step s's batch with version
`sampling_version(s, k, every)` = max(0, s − 1 − k) (rounded down to the versions published, one every
`weight_sync_steps`) and no other; the trainer trains step s on that batch. Nothing is dropped and no
batch is trained twice, so an asynchronous run is as reproducible as a synchronous one, and k = 0 is
the synchronous run itself, bitwise, with the sampling moved to another process.

Weights go to the workers as files: the trainer writes version v to
`output_dir/.rollout/weights-v<v>.safetensors` under a temporary name and renames it (atomic), then
says so. Files, not shared memory: a reader can never see half an update, a dead trainer leaves
nothing half-written, and a rollout server's `/update_weights {"path"}` takes the same form. On a
CPU the tiny models' files cost milliseconds; on a GPU a shared-memory or NCCL transport would avoid
the copy through host memory.

With `rollout_workers` = n, step s is worker s mod n's, sampled exactly as the one worker would
(version, prompts, seeds: the same numbers); under torchrun each rank has workers of its own for its
share of every batch, rank 0 writes each version, and a checkpoint holds every rank's batches in
flight (docs/async.md; what cannot be taken: config/async_rules.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import safetensors.torch
import torch

from ..config.async_rules import AsyncFacts, async_refusal
from ..config.plan import RolloutSpec, StepSpec
from ..config.specs import EngineSpec
from . import distributed
from .checkpoint import as_os_error, list_checkpoints, rng_state
from .checkpoint_state import shown
from .distributed import Dist
from .in_flight import InFlightBounds, Sampled, from_plain, in_flight_problem, sampling_version, to_plain
from .inputs import RunData
from .rollout_worker import RolloutError, RolloutWorker, WorkerSetup, weights_path
from .threads import ThreadGovernor
from .trainee import BatchSource, DrawnBatch, RewardFuncs, StopCheck, Trainee

WEIGHTS_DIR = ".rollout"

WEIGHT_FILE = re.compile(r"weights-v\d+\.(safetensors|tmp)|setup-rank\d+-worker\d+\.(pt|tmp)")


def _picklable(item: object) -> bool:
    """Whether the worker process can receive `item` (one defined in __main__ it cannot import)."""
    if getattr(item, "__module__", None) == "__main__":
        return False
    try:
        pickle.dumps(item)
    except Exception:  # noqa: BLE001 - pickling fails in many ways
        return False
    return True


def refuse_unpicklable(what: str, items: Sequence[tuple[str, object]]) -> None:
    """Each item goes to the worker process by pickling: a lambda, a closure or a function defined in
    `__main__` of another program cannot. One ValueError naming the first one and the fix."""
    for name, item in items:
        defined_in = getattr(item, "__module__", None) or type(item).__module__
        if defined_in == "__main__":
            raise ValueError(
                f"{what} {name!r} is defined in the script being run (__main__), which the rollout worker "
                "does not import (max_staleness is set: sampling and scoring run in another process): "
                "move it to a module of its own and import it from there (or give its dotted path, "
                "'package.module:function')"
            )
        try:
            pickle.dumps(item)
        except Exception as error:  # noqa: BLE001 - pickling fails in many ways; each is the same refusal
            raise ValueError(
                f"{what} {name!r} cannot be sent to the rollout worker (max_staleness is set: sampling "
                f"and scoring run in another process): {type(error).__name__}: {error}. Define it as a "
                "module-level function in an importable file (or give its dotted path, "
                "'package.module:function'), or wrap one with functools.partial, instead of a lambda or "
                "a closure."
            ) from None


def publish_weights(
    module: torch.nn.Module, directory: Path, version: int, d: distributed.Dist | None = None
) -> float:
    """Write version `version` of `module`'s weights where the workers read them, atomically;
    -> seconds taken. Under torchrun (`d`, a distributed.Dist): every rank calls it, the weights are
    gathered (a collective under FSDP), rank 0 writes them, and every rank returns once they are
    written."""
    began = time.perf_counter()
    final = weights_path(directory, version)
    staging = final.with_suffix(".tmp")
    if d is None or not d.enabled:
        with _writing(staging, final):
            safetensors.torch.save_model(module, str(staging))  # (save_model keeps tied weights tied)
        return time.perf_counter() - began
    weights = distributed.full_state_dict(d, module)  # (rank 0's; empty elsewhere under FSDP)
    if d.is_main:
        seen: set[int] = set()  # tied weights once (the first name), as save_model writes them
        unique = {}
        for name, tensor in weights.items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                unique[name] = tensor.contiguous()
        with _writing(staging, final):
            safetensors.torch.save_file(unique, str(staging))
    distributed.barrier(d)
    return time.perf_counter() - began


@contextlib.contextmanager
def _writing(staging: Path, final: Path) -> Iterator[None]:
    """The weights written to `staging`, then renamed to `final` (atomic: a reader never sees half a
    version). A failed write leaves no staging file and is an OSError naming `final` (safetensors says
    a full disk as a SafetensorError, "os error 28"), which the command line says in one line with the
    free space."""
    try:
        yield
        os.replace(staging, final)
    except Exception as error:
        staging.unlink(missing_ok=True)
        disk = as_os_error(error, final)
        if disk is None or disk is error:
            raise
        raise disk from error


def weights_dir(output_dir: Path, create: bool) -> Path:
    """`output_dir/.rollout`, where the trainer writes the versions the workers read: grpokit's own,
    with no one else's files in it. A symbolic link there (its target's files would be overwritten,
    then deleted), a file, or a directory holding anything but weight files (those a run killed with
    SIGKILL leaves) is refused in one line; `create`: made, for this user only."""
    directory = output_dir / WEIGHTS_DIR
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        kind = "a symbolic link" if directory.is_symlink() else "a file"
        raise ValueError(
            f"{directory} is {kind}; grpokit makes that directory itself for the weights it sends the "
            "rollout workers (and deletes what is in it): remove it or move it away"
        )
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    foreign = [name for name in held if not WEIGHT_FILE.fullmatch(name)]
    if foreign:
        raise ValueError(
            f"{directory} holds {foreign[0]!r}, which grpokit did not write (it keeps only the weights it "
            "sends the rollout workers there, and deletes them): move your files out of it"
        )
    if create:
        directory.mkdir(mode=0o700, exist_ok=True)
    return directory


class AsyncRollout(BatchSource):
    """The asynchronous rollout as a `BatchSource`: step s's batch, drawn as a synchronous step would
    have drawn it (with its async/* figures); the weights published after the steps that make a
    version; and in a checkpoint after step c, the batches in flight then (steps c+1 … c+k, sampled
    with versions before c), so that a resume trains exactly what the uninterrupted run trains.

    Opened before the run (a resume restores the batches in flight into it), its workers spawned early
    or with the loop (`start`), in process or on rollout servers alike."""

    def __init__(
        self, spec: RolloutSpec, output_dir: Path, d: distributed.Dist, data: RunData, engine: EngineSpec
    ) -> None:
        assert spec.max_staleness is not None
        self.spec, self.max_staleness, self.every = spec, spec.max_staleness, spec.weight_sync_steps
        self.output_dir, self.d, self.data, self.engine = output_dir, d, data, engine
        self.count = spec.workers  # rollout_workers: step s is sampled by workers[s % count]
        weights_dir(output_dir, create=d.is_main)  # (grpokit's own: checked, then made)
        self.workers: list[RolloutWorker] = []
        self.setup: WorkerSetup | None = None
        self.policy: torch.nn.Module | None = None  # the worker's copy of the policy (`prepare`)
        self.buffer: dict[int, Sampled] = {}  # batches taken from the workers (or a checkpoint), not trained
        self.publish_s = 0.0  # writing the version the last batch was sampled with
        self.saved_last: int | None = None  # the last step of the run a resumed checkpoint was saved in

    def spawn(self, preload: tuple[str, ...] = ()) -> None:
        """Start the worker processes now: their imports (`preload` too: module names) overlap the
        trainer's loading and warm start."""
        directory = self.output_dir / WEIGHTS_DIR
        for index in range(len(self.workers), self.count):
            name = "the rollout worker" if self.count == 1 else f"rollout worker {index + 1} of {self.count}"
            self.workers.append(RolloutWorker(directory, self.spec.timeout, preload, self.d, name))

    def prepare(self, policy: torch.nn.Module) -> None:
        """A CPU copy of the policy for the workers, taken before it is wrapped for training (FSDP2
        shards it in place); its values do not matter: a worker loads the version it needs first."""
        self.policy = cpu_copy(policy)

    def start(self, trainee: Trainee, steps: range, threads: ThreadGovernor | None) -> None:
        """The workers started after the batches already in hand, and the weights of now published: the
        version its first batch needs. A checkpoint at a step that is no multiple of weight_sync_steps
        would need an older one, which it does not hold: refused in one line. A run resumed past the
        end of the run that saved it (max_steps raised) has no batches in flight for its next steps,
        which no run sampled yet: they are sampled with the checkpoint's weights (less stale than k,
        said once and logged as async/staleness); then the rule holds again."""
        first, last = steps.start + len(self.buffer), steps.stop - 1
        setup = self._setup(trainee, first, last, threads)
        now = first - 1 - len(self.buffer)
        if first <= last and sampling_version(first, self.max_staleness, self.every) != now:
            if self.saved_last is None or first <= self.saved_last:
                raise ValueError(
                    f"resuming an asynchronous run at step {now}, which is no multiple of "
                    f"weight_sync_steps={self.every}, needs an older weight version than the checkpoint "
                    "holds: resume from a checkpoint at a multiple of weight_sync_steps"
                )
            fresher = [
                s for s in range(first, last + 1) if sampling_version(s, self.max_staleness, self.every) < now
            ]
            then = f"; from step {fresher[-1] + 1} on, exactly {self.max_staleness}"
            logging.getLogger("grpokit").warning(
                f"the run goes on past step {self.saved_last}, where it ended: steps {first}-{fresher[-1]}, "
                f"which no run sampled before, are sampled with the weights of step {now} (less than "
                f"max_staleness={self.max_staleness} versions old, as async/staleness shows)"
                + then
                * (fresher[-1] < last)
            )
            setup = replace(setup, oldest=now)
        self.spawn()
        self.setup = setup
        for index, worker in enumerate(self.workers):
            worker.begin(replace(setup, worker=index, workers=self.count))
        self.publish(trainee.engine.module, now)

    def _setup(self, trainee: Trainee, first: int, last: int, threads: ThreadGovernor | None) -> WorkerSetup:
        """The workers' side of the run: a CPU copy of the policy, the tokenizer, the prompt sampler
        after the batches in hand, the rewards and the environment (`check_rollout` has seen that they
        pickle), for steps first … last; and half the trainer's CPU threads, shared by the workers (at
        least one each): the trainer keeps the rest (`threads`, the run's ThreadGovernor, stops adapting
        to a load that is now its own workers')."""
        model, self.policy = self.policy, None  # (pickled into the setup: the trainer need not hold it)
        assert model is not None, "AsyncRollout.prepare comes before start"
        engine, spec = trainee.engine, self.spec
        count = torch.get_num_threads()
        worker_threads = max(1, count // 2)
        if threads is not None:
            threads.keep(max(1, count - worker_threads))
        else:
            torch.set_num_threads(max(1, count - worker_threads))
        prompts = copy.deepcopy(trainee.prompts)
        if not _picklable(prompts.is_correct):  # a lambda of yours: the worker's steps split no lengths
            prompts.is_correct = None
        if self.buffer:
            prompts.load_state_dict(self.buffer[max(self.buffer)].prompts_state)
        return WorkerSetup(
            model=model,
            tokenizer=engine.tokenizer,
            engine=self.engine,
            device=str(rollout_device(spec.device, engine.device, self.d)),
            environment=self.data.environment,
            prompts=prompts,
            reward_funcs=list(self.data.reward_funcs),
            params=trainee.params,
            max_staleness=self.max_staleness,
            every=self.every,
            first_step=first,
            last_step=last,
            weights_dir=str(self.output_dir / WEIGHTS_DIR),
            num_threads=max(1, worker_threads // self.count),
            parent_pid=os.getpid(),
            rank=self.d.rank,
            world_size=self.d.world_size,
            servers=spec.servers,
            request_timeout=spec.request_timeout,
        )

    def publish(self, module: torch.nn.Module, version: int) -> None:
        """Version `version` of the weights written once, and every worker told."""
        self.publish_s = publish_weights(module, self.output_dir / WEIGHTS_DIR, version, self.d)
        for worker in self.workers:
            worker.announce(version)

    def draw(self, step: int, trainee: Trainee, rewards: RewardFuncs, d: Dist, stop: StopCheck) -> DrawnBatch:
        """Step `step`'s batch from its worker, its metrics with the async/* figures. The trainee's
        prompt sampler is set to where the worker's stood after drawing it: a checkpoint after this step
        saves that cursor. (The workers score with their own copies of the reward functions.)"""
        began = time.perf_counter()
        item = self.buffer.pop(step) if step in self.buffer else self._take(step)
        waited = time.perf_counter() - began
        trainee.prompts.load_state_dict(item.prompts_state)
        metrics = {
            "async/staleness": float(step - 1 - item.version),
            "async/weight_version": float(item.version),
            "async/queue_wait_s": waited,  # the trainer waiting for this batch
            "async/worker_wait_s": item.worker_wait_s,  # the worker waiting for its weights
            "async/weight_sync_s": self.publish_s + item.weight_load_s,
            "async/worker": float(item.worker),  # which rollout worker sampled it
        }
        # on-policy as the sampler is the student; the trainer's own random state goes on untouched
        return DrawnBatch(item.batch, item.metrics | metrics, True, rng_state())

    def _take(self, step: int) -> Sampled:
        assert self.workers
        try:
            return self.workers[step % self.count].take(step)
        except RolloutError as error:
            saved = list_checkpoints(self.output_dir)
            where = (
                f"the last checkpoint is {saved[-1]} (resume=true continues from it)"
                if saved
                else "no checkpoint yet"
            )
            stopped = RolloutError(f"{error}; the run stopped before step {step}: {where}")
            for note in getattr(error, "__notes__", ()):  # the worker's traceback, for --debug
                stopped.add_note(note)
            raise stopped from None

    def after_step(self, step: int, module: torch.nn.Module) -> None:
        """Publish version `step` when it is one the workers sample with."""
        if step % self.every == 0 and self.workers:
            self.publish(module, step)

    def state_dict(self, step: int) -> dict[str, object]:
        """For checkpoint-<step> ("rollout"): the batches of steps step+1 … step+k (up to the last
        step), taken from the workers if not yet in hand: they were sampled with versions before
        `step`, which the checkpoint does not hold. About k batches of token ids, log-probs and rewards
        on disk; every rank's (a collective under torchrun: rank 0 writes the checkpoint)."""
        assert self.setup is not None
        last = min(step + self.max_staleness, self.setup.last_step)
        for ahead in range(step + 1, last + 1):
            if ahead not in self.buffer:
                self.buffer[ahead] = self._take(ahead)
        mine = [to_plain(self.buffer[s]) for s in range(step + 1, last + 1)]
        by_rank = distributed.gather_objects(self.d, mine)
        return {"rollout": {"in_flight_by_rank": by_rank, "last_step": self.setup.last_step}}

    def load_state_dict(self, state: dict[str, object], trainee: Trainee) -> str | None:
        """The batches in flight a checkpoint's `state` holds (tensors and plain values, read with
        weights_only), once they fit this run (`in_flight.in_flight_problem`); else the problem, in one
        phrase, and nothing is restored."""
        held = state.get("rollout")
        by_rank = held.get("in_flight_by_rank") if isinstance(held, dict) else None
        if not isinstance(by_rank, list):
            return f"rollout is {shown(held)}, not the batches in flight of an asynchronous run"
        assert isinstance(held, dict)
        if len(by_rank) != self.d.world_size:
            raise ValueError(
                f"this checkpoint of an asynchronous run holds the batches in flight of {len(by_rank)} "
                f"process(es), each its own share; resume it on {len(by_rank)}, not {self.d.world_size}"
            )
        problem = in_flight_problem(by_rank[self.d.rank], held.get("last_step"), self._bounds(trainee, state))
        if problem is not None:
            return problem
        self.buffer = {item.step: item for item in map(from_plain, by_rank[self.d.rank])}
        self.saved_last = held["last_step"]
        return None

    def _bounds(self, trainee: Trainee, state: dict[str, object]) -> InFlightBounds:
        """What this run expects of the batches in flight of the checkpoint `state` came from."""
        params, module = trainee.params, distributed.unwrap(trainee.engine.train_module)
        embedding = getattr(module, "get_input_embeddings", lambda: None)()
        vocab = getattr(embedding, "num_embeddings", None) or len(trainee.engine.tokenizer)
        return InFlightBounds(
            step=int(state["step"]),
            max_staleness=self.max_staleness,
            every=self.every,
            rows=params.prompts_per_rank * params.sampling.num_generations,
            vocab=vocab,
            prompts=len(trainee.prompts.rows),
        )

    def close(self) -> None:
        """Stop every worker, then remove the weight files (rank 0's to remove)."""
        for worker in self.workers:
            worker.close()
        if self.workers and self.d.is_main:
            shutil.rmtree(self.output_dir / WEIGHTS_DIR, ignore_errors=True)


def rollout_device(
    asked: str | None, trainer: torch.device, d: distributed.Dist | None = None
) -> torch.device:
    """Where the worker's copy of the policy lives: `asked` (rollout_device), or the trainer's device
    on a CPU, or on GPUs the first one no rank of this machine trains on (cuda:local_world_size +
    local_rank: each rank's worker its own) when the machine has it, else the trainer's own GPU."""
    if asked is not None:
        return torch.device(asked)
    if trainer.type != "cuda":
        return trainer
    local_rank = d.local_rank if d is not None else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size if d is not None else 1))
    spare = local_world + local_rank
    return torch.device("cuda", spare) if spare < torch.cuda.device_count() else trainer


def check_rollout(
    spec: RolloutSpec, data: RunData, world_size: int, step: StepSpec, output_dir: Path | None = None
) -> None:
    """With max_staleness, what the rollout workers cannot take, refused before any work in one line:
    what config/async_rules.py refuses, with what only the run knows (its processes, episodes from a
    task's tools or from Python); a rollout_device this machine does not have; a reward function or
    environment that cannot be pickled (a lambda, a closure); a weights directory in `output_dir` that
    is not grpokit's own (a link, or someone's files)."""
    if spec.max_staleness is None:
        return
    facts = AsyncFacts(
        loss_type=step.loss.loss_type,
        servers=bool(spec.servers),
        episodes=data.environment is not None,
        workers=spec.workers,
        dynamic_sampling=step.dynamic_sampling,
        curriculum=step.curriculum,
        world_size=world_size,
    )
    refusal = async_refusal(facts)
    if refusal is not None:
        raise ValueError(refusal)
    asked = spec.device
    if asked is not None and asked.startswith("cuda"):
        index = torch.device(asked).index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(
                f"rollout_device={asked}: this machine has {have} CUDA GPU(s); set rollout_device=cpu, "
                "or leave it unset (the trainer's device)"
            )
    refuse_unpicklable("reward function", [(_name(f), f) for f in data.reward_funcs])
    if data.environment is not None:
        refuse_unpicklable("environment", [(type(data.environment).__name__, data.environment)])
    if output_dir is not None:
        weights_dir(output_dir, create=False)


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on the CPU with storage of its own, made without a second copy on its device:
    each parameter and buffer is copied to the CPU first, and the module's structure around them."""
    memo: dict[int, object] = {}
    for tensor in model.parameters():
        memo[id(tensor)] = torch.nn.Parameter(tensor.detach().to("cpu", copy=True), tensor.requires_grad)
    for tensor in model.buffers():
        memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def _name(function: object) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)
