"""Every Python and shell block of README.md and docs/ runs (tests/doc_blocks.py says how), and
what some pages' blocks compute is checked here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doc_blocks import (
    PAGES,
    ROOT,
    RUNS,
    SHELL,
    blocks,
    commands,
    grpokit_words,
    resolved_config,
    run_page,
    shown_files,
    with_small_run,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def docs_hub(tmp_path_factory) -> Path:
    """An HF_HOME holding what the docs' commands download (tests/hub_cache.py), built once."""
    from tests.hub_cache import build_docs_hub_cache

    home = tmp_path_factory.mktemp("docs_hf_home")
    build_docs_hub_cache(home)
    return home


def check_readme(run):
    after = run.namespaces[0]["result"].eval_after
    assert {"accuracy", "reward", "rewards/exact_answer/mean", "rewards/shorter/mean"} <= set(after)
    assert after["rewards/shorter/mean"] < 0 and (run.directory / "runs/readme/config.yaml").is_file()


def check_concepts(run):
    namespace = run.namespaces[0]
    assert namespace["rollout"].completion_ids.shape[0] == 32
    assert namespace["scores"].rewards.shape == (32,)


def check_batch_sizes(run):
    assert run.namespaces[0]["rows"] == 8 and run.namespaces[0]["updates"] == 200


CHECKS = {"README.md": check_readme, "concepts.md": check_concepts, "batch-sizes.md": check_batch_sizes}


@pytest.mark.slow
@pytest.mark.loopback  # the servers the pages start
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_of_the_page_runs(page, docs_hub, tmp_path, monkeypatch, capsys):
    from tests.conftest import read_hub_from

    read_hub_from(docs_hub, monkeypatch)
    work = tmp_path / "page"
    work.mkdir()
    run = run_page(page, work)
    CHECKS.get(page.name, lambda run: None)(run)


def test_every_block_is_run_or_marked_with_a_reason():
    """Each block is Python or shell (run), YAML (written as its named file, or parsed), `text` (a
    command's output, shown), or marked with its reason: no block without a language slips through
    unrun. A shell block the runner cannot run fails its page's test."""
    counts: dict[str, int] = {}
    for page in PAGES:
        for block in blocks(page):
            if block.mark is not None:
                assert len(block.mark[1]) > 10, block.where()  # a reason, not a word
                kind = "gpu" if block.mark[0] == "runs on a GPU only" else "not run"
            else:
                assert block.lang in ("python", "yaml", "bash", "text"), block.where()
                kind = block.lang
            counts[kind] = counts.get(kind, 0) + 1
    assert counts["python"] >= 9 and counts["bash"] >= 12 and counts["gpu"] >= 2


def test_the_small_run_override_adds_only_what_the_command_does_not_set():
    given = ["eval", "model=m", "num_eval_prompts=9"]
    assert with_small_run(given) == given
    words = with_small_run(["train", "gsm8k", "prompts_per_step=8"])
    assert "prompts_per_step=8" in words and "prompts_per_step=2" not in words
    assert "max_completion_length=16" in words and "num_generations=2" in words
    assert with_small_run(["report", "runs/x"]) == ["report", "runs/x"]


def test_the_small_run_override_only_lowers_what_the_config_resolves_to(tmp_path):
    """No warm start where the run has none, no more held-out prompts than its file sets."""
    (tmp_path / "run.yaml").write_text("task: addition\nmodel: tiny\nnum_eval_prompts: 3\n")
    words = with_small_run(["train", str(tmp_path / "run.yaml")])
    assert [w for w in words if w.startswith(("sft_steps", "num_eval_prompts"))] == []
    assert "prompts_per_step=2" in words  # the default 8 lowered


def test_a_run_no_later_command_reads_is_cut_short_and_the_others_keep_their_steps():
    assert "max_steps=4" in with_small_run(["train"], later="report runs/other")
    assert "max_steps=4" not in with_small_run(["train"], later="eval model=runs/addition/checkpoint-400")
    assert "max_steps=4" not in with_small_run(["train"])  # no page: steps kept


def test_commands_are_split_on_and_and_comments_dropped():
    from tests.doc_blocks import Block

    block = Block(ROOT, 1, "bash", "a b && c 'd e'  # note\nf \"g=[h, i]\"\n", None)
    assert commands(block) == [["a", "b"], ["c", "d e"], ["f", "g=[h, i]"]]


def test_no_two_runs_of_the_pages_share_an_output_directory(tmp_path, monkeypatch):
    """A reader who follows the pages in order keeps every run directory, and a run into a directory
    that holds another is refused: two different commands (not a resume) of any pages must write to
    different output directories. The same block shown on two pages (the install line of the README
    and of Get started) is one instruction, run once. (Each page's test runs in a directory of its
    own, which cannot see this.)"""
    for name, text in shown_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    writers: dict[str, tuple[str, tuple]] = {}
    clashes = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in SHELL:  # (marked blocks too: a reader with the GPUs runs them)
                continue
            for words in commands(block):
                words = grpokit_words(words)
                if not words or words[0] not in RUNS or "resume=true" in words:
                    continue
                config = resolved_config(words)
                assert config is not None, (block.where(), words)
                where = str(Path(config.output_dir))
                instruction = (block.text, tuple(words))
                if where in writers and writers[where][1] != instruction:
                    clashes.append(f"{where}: {writers[where][0]} and {block.where()}")
                writers.setdefault(where, (block.where(), instruction))
    assert clashes == []
    assert len(writers) >= 15  # the pages' runs were found


def test_a_gpu_block_runs_where_the_machine_has_its_gpus(monkeypatch, tmp_path):
    import torch

    from tests.doc_blocks import Block, Runner

    runner = Runner(ROOT / "README.md", tmp_path, {})
    one = Block(ROOT, 1, "bash", "x\n", ("runs on a GPU only", "needs CUDA"), 1)
    two = Block(ROOT, 1, "bash", "x\n", ("runs on a GPU only", "names cuda:1"), 2)
    never = Block(ROOT, 1, "bash", "x\n", ("not run by the suite", "two machines"), 1)
    for count, runs in [(0, [False, False, False]), (1, [True, False, False]), (2, [True, True, False])]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert [runner._runs(b) for b in (one, two, never)] == runs
    marks = [b.gpus for page in PAGES for b in blocks(page) if b.mark and b.mark[0] == "runs on a GPU only"]
    assert sorted(marks) == [2, 8]  # get-started's cuda:1, distributed's 8-process FSDP
