"""Asynchronous GRPO: a rollout worker process samples and scores the batches while the trainer
updates, with an exact staleness (`max_staleness`).

Version v of the weights is the policy after v optimizer steps; a synchronous step s samples with
version s − 1. With max_staleness = k the worker samples step s's batch with version
`sampling_version(s, k, every)` = max(0, s − 1 − k) (rounded down to the versions published, one every
`weight_sync_steps`) and no other; the trainer trains step s on that batch. Nothing is dropped and no
batch is trained twice, so an asynchronous run is as reproducible as a synchronous one, and k = 0 is
the synchronous run itself, bitwise, with the sampling moved to another process.

The worker holds its own copy of the policy (the same engine, backend and decode loop), the prompt
sampler (the data cursor and curriculum) and the reward functions; it hands finished batches to the
trainer through a pipe, as tensors and plain values (in_flight.py: read with weights_only=True, the
form a checkpoint holds them in). The setup (the policy, tokenizer and reward functions: a pickle)
goes the other way through the worker's own pipe, from the live trainer, never through a file.
Weights go to the worker as files: the trainer writes version v to
`output_dir/.rollout/weights-v<v>.safetensors` under a temporary name and renames it (atomic), then
says so. Files, not shared memory: a reader can never see half an update, a dead trainer leaves
nothing half-written, and a rollout server's `/update_weights {"path"}` takes the same form. On a
CPU the tiny models' files cost milliseconds; on a GPU a shared-memory or NCCL transport would avoid
the copy through host memory.

With `rollout_workers` = n > 1, n worker processes take the steps in turn (step s is worker s mod n's),
each sampling its steps exactly as the one worker would: the same version, prompts and seeds, so the
run is bitwise the one-worker run, only with n batches sampled at once (up to k + 1 are in flight).
Each worker moves its prompt sampler past the other workers' steps without sampling them; dynamic
sampling and the curriculum, whose next draw depends on the last batch's rewards, are refused there.

Under torchrun each rank has a worker of its own, which samples and scores that rank's share of every
batch (its prompts, its seeds) exactly as the rank's synchronous step would; rank 0 writes each
version (gathered from the shards under FSDP) and every rank tells its worker once it is written. A
checkpoint holds every rank's batches in flight. Dynamic sampling and the curriculum, which agree
across ranks through collectives, are refused there.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import queue
import re
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .checkpoint_state import shown
from .in_flight import (
    InFlightBounds,
    Sampled,
    dumps,
    from_plain,
    in_flight_problem,
    loads,
    sampling_version,
    to_plain,
)

WEIGHTS_DIR = ".rollout"
POLL_S = 0.5  # how often a waiting side looks whether the other is still alive
STARTUP_S = 300.0  # the longest a worker may take to start (import, copy of the policy) when the
# timeout is shorter: weight_sync_timeout counts from when it is ready
READY = "ready"
# what grpokit writes in WEIGHTS_DIR (and the setup files it wrote there before they went by pipe)
WEIGHT_FILE = re.compile(r"weights-v\d+\.(safetensors|tmp)|setup-rank\d+-worker\d+\.(pt|tmp)")
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class RolloutError(RuntimeError):
    """The rollout worker failed, died, or stopped answering: the run cannot go on (one line)."""


def refuse_unpicklable(what: str, items: Sequence[tuple[str, Any]]) -> None:
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


@dataclass(frozen=True)
class WorkerSetup:
    """What the worker builds its side from (pickled once, at start)."""

    model: torch.nn.Module  # a copy of the policy on the CPU, with storage of its own
    tokenizer: Any
    engine: Any  # config.specs.EngineSpec
    device: str
    environment: Any  # envs.EnvironmentSpec, or None
    prompts: Any  # data.PromptSampler, where the first batch the worker samples starts
    reward_funcs: list[Callable[..., Any]]
    params: Any  # trainee.StepParams
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


def publish_weights(module: torch.nn.Module, directory: Path, version: int, d: Any = None) -> float:
    """Write version `version` of `module`'s weights where the workers read them, atomically;
    -> seconds taken. Under torchrun (`d`, a distributed.Dist): every rank calls it, the weights are
    gathered (a collective under FSDP), rank 0 writes them, and every rank returns once they are
    written."""
    from safetensors.torch import save_file, save_model

    from . import distributed

    began = time.perf_counter()
    final = weights_path(directory, version)
    staging = final.with_suffix(".tmp")
    if d is None or not d.enabled:
        with _writing(staging, final):
            save_model(module, str(staging))  # (save_model keeps tied weights tied)
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
            save_file(unique, str(staging))
    distributed.barrier(d)
    return time.perf_counter() - began


@contextlib.contextmanager
def _writing(staging: Path, final: Path) -> Iterator[None]:
    """The weights written to `staging`, then renamed to `final` (atomic: a reader never sees half a
    version). A failed write leaves no staging file and is an OSError naming `final` (safetensors says
    a full disk as a SafetensorError, "os error 28"), which the command line says in one line with the
    free space."""
    from .checkpoint import as_os_error

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


def _receive(inbox: Any, parent_pid: int) -> Any:
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


def _wait_for_version(inbox: Any, newest: int, version: int, parent_pid: int) -> int | None:
    """Block until the trainer says version ≥ `version` is published; None: told to stop, or the
    trainer is gone."""
    while newest < version:
        message = _receive(inbox, parent_pid)
        if message is None:
            return None
        newest = max(newest, int(message))
    return newest


class _Outbox:
    """The worker's end of the pipe to the trainer, shared by its sampling loop and its scoring thread
    (one message at a time). A trainer that is gone makes a send raise (BrokenPipeError), which ends
    the worker instead of leaving it blocked."""

    def __init__(self, connection: Any) -> None:
        import threading

        self.connection, self.lock = connection, threading.Lock()

    def put(self, value: Any) -> None:
        data = _pack(value)
        with self.lock:
            self.connection.send_bytes(data)


def _failure(step: int, error: BaseException) -> WorkerFailed:
    line = (str(error).strip().splitlines() or [""])[0]
    return WorkerFailed(step, f"{type(error).__name__}: {line}", traceback.format_exc())


def _work(inbox: Any, connection: Any, parent_pid: int, preload: tuple[str, ...]) -> None:
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
    import threading

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
    import threading

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


def _set_up(files: list[Any], packed: bytes) -> tuple[WorkerSetup, Any]:
    """The setup the trainer sent through the pipe (`RolloutWorker.begin`), once the reward files it
    loaded (`python: file.py:f`) are loaded here the same way, so that the functions in them unpickle;
    and the engine over the worker's copy of the policy, in training mode as the trainer's engine is
    when it samples."""
    from ..engine import PolicyEngine
    from ..rewards.loading import load_files

    load_files(files)  # (a reward file that raises here is said as any other failure)
    setup = _setup_from_trainer(packed)
    torch.set_num_threads(setup.num_threads)
    if setup.servers:  # sampled on the rollout servers: no policy here
        from ..engine.remote import RemotePolicy
        from ..net.server import API_KEY_ENV

        key = os.environ.get(API_KEY_ENV) or None
        return setup, RemotePolicy(setup.servers, setup.tokenizer, setup.request_timeout, key)
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


def _sample_steps(setup: WorkerSetup, engine: Any, inbox: Any, outbox: _Outbox, at: _At) -> None:
    """Each step's batch with exactly its weight version, sent in step order."""
    from safetensors.torch import load_model

    from . import distributed
    from .draw import generate_and_score, sample_rollout

    # this rank's share of each batch (no collectives here: `check_rollout` refused what needs them)
    device = engine.device
    d = distributed.Dist(rank=setup.rank, world_size=setup.world_size, device=device)
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
        if loaded != version:
            path = str(weights_path(setup.weights_dir, version))
            if setup.servers:  # every server loads the file the trainer wrote
                engine.update_weights(path, version)
            else:
                load_model(engine.train_module, path, device=str(device))
            loaded = version
        waits = (waited, time.perf_counter() - began)
        if scorer is None:
            batch, metrics = generate_and_score(engine, prompts, setup.reward_funcs, params, step, d)
            outbox.put(Sampled(step, version, batch, metrics, prompts.state_dict(), *waits, setup.worker))
        else:
            drawn, rollout, took = sample_rollout(engine, prompts, params, step, d, 0)
            scorer.submit(step, version, (drawn, rollout, took), prompts.state_dict(), waits)
    if scorer is not None:
        scorer.finish(setup.parent_pid)


