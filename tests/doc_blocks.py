"""Every code block of README.md and docs/, run as a reader would run it (tests/test_doc_blocks.py).

A page runs top to bottom in its own empty directory, with the hub read offline from a cache made by
the test (tests/hub_cache.py: `Qwen/Qwen2.5-0.5B-Instruct` and `openai/gsm8k` as tiny look-alikes):

* a block whose first line is a comment naming a file (`# my_run.yaml ...`, `# my_rewards.py: ...`)
  is written to that file, in every page's directory (a page may use a file another page shows);
  a named Python file is also executed, so it must import and define what it says;
* every other Python block is executed, in order, each in a fresh namespace;
* a YAML block without a name must parse;
* a shell block's lines are split on `&&` and run in order: `grpokit CMD ...` and `python3 -m
  grpokit CMD ...` in this process through `grpokit.cli.main`, `torchrun ... -m grpokit ...` as
  2 processes on the CPU, `serve-reward` and `serve-policy` in the background (on a free port put in
  place of the page's `--port N` everywhere on the page) until the block ends, when each must
  answer `/health` and stop on SIGTERM. Every command must exit 0.

The small-run override (TRAINING and PRESET_SMALL below) is appended to a training command for each
key the command does not set itself and would run with more of (its config resolved first): two
prompts of two completions a step, a two-step warm start, four held-out prompts, a batch of four for
supervised and reward-model steps; and two presets made smaller (gsm8k's 1024 completion tokens and
200 steps, reward_addition_rlhf's model size). A run whose output directory no later command of
the page names (nor a preset or file they name) is cut to SHORT steps; the others keep their step
counts, so the checkpoint a later command names (`checkpoint-400`) is the one a full run keeps.

What cannot run here is marked in the page source with an HTML comment on the line before the
block, which GitHub and Sphinx do not show: `<!-- runs on a GPU only: REASON -->` (or `<!-- runs on a
GPU only (N GPUs): REASON -->`), which runs where the machine has that many CUDA devices, or `<!-- not
run by the suite: REASON -->`. Two commands are the suite's own and count as run: `bash scripts/setup.sh
...` (CI runs `scripts/setup.sh test` before the suite) and `python3 -m pytest ...` (this suite).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```+)([\w{}-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!-- (runs on a GPU only|not run by the suite)(?: \((\d+) GPUs\))?: (.+?) -->\s*$")
GPU_ONLY = "runs on a GPU only"
FILE_NAME = re.compile(r"#\s*([\w./-]+\.(?:py|yaml|yml|jsonl|json|txt))\b")
SHELL = ("bash", "sh", "shell", "console")
TRAINING = {  # the small-run override: key -> value, added where the command does not set the key
    "train": {"prompts_per_step": "2", "num_generations": "2", "sft_steps": "2", "sft_batch_size": "4",
              "num_eval_prompts": "4"},
    "sft": {"batch_size": "4", "num_eval_prompts": "4"},
    "reward": {"batch_size": "4", "micro_batch_size": "4", "num_eval_pairs": "8"},
    "eval": {"num_eval_prompts": "4"},
    "eval-reward": {"num_eval_pairs": "8"},
}  # fmt: skip
TRAINING["doctor"] = TRAINING["train"]
PRESET_SMALL = {
    # the gsm8k preset: a random model writes all 1024 tokens, and no page names its checkpoints
    "gsm8k": {"max_completion_length": "16", "max_steps": "4"},
    # the RLHF chain's 3.9M-parameter reward model shrunk to 64 wide and 2 layers (its 800 steps are kept:
    # rlhf_addition loads checkpoint-800)
    "reward_addition_rlhf": {"tiny_hidden_size": "64", "tiny_num_layers": "2", "tiny_num_heads": "4",
                             "tiny_intermediate_size": "128"},
}  # fmt: skip
SERVERS = ("serve-reward", "serve-policy")
RUNS = ("train", "sft", "reward")  # the commands that make a run directory
SHORT = 4  # the steps of a run no later command of its page reads


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: tuple[str, str] | None  # (kind, reason) from the comment before the block
    gpus: int = 1  # the CUDA devices a GPU-only block needs (its mark's "(N GPUs)")

    @property
    def file_name(self) -> str | None:
        first = self.text.split("\n", 1)[0]
        match = FILE_NAME.match(first)
        return match.group(1) if match and self.lang in ("python", "yaml", "json", "text", "") else None

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        if match.group(2).startswith("{"):  # a MyST directive (toctree, include), not code
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.match(before.strip())
        found.append(
            Block(page, text[: match.start()].count("\n") + 1, match.group(2), match.group(3),
                  (mark.group(1), mark.group(3)) if mark else None, int(mark.group(2) or 1) if mark else 1)
        )  # fmt: skip
    return found


def shown_files() -> dict[str, str]:
    """Every file the pages show by name, once: the same name shown twice must be the same file."""
    files: dict[str, tuple[str, str]] = {}
    for page in PAGES:
        for block in blocks(page):
            name = block.file_name
            if name is None:
                continue
            if name in files and files[name][0] != block.text:
                shown = f"{files[name][1]} and {block.where()}"
                raise AssertionError(f"{name} is shown twice, differently: {shown}")
            files[name] = (block.text, block.where())
    return {name: text for name, (text, _) in files.items()}


def commands(block: Block) -> list[list[str]]:
    """The block's commands, each as its words, comments dropped (`a && b` is two commands)."""
    out = []
    for line in block.text.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1 :]
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grpokit_words(words: list[str]) -> list[str] | None:
    """`CMD ARGS` of a shell command that runs grpokit (`python3 -m grpokit`, `grpokit`, `torchrun ...
    -m grpokit`), else None."""
    if words[:3] == ["python3", "-m", "grpokit"]:
        return words[3:]
    if words[:1] == ["grpokit"]:
        return words[1:]
    if words[:1] == ["torchrun"] and "-m" in words and words[words.index("-m") + 1 :][:1] == ["grpokit"]:
        return words[words.index("-m") + 2 :]
    return None


