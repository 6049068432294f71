"""Run TRL's own GRPOTrainer tests against grpokit, from outside the project.

    python3 scripts/trl_suite.py --trl-tests TRL_CHECKOUT/tests [--against trl|grpokit|both] [-k EXPR]

TRL's test file is TRL's, not ours: it is read from a TRL checkout, copied into a scratch directory
(never into this project) and run there twice, as TRL's authors run it and with its one import line
`from trl import GRPOConfig, GRPOTrainer` changed to grpokit's. The hub ids the tests name are built
offline first, in a Hugging Face cache of the scratch directory, as a download would leave them:

* `trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`: a tiny Qwen2 causal LM, byte-level BPE, ChatML;
* `trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5`: the same shape with a scalar head;
* `trl-internal-testing/zen`: the Zen of Python as prompts, configs `standard_prompt_only` and
  `conversational_prompt_only`, 17 training and 2 test rows each.

Tests that name any other hub id fail on both sides (not in the cache), so the figure is the share
of the tests that pass with TRL which also pass with grpokit. Writes SCRATCH/results.json and prints
each test that passes with TRL and fails with grpokit, with its first error line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAUSAL = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
CLASSIFIER = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
ZEN = "trl-internal-testing/zen"
TEST_FILES = ("test_grpo_trainer.py",)
SUPPORT = ("testing_utils.py", "conftest.py")
IMPORT = "from trl import GRPOConfig, GRPOTrainer"

# the Zen of Python cut into prompts, as TRL's zen dataset cuts it (its first twelve are the ones TRL's
# own tests name; the rest are cut alike): 17 training and 2 test rows
ZEN_PROMPTS = [
    "Beautiful is better than",
    "Explicit is",
    "Simple is better",
    "Complex",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality beats",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one-- and preferably",
    "Although that way may not be",
    "Now is better than",
    "Although never is often better than",
    "If the implementation is hard to explain,",
    "If the implementation is easy",
    "Namespaces are one honking",
]


def build_fixture(hf_home: Path) -> None:
    """The three hub ids under `hf_home/hub`, as `hf download` would leave them."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tests.hub_cache import build_qwen, snapshot

    build_qwen(snapshot(hf_home, CAUSAL))
    # the classifier: the causal model's shape and tokenizer, a one-label head (TRL's tiny reward model)
    causal = snapshot(hf_home, CAUSAL)
    config = Qwen2Config.from_pretrained(causal)
    config.num_labels = 1
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        classifier = Qwen2ForSequenceClassification(config)
    where = snapshot(hf_home, CLASSIFIER)
    classifier.save_pretrained(where, safe_serialization=True)
    for name in os.listdir(causal):
        if "token" in name or name in {"vocab.json", "merges.txt", "chat_template.jinja"}:
            shutil.copy(causal / name, where / name)

    standard = [{"prompt": p} for p in ZEN_PROMPTS]
    conversational = [
        {"prompt": [{"role": "user", "content": f"What comes after '{p}'?"}]} for p in ZEN_PROMPTS
    ]
    for name, rows in (("standard_prompt_only", standard), ("conversational_prompt_only", conversational)):
        cached_dataset(hf_home, ZEN, name, {"train": rows[:17], "test": rows[17:]})