class _Scorer:
    """The worker's scoring thread: the sampled batches scored in step order, one at a time (a reward
    function is never called twice at once), each sent to the trainer once scored. A reward that
    raises is sent as the worker's failure, and the sampling loop stops at its next step."""

    def __init__(self, outbox: _Outbox, setup: WorkerSetup, pad_token_id: int) -> None:
        import threading

        self.outbox, self.setup, self.pad_token_id = outbox, setup, pad_token_id
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.failed = False
        self.thread = threading.Thread(target=self._run, name="rollout-scoring", daemon=True)
        self.thread.start()

    def submit(self, step: int, version: int, sampled: tuple, prompts_state: dict, waits: tuple) -> None:
        self.jobs.put((step, version, sampled, prompts_state, waits))

    def _run(self) -> None:
        from .draw import scored_batch

        while (job := self.jobs.get()) is not None:
            step, version, (drawn, rollout, took), prompts_state, waits = job
            try:
                setup = self.setup
                batch, metrics = scored_batch(
                    drawn, rollout, took, setup.reward_funcs, setup.params, self.pad_token_id, step
                )
                self.outbox.put(Sampled(step, version, batch, metrics, prompts_state, *waits, setup.worker))
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

    def __init__(self, connection: Any) -> None:
        import threading

        self.connection, self.messages = connection, queue.Queue()
        self.thread = threading.Thread(target=self._run, name="rollout-inbox", daemon=True)
        self.thread.start()

    def send(self, message: Any) -> None:
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
        max_staleness: int,
        timeout: float,
        preload: tuple[str, ...] = (),
        d: Any = None,
        name: str = "the rollout worker",
    ) -> None:
        """Start the worker process; it imports (`preload` too), then waits for its setup (`begin`).
        `d`: the trainer's distributed.Dist under torchrun (rank 0 removes the weight files no batch
        needs any more); `name`: how messages call it ("rollout worker 2 of 3" when there are several)."""
        import multiprocessing as mp

        self.directory, self.timeout, self.ready, self.hung = directory, timeout, False, False
        self.d, self.is_main, self.name = d, d is None or d.is_main, name
        self.setup: WorkerSetup | None = None
        context = mp.get_context("spawn")  # (a fork would copy the trainer's threads and locks)
        # two one-way pipes, each end held by one process only: a side that dies mid-message closes its
        # end, and the other reads end-of-file instead of waiting for the rest of it (never a hang)
        inbox, writing = context.Pipe(duplex=False)  # (the worker reads, the trainer writes)
        self.inbox = _Inbox(writing)
        self.outbox, outbox = context.Pipe(duplex=False)  # (the trainer reads, the worker writes)
        self.process = context.Process(target=_work, args=(inbox, outbox, os.getpid(), preload), daemon=True)
        with _main_not_imported(), _signals_held():
            self.process.start()
        inbox.close()
        outbox.close()

    def begin(self, setup: WorkerSetup) -> None:
        """What the worker samples from, with the reward files it loads first, sent through its pipe
        (never through a file, whose bytes another user could replace: the setup is a pickle). The
        send returns once the worker has read it all; a worker that died meanwhile is said by `take`."""
        from ..rewards.loading import loaded_files

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

    def _next(self, step: int) -> Any:
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