def resolved_config(words: list[str]):
    """The config `grpokit CMD ARGS` would run with (its preset, file and overrides), or None where
    it does not load (the command's own error then shows when it runs)."""
    from grpokit import cli
    from grpokit.config import GRPOConfig, RewardConfig, SFTConfig, load_config

    command, items = words[0], [w for w in words[1:] if not w.startswith("-")]
    try:
        if command == "sft":
            return load_config(SFTConfig, *cli._split_args(items))
        if command in ("reward", "eval-reward"):
            return cli._config(RewardConfig, cli.REWARD_PRESET, items)
        return cli._config(GRPOConfig, cli.PRESET, items) if command in TRAINING else None
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def with_small_run(words: list[str], later: str | None = None) -> list[str]:
    """`grpokit CMD ARGS` (CMD first) with the small-run override: each value lowers what the command
    would run with (its resolved config), and none is added where ARGS set the key or the command
    runs with that much or less (a run without a warm start gets none). `later`, the text of the
    page's later commands (and of the presets and files they name): a run whose output_dir it does
    not mention is cut to SHORT steps, since nothing reads its checkpoints."""
    command, args = words[0], words[1:]
    small = dict(TRAINING.get(command, {}))
    for preset, extra in PRESET_SMALL.items():
        if preset in args:
            small |= extra
    config = resolved_config(words) if small else None
    read_later = config is None or later is None or str(Path(config.output_dir)) in later
    if command in RUNS and not read_later:
        small.setdefault("max_steps", str(SHORT))
    given = {a.split("=", 1)[0] for a in args if "=" in a and not a.startswith("-")}
    lower = {
        key: value
        for key, value in small.items()
        if key not in given and not (config is not None and (getattr(config, key, None) or 0) <= int(value))
    }
    return words + [f"{k}={v}" for k, v in lower.items()]


@dataclass
class PageRun:
    directory: Path
    namespaces: list[dict] = field(default_factory=list)  # each executed Python block's globals, in order
    ran: list[str] = field(default_factory=list)  # every command or block run, as "where: what"
    marked: list[tuple[str, str, str]] = field(default_factory=list)  # (where, kind, reason)


