"""The rollout worker process of asynchronous GRPO (train/async_rollout.py is the trainer's side), and
the trainer's handle on one (`RolloutWorker`).

The worker holds its own copy of the policy (the same engine, backend and decode loop), or a client of
rollout servers (engine/remote.py), the prompt sampler (the data cursor and curriculum) and the reward
functions; it samples and scores each of its steps with exactly the weight version the trainer says,
and hands finished batches to the trainer through a pipe, as tensors and plain values (in_flight.py:
read with weights_only=True, the form a checkpoint holds them in). The setup (`WorkerSetup`: the
policy, tokenizer and reward functions, a pickle) goes the other way through the worker's own pipe,
from the live trainer, never through a file. Weights arrive as files the trainer wrote
(`async_rollout.publish_weights`), loaded with `Sampler.update_weights` (engine/weights.py checks
each file whole), in process or on every server alike.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config.specs import EngineSpec
from ..data import PromptSampler
from ..engine import PolicyEngine, Sampler
from ..engine.remote import RemotePolicy
from ..envs import EnvironmentSpec
from ..rewards.loading import load_files, loaded_files
from ..rollout import Rollout
from . import distributed
from .draw import StepPrompts, generate_and_score, sample_rollout, scored_batch
from .in_flight import Sampled, dumps, from_plain, loads, sampling_version, to_plain
from .trainee import StepParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = tuple[list[str], bytes] | int  # the trainer's to a worker: its setup (once, first), then versions

POLL_S = 0.5  # how often a waiting side looks whether the other is still alive

STARTUP_S = 300.0  # the longest a worker may take to start (import, copy of the policy) when the

READY = "ready"

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class RolloutError(RuntimeError):
    """The rollout worker failed, died, or stopped answering: the run cannot go on (one line)."""


@dataclass(frozen=True)
class WorkerSetup:
    """What the worker builds its side from (pickled once, at start)."""

    model: torch.nn.Module  # a copy of the policy on the CPU, with storage of its own
    tokenizer: PreTrainedTokenizerBase
    engine: EngineSpec
    device: str
    environment: EnvironmentSpec | None
    prompts: PromptSampler  # where the first batch the worker samples starts
    reward_funcs: list[Callable[..., object]]
    params: StepParams
    max_staleness: int
    every: int  # weight_sync_steps
    first_step: int  # the first step it samples
    last_step: int
    weights_dir: str
    num_threads: int
    parent_pid: int
    rank: int = 0  # under torchrun: the trainer's rank, whose share of each batch the worker samples
    world_size: int = 1
    worker: int = 0  # this worker's index: it samples the steps s with s mod workers = worker
    workers: int = 1  # rollout_workers
    oldest: int = 0  # no batch is sampled with a version before this one (a run resumed past its end)
    servers: tuple[str, ...] = ()  # rollout_server_urls: sampled there (engine/remote.py), not here
    request_timeout: float = 600.0


@dataclass(frozen=True)
class WorkerFailed:
    step: int
    message: str  # one line
    details: str  # the traceback, for --debug


def _pack(message: Sampled | WorkerFailed | str) -> bytes:
    """A message of the worker to the trainer as bytes of tensors and plain values (in_flight.dumps:
    tensors by value, since torch's own pickling for multiprocessing shares their memory through the
    sending process, which fails once that process has ended or moved the storage on)."""
    if isinstance(message, Sampled):
        return dumps({"kind": "batch"} | to_plain(message))
    if isinstance(message, WorkerFailed):
        return dumps(
            {"kind": "failed", "step": message.step, "text": message.message, "details": message.details}
        )
    return dumps({"kind": message})


def _unpack(data: bytes) -> Sampled | WorkerFailed | str:
    """What `_pack` made (read as tensors and plain values only: torch.load with weights_only=True)."""
    message = loads(data)
    kind = message.pop("kind")
    if kind == "batch":
        return from_plain(message)
    if kind == "failed":
        return WorkerFailed(message["step"], message["text"], message["details"])
    return str(kind)


def weights_path(directory: Path | str, version: int) -> Path:
    return Path(directory) / f"weights-v{version}.safetensors"


def _receive(inbox: Connection, parent_pid: int) -> Message | None:
    """The trainer's next message (the setup first, then version numbers; None: stop); None too
    when the trainer is gone (its end of the pipe closed, or it no longer is this process's parent).
    A trainer killed while writing one (the setup is large) closes the pipe mid-message: end of file,
    so None, never half a message."""
    while True:
        try:
            if inbox.poll(POLL_S):
                return inbox.recv()
        except (EOFError, OSError):
            return None
        if os.getppid() != parent_pid:  # the trainer died (kill -9): nobody will read what follows
            return None


def _wait_for_version(inbox: Connection, newest: int, version: int, parent_pid: int) -> int | None:
    """Block until the trainer says version ≥ `version` is published; None: told to stop, or the
    trainer is gone."""
    while newest < version:
        message = _receive(inbox, parent_pid)
        if message is None:
            return None
        assert isinstance(message, int), "the setup comes once, first"
        newest = max(newest, message)
    return newest


class _Outbox:
    """The worker's end of the pipe to the trainer, shared by its sampling loop and its scoring thread
    (one message at a time). A trainer that is gone makes a send raise (BrokenPipeError), which ends
    the worker instead of leaving it blocked."""

    def __init__(self, connection: Connection) -> None:
        self.connection, self.lock = connection, threading.Lock()

    def put(self, value: Sampled | WorkerFailed | str) -> None:
        data = _pack(value)
        with self.lock:
            self.connection.send_bytes(data)


def _failure(step: int, error: BaseException) -> WorkerFailed:
    line = (str(error).strip().splitlines() or [""])[0]
    return WorkerFailed(step, f"{type(error).__name__}: {line}", traceback.format_exc())


def work(inbox: Connection, connection: Connection, parent_pid: int, preload: tuple[str, ...]) -> None:
    """The worker process: started early on an accelerator (its imports take seconds, spent while the
    trainer loads and warm-starts the policy: torch, grpokit, and `preload`, the modules of the
    policy's and tokenizer's classes, such as transformers, which unpickling them would import), it
    waits for its setup, then for each step waits for its weight version, loads it, samples and
    scores. Where nothing about the next draw waits for a batch's rewards (no dynamic sampling, no
    curriculum), a batch is scored on a thread of its own while the next one is sampled (`_Scorer`): a
    slow reward (a sandbox, a judge) hides behind generation. `inbox` and `connection`: this process's
    ends of its two pipes (the trainer holds the others, so either side sees the other's death)."""
    # Ctrl-C reaches the whole process group: the trainer finishes its step, saves and stops the worker
    # (which started with both ignored, `_signals_held`, and keeps them so)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_the_trainer(parent_pid)
    for name in preload:  # (one that fails to import fails again, said, when the setup is unpickled)
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    outbox, at = _Outbox(connection), _At()  # (step 0 until the first: what failed was the start)
    try:
        message = _receive(inbox, parent_pid)
        if message is None:
            return
        setup, engine = _set_up(*message)
        at.step = setup.first_step
        _sample_steps(setup, engine, inbox, outbox, at)
    except BaseException as error:  # noqa: BLE001 - whatever ends the worker is told to the trainer
        with contextlib.suppress(OSError):  # (unless the trainer is gone)
            outbox.put(_failure(at.step, error))


def _end_with_the_trainer(parent_pid: int) -> None:
    """A thread that ends this process once the trainer is gone (killed with SIGKILL, say), whatever
    the worker is doing: a reward that hangs would otherwise keep it alive (the sampling loop only
    looks at the trainer between steps)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os._exit(1)  # (nobody is left to read what it would send)

    threading.Thread(target=watch, name="trainer-watch", daemon=True).start()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while a worker process starts, so that it starts ignoring them (an
    exec keeps an ignored signal ignored, and Python then installs no KeyboardInterrupt): a Ctrl-C
    while its interpreter imports is no traceback there. Here they are blocked meanwhile too, so that
    one arriving in that moment stays pending (Linux never discards a blocked signal) and reaches the
    trainer's own handler as the block ends."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread sets handlers)
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    handlers = {number: signal.signal(number, signal.SIG_IGN) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@dataclass
class _At:
    """The step the worker's sampling loop is at (its failure names it)."""

    step: int = 0


def _set_up(files: list[str], packed: bytes) -> tuple[WorkerSetup, Sampler]:
    """The setup the trainer sent through the pipe (`RolloutWorker.begin`), once the reward files it
    loaded (`python: file.py:f`) are loaded here the same way, so that the functions in them unpickle;
    and the engine over the worker's copy of the policy, in training mode as the trainer's engine is
    when it samples."""
    load_files(files)  # (a reward file that raises here is said as any other failure)
    setup = _setup_from_trainer(packed)
    torch.set_num_threads(setup.num_threads)
    if setup.servers:  # sampled on the rollout servers: no policy here
        return setup, RemotePolicy(setup.servers, setup.tokenizer, setup.request_timeout)
    device = torch.device(setup.device)
    engine = PolicyEngine.create(
        setup.model.to(device), setup.tokenizer, setup.engine, device=device, environment=setup.environment
    )
    engine.train_module.train()
    return setup, engine


def _setup_from_trainer(packed: bytes) -> WorkerSetup:
    """The WorkerSetup the live trainer pickled and sent through this worker's pipe (never a file's
    bytes): it holds the policy, the tokenizer and the reward functions, which only a pickle carries."""
    return pickle.loads(packed)  # noqa: S301 - from the trainer process of this run, through a pipe


def _sample_steps(setup: WorkerSetup, engine: Sampler, inbox: Connection, outbox: _Outbox, at: _At) -> None:
    """Each step's batch with exactly its weight version, sent in step order."""
    # this rank's share of each batch (no collectives here: `check_rollout` refused what needs them)
    d = distributed.Dist(rank=setup.rank, world_size=setup.world_size, device=engine.device)
    params, prompts = setup.params, setup.prompts
    scorer = None
    if not params.spec.dynamic_sampling and prompts.curriculum is None:
        scorer = _Scorer(outbox, setup, engine.tokenizer.pad_token_id)
    outbox.put(READY)
    newest, loaded = -1, -1
    for step in range(setup.first_step, setup.last_step + 1):
        at.step = step
        if step % setup.workers != setup.worker:  # another worker's step: its prompts, not sampled here
            prompts.next_batch()  # (one draw a step: `check_rollout` refused what draws more)
            continue
        version = max(sampling_version(step, setup.max_staleness, setup.every), setup.oldest)
        began = time.perf_counter()
        found = _wait_for_version(inbox, newest, version, setup.parent_pid)
        if found is None or (scorer is not None and scorer.failed):
            return
        newest, waited = found, time.perf_counter() - began
        began = time.perf_counter()
        if loaded != version:  # in process, or every server loads the file the trainer wrote
            engine.update_weights(str(weights_path(setup.weights_dir, version)), version)
            loaded = version
        waits = (waited, time.perf_counter() - began)
        if scorer is None:
            batch, metrics = generate_and_score(engine, prompts, setup.reward_funcs, params, step, d)
            outbox.put(Sampled(step, version, batch, metrics, prompts.state_dict(), *waits, setup.worker))
        else:
            drawn, rollout, took = sample_rollout(engine, prompts, params, step, d, 0)
            scorer.jobs.put(_ScoringJob(step, version, drawn, rollout, took, prompts.state_dict(), waits))
    if scorer is not None:
        scorer.finish(setup.parent_pid)


@dataclass(frozen=True)
class _ScoringJob:
    """A batch sampled by the worker, for its scoring thread."""

    step: int
    version: int
    drawn: StepPrompts
    rollout: Rollout
    took: float  # seconds sampling it
    prompts_state: dict[str, object]  # the prompt sampler after drawing it
    waits: tuple[float, float]  # the worker waiting for its weights, and loading them


class _Scorer:
    """The worker's scoring thread: the sampled batches scored in step order, one at a time (a reward
    function is never called twice at once), each sent to the trainer once scored. A reward that
    raises is sent as the worker's failure, and the sampling loop stops at its next step."""

    def __init__(self, outbox: _Outbox, setup: WorkerSetup, pad_token_id: int) -> None:
        self.outbox, self.setup, self.pad_token_id = outbox, setup, pad_token_id
        self.jobs: queue.Queue[_ScoringJob | None] = queue.Queue()
        self.failed = False
        self.thread = threading.Thread(target=self._run, name="rollout-scoring", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            setup, step = self.setup, job.step
            try:
                batch, metrics = scored_batch(
                    job.drawn,
                    job.rollout,
                    job.took,
                    setup.reward_funcs,
                    setup.params,
                    self.pad_token_id,
                    step,
                )
                sampled = Sampled(
                    step, job.version, batch, metrics, job.prompts_state, *job.waits, setup.worker
                )
                self.outbox.put(sampled)
            except BaseException as error:  # noqa: BLE001 - told to the trainer, as the worker's own
                self.failed = True
                with contextlib.suppress(OSError):  # (unless the trainer is gone)
                    self.outbox.put(_failure(step, error))
                return

    def finish(self, parent_pid: int) -> None:
        """Wait for the last batches to be scored and sent (while the trainer lives)."""
        self.jobs.put(None)
        while self.thread.is_alive() and os.getppid() == parent_pid:
            self.thread.join(timeout=POLL_S)


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """A spawned process imports the parent's `__main__` (a user's script, run again from the top
    unless guarded by `if __name__ == "__main__"`: its data loaded again, its training started again;
    `python -m grpokit` itself). The worker needs nothing from it (`check_rollout` refuses functions
    defined there), so while it starts, `__main__` shows no file or module name to import."""
    main = sys.modules["__main__"]
    hidden = {name: main.__dict__.pop(name) for name in ("__file__",) if name in main.__dict__}
    spec = getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(hidden)
        main.__spec__ = spec


class _Inbox:
    """The trainer's end of the pipe to a worker: its messages (the setup, then versions, then None:
    stop) sent in order by a thread of their own, so that the trainer never blocks on a worker that
    does not read (a pipe holds 64 KiB, the setup the whole policy): a worker that hangs is said by
    `take` at its timeout, as any other, and one that is gone ends the thread (said with its exit code)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.messages: queue.Queue[tuple[Message] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="rollout-inbox", daemon=True)
        self.thread.start()

    def send(self, message: Message) -> None:
        self.messages.put((message,))

    def _run(self) -> None:
        while (item := self.messages.get()) is not None:
            try:
                self.connection.send(item[0])
            except (OSError, ValueError):  # the worker is gone (its end closed)
                return

    def close(self) -> None:
        """Once what was sent is written (or the worker is gone: `RolloutWorker.close` ended it)."""
        self.messages.put(None)
        self.thread.join(timeout=5)
        self.connection.close()


class RolloutWorker:
    """The trainer's side: starts the worker, publishes weights, takes batches in step order."""

    def __init__(
        self,
        directory: Path,
        timeout: float,
        preload: tuple[str, ...] = (),
        d: distributed.Dist | None = None,
        name: str = "the rollout worker",
    ) -> None:
        """Start the worker process; it imports (`preload` too), then waits for its setup (`begin`).
        `d`: the trainer's distributed.Dist under torchrun (rank 0 removes the weight files no batch
        needs any more); `name`: how messages call it ("rollout worker 2 of 3" when there are several)."""
        self.directory, self.timeout, self.ready, self.hung = directory, timeout, False, False
        self.d, self.is_main, self.name = d, d is None or d.is_main, name
        self.setup: WorkerSetup | None = None
        context = mp.get_context("spawn")  # (a fork would copy the trainer's threads and locks)
        # two one-way pipes, each end held by one process only: a side that dies mid-message closes its
        # end, and the other reads end-of-file instead of waiting for the rest of it (never a hang)
        inbox, writing = context.Pipe(duplex=False)  # (the worker reads, the trainer writes)
        self.inbox = _Inbox(writing)
        self.outbox, outbox = context.Pipe(duplex=False)  # (the trainer reads, the worker writes)
        self.process = context.Process(target=work, args=(inbox, outbox, os.getpid(), preload), daemon=True)
        with _main_not_imported(), _signals_held():
            self.process.start()
        inbox.close()
        outbox.close()

    def begin(self, setup: WorkerSetup) -> None:
        """What the worker samples from, with the reward files it loads first, sent through its pipe
        (never through a file, whose bytes another user could replace: the setup is a pickle). The
        send returns once the worker has read it all; a worker that died meanwhile is said by `take`."""
        self.setup = setup
        packed = pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL)  # (tensors by value)
        self.inbox.send((loaded_files(), packed))

    def announce(self, version: int) -> None:
        """Tell the worker version `version` of the weights is written (`publish_weights`)."""
        self.inbox.send(version)

    def take(self, step: int) -> Sampled:
        """Step `step`'s batch, once the worker has it. A worker that failed, died, or sent nothing
        for `timeout` seconds is a RolloutError (one line); never a hang."""
        item = self._next(step)
        if isinstance(item, WorkerFailed):
            failed = RolloutError(f"{self.name} failed at step {item.step}: {item.message}")
            failed.add_note(f"{self.name}'s traceback:\n{item.details}")  # (shown with --debug)
            raise failed
        if item.step != step:  # the queue is in step order by construction: a broken invariant
            raise RuntimeError(f"{self.name} sent step {item.step}'s batch when step {step}'s was due")
        # the files of versions no batch still to be taken needs, on any rank: every rank has taken
        # step − 1's batch (its collectives are done), so no worker samples with a version before step's
        assert self.setup is not None
        needed = sampling_version(step, self.setup.max_staleness, self.setup.every)
        for path in self.directory.glob("weights-v*.safetensors") if self.is_main else ():
            if int(path.stem.split("-v")[1]) < needed:
                path.unlink(missing_ok=True)
        return item

    def _next(self, step: int) -> Sampled | WorkerFailed:
        """The worker's next message after READY: a batch or a failure."""
        deadline = time.monotonic() + (self.timeout if self.ready else max(self.timeout, STARTUP_S))
        died = f"{self.name} died (exit code {{}}) before it sampled step {step}'s batch"
        while True:
            try:
                if self.outbox.poll(POLL_S):
                    item = _unpack(self.outbox.recv_bytes())
                    if item != READY:
                        return item
                    self.ready, deadline = True, time.monotonic() + self.timeout
                    continue
            except (EOFError, OSError):  # its end closed: it died, mid-message or between two
                self.process.join(timeout=5)
                raise RolloutError(died.format(self.process.exitcode)) from None
            if not self.process.is_alive():
                raise RolloutError(died.format(self.process.exitcode))
            if time.monotonic() > deadline:
                self.hung = True
                raise RolloutError(
                    f"{self.name} sent no batch for step {step} within weight_sync_timeout="
                    f"{self.timeout:g} s: a reward or environment that hangs, or a worker too slow for "
                    "the timeout (raise weight_sync_timeout)"
                )

    def close(self) -> None:
        """Stop the worker (it ends at its next look at the inbox; one never given its setup, still
        importing or waiting for it, holds nothing and is ended at once: a refused resume, say)."""
        if self.setup is None:
            self.process.kill()
        self.inbox.send(None)
        deadline = time.monotonic() + (0 if self.hung or self.setup is None else 5)
        while self.process.is_alive() and time.monotonic() < deadline:
            # a worker blocked sending a batch takes its next look at the inbox once it is read
            try:
                if self.outbox.poll(0.1):
                    self.outbox.recv_bytes()
            except (EOFError, OSError):
                break
        self.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():  # busy in a reward or environment that does not return
            self.process.kill()  # (it ignores SIGTERM, which a Ctrl-C's process group would send it)
            self.process.join(timeout=5)
        self.inbox.close()
        self.outbox.close()