class AsyncRollout:
    """What the training loop sees of the worker: step s's batch, drawn as a synchronous step would
    have drawn it (with its async/* figures); the weights published after the steps that make a
    version; and in a checkpoint after step c, the batches in flight then (steps c+1 … c+k, sampled
    with versions before c), so that a resume trains exactly what the uninterrupted run trains.

    Built before the run opens (a resume restores the batches in flight into it), started by the
    loop (`start`)."""

    def __init__(self, spec: Any, output_dir: Path, d: Any = None) -> None:  # spec: config.plan.RolloutSpec
        self.max_staleness, self.every = spec.max_staleness, spec.weight_sync_steps
        self.timeout, self.output_dir = spec.timeout, output_dir
        self.device = spec.device  # rollout_device (None: chosen by `rollout_device`)
        weights_dir(output_dir, create=d is None or d.is_main)  # (grpokit's own: checked, then made)
        self.count = spec.workers  # rollout_workers: step s is sampled by workers[s % count]
        self.d = d  # the trainer's distributed.Dist (None: one process)
        self.workers: list[RolloutWorker] = []
        self.setup: WorkerSetup | None = None
        self.policy: torch.nn.Module | None = None  # the worker's copy of the policy (`keep_policy`)
        self.buffer: dict[
            int, Sampled
        ] = {}  # batches taken from the worker (or a checkpoint), not trained yet
        self.publish_s = 0.0  # writing the version the last batch was sampled with
        self.saved_last: int | None = None  # the last step of the run a resumed checkpoint was saved in

    def spawn(self, preload: tuple[str, ...] = ()) -> AsyncRollout:
        """Start the worker processes now: their imports (`preload` too: module names) overlap the
        trainer's loading and warm start."""
        directory = self.output_dir / WEIGHTS_DIR
        for index in range(len(self.workers), self.count):
            name = "the rollout worker" if self.count == 1 else f"rollout worker {index + 1} of {self.count}"
            self.workers.append(
                RolloutWorker(directory, self.max_staleness, self.timeout, preload, self.d, name)
            )
        return self

    def keep_policy(self, model: torch.nn.Module) -> None:
        """A CPU copy of the policy for the worker, taken before it is wrapped for training (FSDP2
        shards it in place); its values do not matter: the worker loads the version it needs first."""
        self.policy = cpu_copy(model)

    def start(self, setup: WorkerSetup, module: torch.nn.Module) -> None:
        """The worker started after the batches already in hand, and the weights of now published: the
        version its first batch needs. A checkpoint at a step that is no multiple of weight_sync_steps
        would need an older one, which it does not hold: refused in one line. A run resumed past the
        end of the run that saved it (max_steps raised) has no batches in flight for its next steps,
        which no run sampled yet: they are sampled with the checkpoint's weights (less stale than k,
        said once and logged as async/staleness); then the rule holds again."""
        now, first = setup.first_step - 1 - len(self.buffer), setup.first_step
        if first <= setup.last_step and sampling_version(first, self.max_staleness, self.every) != now:
            if self.saved_last is None or first <= self.saved_last:
                raise ValueError(
                    f"resuming an asynchronous run at step {now}, which is no multiple of "
                    f"weight_sync_steps={self.every}, needs an older weight version than the checkpoint "
                    "holds: resume from a checkpoint at a multiple of weight_sync_steps"
                )
            fresher = [
                s
                for s in range(first, setup.last_step + 1)
                if sampling_version(s, self.max_staleness, self.every) < now
            ]
            then = f"; from step {fresher[-1] + 1} on, exactly {self.max_staleness}"
            logging.getLogger("grpokit").warning(
                f"the run goes on past step {self.saved_last}, where it ended: steps {first}-{fresher[-1]}, "
                f"which no run sampled before, are sampled with the weights of step {now} (less than "
                f"max_staleness={self.max_staleness} versions old, as async/staleness shows)"
                + then
                * (fresher[-1] < setup.last_step)
            )
            setup = replace(setup, oldest=now)
        self.spawn()
        self.setup = setup
        for index, worker in enumerate(self.workers):
            worker.begin(replace(setup, worker=index, workers=self.count))
        self.publish(module, now)

    def publish(self, module: torch.nn.Module, version: int) -> None:
        """Version `version` of the weights written once, and every worker told."""
        self.publish_s = publish_weights(module, self.output_dir / WEIGHTS_DIR, version, self.d)
        for worker in self.workers:
            worker.announce(version)

    def batch(self, step: int, trainee: Any) -> Any:
        """Step `step`'s DrawnBatch, its metrics with the async/* figures. The trainee's prompt sampler
        is set to where the worker's stood after drawing it: a checkpoint after this step saves that
        cursor."""
        from .checkpoint import rng_state
        from .trainee import DrawnBatch

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
        from .checkpoint import list_checkpoints

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
        """Publish version `step` when it is one the worker samples with."""
        if step % self.every == 0 and self.workers:
            self.publish(module, step)

    def state_dict(self, step: int) -> dict[str, Any]:
        """For checkpoint-<step>: the batches of steps step+1 … step+k (up to the last step), taken from
        the worker if not yet in hand: they were sampled with versions before `step`, which the
        checkpoint does not hold. About k batches of token ids, log-probs and rewards on disk."""
        assert self.setup is not None
        last = min(step + self.max_staleness, self.setup.last_step)
        for ahead in range(step + 1, last + 1):
            if ahead not in self.buffer:
                self.buffer[ahead] = self._take(ahead)
        mine = [to_plain(self.buffer[s]) for s in range(step + 1, last + 1)]
        from . import distributed

        # every rank's (a collective under torchrun): rank 0 writes the checkpoint
        return {
            "in_flight_by_rank": distributed.gather_objects(self.d or distributed.Dist(), mine),
            "last_step": self.setup.last_step,  # (a resume past it: `start`)
        }

    def load_state_dict(self, state: Any, bounds: InFlightBounds) -> str | None:
        """The batches in flight a checkpoint holds (tensors and plain values, read with weights_only),
        once they fit this run (`in_flight.in_flight_problem`); else the problem, in one phrase, and
        nothing is restored."""
        by_rank = state.get("in_flight_by_rank") if isinstance(state, dict) else None
        rank, world = (self.d.rank, self.d.world_size) if self.d is not None else (0, 1)
        if not isinstance(by_rank, list):
            return f"rollout is {shown(state)}, not the batches in flight of an asynchronous run"
        if len(by_rank) != world:
            raise ValueError(
                f"this checkpoint of an asynchronous run holds the batches in flight of {len(by_rank)} "
                f"process(es), each its own share; resume it on {len(by_rank)}, not {world}"
            )
        problem = in_flight_problem(by_rank[rank], state.get("last_step"), bounds)
        if problem is not None:
            return problem
        self.buffer = {item.step: item for item in map(from_plain, by_rank[rank])}
        self.saved_last = state["last_step"]
        return None

    def next_prompts(self, prompts: Any) -> Any:
        """A copy of the trainer's prompt sampler where the worker starts: after the last batch in hand."""
        import copy

        sampler = copy.deepcopy(prompts)
        if self.buffer:
            sampler.load_state_dict(self.buffer[max(self.buffer)].prompts_state)
        return sampler

    def close(self) -> None:
        """Stop every worker, then remove the weight files (rank 0's to remove)."""
        for worker in self.workers:
            worker.close()
        if self.workers and (self.d is None or self.d.is_main):
            shutil.rmtree(self.output_dir / WEIGHTS_DIR, ignore_errors=True)

    def __enter__(self) -> AsyncRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rollout_device(asked: str | None, trainer: torch.device, d: Any = None) -> torch.device:
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