class Runner:
    def __init__(self, page: Path, directory: Path, env: dict[str, str]):
        self.page, self.dir, self.env = page, directory, env
        self.result = PageRun(directory)
        self.servers: list[tuple[subprocess.Popen, int, str]] = []

    def run(self) -> PageRun:
        for name, text in shown_files().items():
            path = self.dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        ports = {port: free_port() for port in re.findall(r"--port (\d+)", self.page.read_text())}
        self.commands = [
            (b, c) for b in blocks(self.page) if self._runs(b) and b.lang in SHELL for c in commands(b)
        ]
        self.done = 0  # of self.commands
        for block in blocks(self.page):
            if not self._runs(block):
                self.result.marked.append((block.where(), *block.mark))
            elif block.lang == "python":
                namespace: dict = {"__name__": "__main__"}
                exec(compile(block.text, block.where(), "exec"), namespace)  # noqa: S102 - our own docs
                self.result.namespaces.append(namespace)
                self.result.ran.append(f"{block.where()}: python")
            elif block.lang in ("yaml", "yml") and block.file_name is None:
                yaml.safe_load(block.text)
                self.result.ran.append(f"{block.where()}: yaml parsed")
            elif block.lang in SHELL:
                try:
                    for words in commands(block):
                        words = [self._ports(w, ports) for w in words]
                        self.done += 1
                        start = time.perf_counter()
                        self._command(block, words)
                        took = time.perf_counter() - start
                        self.result.ran.append(f"{block.where()}: {shlex.join(words)} ({took:.1f} s)")
                        print(self.result.ran[-1], file=sys.__stderr__)
                finally:
                    self._stop_servers(block)
        return self.result

    def _runs(self, block: Block) -> bool:
        """Unmarked, or GPU-only on a machine with the GPUs it needs (there it runs as any block)."""
        if block.mark is None:
            return True
        import torch

        return block.mark[0] == GPU_ONLY and torch.cuda.device_count() >= block.gpus

    def _env(self, block: Block) -> dict[str, str]:
        """A subprocess's environment: the suite's CPU-only one, or the machine's for a GPU block."""
        return self.env if block.mark is None else dict(os.environ)

    @staticmethod
    def _ports(word: str, ports: dict[str, int]) -> str:
        for old, new in ports.items():
            word = re.sub(rf"(?<=:){old}\b", str(new), word)
            word = str(new) if word == old else word
        return word

    def _later(self) -> str:
        """The words of the page's commands after the current one, and the text of each file or
        preset they name."""
        from grpokit.cli import presets

        words = [w for _, command in self.commands[self.done :] for w in command]
        named = [self.dir / w for w in words] + [
            Path(ROOT / "src" / "grpokit" / "presets" / f"{w}.yaml") for w in words if w in presets()
        ]
        return " ".join(words + [p.read_text() for p in named if p.suffix == ".yaml" and p.is_file()])

    def _command(self, block: Block, words: list[str]) -> None:
        where = f"{block.where()}: {shlex.join(words)}"
        if words[:2] == ["bash", "scripts/setup.sh"] or words[:3] == ["python3", "-m", "pytest"]:
            return  # the suite's own commands: CI runs them to run this
        command = grpokit_words(words)
        if command is None:
            raise AssertionError(f"{where}: the suite does not know how to run this; mark the block")
        if words[0] == "torchrun":
            launch = [sys.executable, "-m", "torch.distributed.run", *words[1 : words.index("-m")]]
            # a user's shell has no OMP_NUM_THREADS (the suite pins one per worker): torchrun then sets 1
            env = {
                k: v for k, v in self._env(block).items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
            }
            child = subprocess.run(
                [*launch, "-m", "grpokit", *with_small_run(command, self._later())],
                cwd=self.dir, env=env, capture_output=True, text=True, timeout=400,
            )  # fmt: skip
            assert child.returncode == 0, f"{where}\n{child.stdout[-3000:]}\n{child.stderr[-3000:]}"
            return
        words = command
        if words[0] in SERVERS:
            self._start_server(words, where, self._env(block))
            return
        from grpokit.cli import main

        code = main(with_small_run(words, self._later()))
        assert code == 0, f"{where}: exit code {code}"

    def _start_server(self, words: list[str], where: str, env: dict[str, str]) -> None:
        port = int(words[words.index("--port") + 1])
        child = subprocess.Popen(
            [sys.executable, "-m", "grpokit", *words], cwd=self.dir, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.servers.append((child, port, where))
        deadline = time.monotonic() + 120
        while True:
            if child.poll() is not None:
                raise AssertionError(f"{where}: the server exited\n{child.communicate()[0][-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{where}: no /health after 120 s"
            time.sleep(0.2)

    def _stop_servers(self, block: Block) -> None:
        servers, self.servers = self.servers, []
        for child, port, where in servers:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
                    assert answer.status == 200, where
            finally:
                child.send_signal(signal.SIGTERM)
                try:
                    output, _ = child.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.communicate()
                    raise AssertionError(f"{where}: did not stop on SIGTERM") from None
            code = child.returncode
            assert code == 0, f"{where}: exit code {code} on SIGTERM\n{output[-3000:]}"


def run_page(page: Path, directory: Path) -> PageRun:
    """Run `page`'s blocks in `directory`: the current directory while it runs, and first on sys.path
    (as for `python3 script.py` there); the modules imported from it are forgotten afterwards, so no
    other test finds a page's `my_rewards`."""
    previous = Path.cwd()
    os.chdir(directory)
    sys.path.insert(0, str(directory))
    try:
        return Runner(page, directory, dict(os.environ, CUDA_VISIBLE_DEVICES="")).run()
    finally:
        os.chdir(previous)
        sys.path.remove(str(directory))
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(directory)):
                del sys.modules[name]