def cached_dataset(hf_home: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    """`repo`'s `config` as `datasets` caches a hub dataset it prepared (HF_HOME/datasets/ORG___NAME/
    CONFIG/0.0.0/REVISION/NAME-SPLIT.arrow): what `load_dataset(repo, config)` reads back offline."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    from tests.hub_cache import REVISION

    org, name = repo.split("/")
    source = hf_home / "download" / org / name / config
    source.mkdir(parents=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(source / f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    staging = hf_home / "download" / "prepared"
    builder = Parquet(
        cache_dir=str(staging), dataset_name=name, config_name=config, hash=REVISION, data_files=files
    )
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # staging/NAME/CONFIG-<hash of the files>/0.0.0/REVISION
    target = hf_home / "datasets" / f"{org}___{name}" / config / "0.0.0" / REVISION
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(prepared, target)
    shutil.rmtree(hf_home / "download")


def stage(trl_tests: Path, scratch: Path, against: str) -> Path:
    """TRL's test files and their support files in scratch/<against>/tests."""
    where = scratch / against / "tests"
    where.mkdir(parents=True)
    (where / "__init__.py").write_text("")
    for name in (*SUPPORT, *TEST_FILES):
        text = (trl_tests / name).read_text()
        if name == "testing_utils.py":
            text = _older_test_helpers(text)
        if against == "grpokit" and name in TEST_FILES:
            if IMPORT not in text:
                raise SystemExit(f"{trl_tests / name} has no line '{IMPORT}': not the file this reads")
            text = text.replace(IMPORT, IMPORT.replace("from trl ", "from grpokit "))
        (where / name).write_text(text)
    return where.parent


def _older_test_helpers(text: str) -> str:
    """TRL's test helpers ask trl.import_utils for `is_<package>_available` functions that the installed
    TRL may have dropped or not have yet (its tests and its release move apart): those missing are
    defined first, as `find_spec(<package>)`, so the helpers import with either TRL."""
    block = re.search(r"from trl\.import_utils import \(([^)]*)\)", text)
    names = re.findall(r"is_(\w+)_available", block.group(1)) if block else []
    shim = [
        "import importlib.util as _find",
        "import trl.import_utils as _trl_imports",
        *(
            f"_trl_imports.is_{n}_available = getattr(_trl_imports, 'is_{n}_available', "
            f"lambda: _find.find_spec('{n}') is not None)"
            for n in names
        ),
    ]
    return "\n".join(shim) + "\n" + text


def run(
    directory: Path, hf_home: Path, select: str | None, workers: str, src: Path | None = None
) -> dict[str, dict[str, str]]:
    """pytest over the staged files; each test's outcome (passed, failed, skipped) and first error line."""
    report = directory / "junit.xml"
    env = os.environ | {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([*([str(src.resolve())] if src else []), str(directory)]),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    command += ["-n", workers] if workers != "0" else []
    command += ["-k", select] if select else []
    subprocess.run(command, cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes: dict[str, dict[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            lines = [ln for ln in (problem.get("message") or problem.text or "").splitlines() if ln.strip()]
            outcomes[name] = {"outcome": "failed", "error": lines[0][:300] if lines else ""}
        elif case.find("skipped") is not None:
            outcomes[name] = {"outcome": "skipped", "error": ""}
        else:
            outcomes[name] = {"outcome": "passed", "error": ""}
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-tests", type=Path, required=True, help="a TRL checkout's tests/ directory")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/grpokit-trl-suite"))
    parser.add_argument("--against", choices=("trl", "grpokit", "both"), default="both")
    parser.add_argument("-k", dest="select", help="pytest's -k, to run some of the tests")
    parser.add_argument("-n", dest="workers", default="2", help="pytest-xdist workers (0: none)")
    parser.add_argument(
        "--grpokit-src", type=Path, help="import grpokit from this src/ (a snapshot), not the installed one"
    )
    args = parser.parse_args()
    if ROOT in args.scratch.resolve().parents or args.scratch.resolve() == ROOT:
        raise SystemExit("--scratch must lie outside the project: TRL's tests are never copied into it")
    hf_home = args.scratch / "hf_home"
    if not (hf_home / "hub").is_dir():
        build_fixture(hf_home)
    results: dict[str, dict[str, dict[str, str]]] = {}
    if (args.scratch / "results.json").is_file():
        results = json.loads((args.scratch / "results.json").read_text())
    for against in ("trl", "grpokit") if args.against == "both" else (args.against,):
        shutil.rmtree(args.scratch / against, ignore_errors=True)
        directory = stage(args.trl_tests, args.scratch, against)
        results[against] = results.get(against, {}) | run(
            directory, hf_home, args.select, args.workers, args.grpokit_src
        )
    (args.scratch / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    summarise(results)


def summarise(results: dict[str, dict[str, dict[str, str]]]) -> None:
    trl, ours = results.get("trl", {}), results.get("grpokit", {})
    passing = sorted(name for name, r in trl.items() if r["outcome"] == "passed")
    for side, outcomes in (("TRL", trl), ("grpokit", ours)):
        counts = {
            k: sum(r["outcome"] == k for r in outcomes.values()) for k in ("passed", "failed", "skipped")
        }
        print(f"{side}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if not (trl and ours):
        return
    both = [name for name in passing if ours.get(name, {}).get("outcome") == "passed"]
    print(
        f"of the {len(passing)} tests that pass with TRL, {len(both)} pass with grpokit "
        f"({100 * len(both) / max(len(passing), 1):.1f}%)"
    )
    for name in passing:
        if name not in both:
            error = re.sub(r"\s+", " ", ours.get(name, {}).get("error", "not run"))
            print(f"  {name}: {error[:200]}")


if __name__ == "__main__":
    main()