def check_rollout(data: Any, world_size: int, step: Any, spec: Any = None) -> None:
    """What the rollout worker cannot take, refused before any work in one line: a reward function or
    environment that cannot be pickled (a lambda, a closure); under torchrun, dynamic sampling and the
    curriculum (`step`: the plan's StepSpec), whose ranks agree through collectives the workers lack;
    a rollout_device this machine does not have (`spec`: the plan's RolloutSpec)."""
    asked = spec.device if spec is not None else None
    if asked is not None and asked.startswith("cuda"):
        index = torch.device(asked).index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(
                f"rollout_device={asked}: this machine has {have} CUDA GPU(s); set rollout_device=cpu, "
                "or leave it unset (the trainer's device)"
            )
    for name, on in (("dynamic_sampling", step.dynamic_sampling), ("curriculum", step.curriculum)):
        if world_size > 1 and on:
            raise ValueError(
                f"{name} with max_staleness under torchrun is not supported yet: its ranks agree through "
                "collectives, which the rollout workers (one per process) do not take part in; drop one "
                "of them, or run on one process"
            )
    if spec is not None and spec.servers and data.environment is not None:  # (the task's tools)
        raise ValueError(
            "rollout_server_urls with multi-turn episodes (the task's tools, or an environment) is not "
            "supported: they run in process; drop rollout_server_urls, or set tools=[]"
        )
    refuse_unpicklable("reward function", [(_name(f), f) for f in data.reward_funcs])
    if data.environment is not None:
        refuse_unpicklable("environment", [(type(data.environment).__name__, data.environment)])


def worker_setup(
    trainee: Any,
    data: Any,
    engine_spec: Any,
    spec: Any,
    steps: tuple[int, int],
    output_dir: Path,
    threads: Any = None,
) -> WorkerSetup:
    """The worker's side of a run: a CPU copy of the policy, the tokenizer, the prompt sampler where
    the trainer's stands, the rewards and the environment (`check_rollout` has seen that they pickle),
    for steps `steps` (first, last); and half the trainer's CPU threads, shared by the workers (at
    least one each): the trainer keeps the rest (`threads`, the run's ThreadGovernor, stops adapting to
    a load that is now its own workers')."""
    engine, rollout = trainee.engine, trainee.rollout
    model = rollout.policy  # (`keep_policy`: taken before wrapping; FSDP2 shards engine.module in place)
    assert model is not None, "AsyncRollout.keep_policy comes before the worker's setup"
    rollout.policy = None  # (pickled into the setup: the trainer need not hold it)
    rank, world = (rollout.d.rank, rollout.d.world_size) if rollout.d is not None else (0, 1)
    count = torch.get_num_threads()
    worker_threads = max(1, count // 2)
    each = max(1, worker_threads // rollout.count)
    if threads is not None:
        threads.keep(max(1, count - worker_threads))
    else:
        torch.set_num_threads(max(1, count - worker_threads))
    return WorkerSetup(
        model=model,
        tokenizer=engine.tokenizer,
        engine=engine_spec,
        device=str(rollout_device(rollout.device, engine.device, rollout.d)),
        environment=data.environment,
        prompts=trainee.rollout.next_prompts(trainee.prompts),
        reward_funcs=list(data.reward_funcs),
        params=trainee.params,
        max_staleness=spec.max_staleness,
        every=spec.weight_sync_steps,
        first_step=steps[0],
        last_step=steps[1],
        weights_dir=str(output_dir / WEIGHTS_DIR),
        num_threads=each,
        parent_pid=os.getpid(),
        rank=rank,
        world_size=world,
        servers=spec.servers,
        request_timeout=spec.request_timeout,
    )


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on the CPU with storage of its own, made without a second copy on its device:
    each parameter and buffer is copied to the CPU first, and the module's structure around them."""
    import copy

    memo: dict[int, Any] = {}
    for tensor in model.parameters():
        memo[id(tensor)] = torch.nn.Parameter(tensor.detach().to("cpu", copy=True), tensor.requires_grad)
    for tensor in model.buffers():
        memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)
