"""Datasets by name: a Hugging Face Hub dataset (`openai/gsm8k`) or a local directory laid out like
one (README.md whose YAML front matter lists `configs:` with their `data_files` per split), read with
`datasets.load_dataset` as the user's other tools read them.

Offline (HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1) a hub name is read from the Hugging Face cache:
the snapshot `hf download NAME --repo-type dataset` (or an earlier online `load_dataset`) left in
huggingface_hub's cache, else what `datasets` itself cached. (`datasets.load_dataset(NAME)` alone does
not look at the hub cache when offline, so the snapshot is found here and loaded as a directory.)

`datasets` is imported inside the functions: `import grpokit` stays fast.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import FILE_SUFFIXES, DataError

# a Hub repository id: NAME or OWNER/NAME (letters, digits, '-', '_', '.'; no '..', no leading '.')
_REPO_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_dataset_name(source: Any) -> bool:
    """Whether `source` names a dataset repository (a local directory, or a hub id) rather than a
    data file: a string or path that is a directory, or a hub id without a data file's suffix."""
    if not isinstance(source, (str, Path)):
        return False
    path = Path(source)
    if path.is_dir():
        return True
    if path.suffix.lower() in FILE_SUFFIXES or path.is_file() or isinstance(source, Path):
        return False
    return bool(_REPO_ID.match(str(source)))


def _offline() -> bool:
    import datasets.config
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)


def _not_cached(name: str) -> DataError:
    import datasets.config
    from huggingface_hub import constants

    return DataError(
        f"dataset {name!r} is not a local file or directory, and is not in the Hugging Face cache "
        f"(searched {constants.HF_HUB_CACHE} and {datasets.config.HF_DATASETS_CACHE}), and offline mode "
        f"(HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1) forbids downloading it; download it ahead with "
        f"`hf download {name} --repo-type dataset`, or unset HF_HUB_OFFLINE."
    )


def _cached_snapshot(name: str) -> str | None:
    """The directory of `name`'s snapshot (its refs/main revision) in huggingface_hub's cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def _configs(path: str) -> list[str]:
    import datasets

    try:
        return list(datasets.get_dataset_config_names(path))
    except Exception:  # noqa: BLE001 - only to enrich an error message; the caller's error stands
        return []


def load_dataset_dict(source: str | Path, config: str | None) -> tuple[Any, str]:
    """(`datasets.DatasetDict` of every split, how errors name it) of a dataset directory or hub name,
    with `config` (a `dataset_config`; None: the dataset's only or default one). One DataError when
    the dataset, or the config, is not there."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    name = str(source)
    path = name
    if not Path(name).is_dir() and _offline():
        path = _cached_snapshot(name) or name  # not in the hub cache: datasets' own cache, if there
    label = f"dataset {name!r}" if config is None else f"dataset {name!r} (config {config})"
    _refuse_script(path, name, label)
    try:
        loaded = datasets.load_dataset(path, config)
    except RuntimeError as error:  # a hub repository's loading script, found by `datasets` itself
        raise _scripted(error, label) from None
    except ValueError as error:  # a config that is not there, or none chosen among several
        configs = _configs(path)
        if configs and config not in configs:
            choose = f"has no config {config!r}" if config else "has several configs"
            raise DataError(
                f"dataset {name!r} {choose} (configs: {', '.join(configs)}); set dataset_config to one."
            ) from None
        raise DataError(f"{label}: {error}") from None
    except (ConnectionError, FileNotFoundError, DatasetNotFoundError) as error:
        if Path(name).is_dir():
            raise DataError(f"{name}: not readable as a dataset ({type(error).__name__}: {error}).") from None
        if _offline():
            raise _not_cached(name) from None
        raise DataError(
            f"dataset {name!r} is not a local file or directory, and the Hugging Face Hub did not give it "
            f"({type(error).__name__}: {error}); check the name, or download it ahead with "
            f"`hf download {name} --repo-type dataset`."
        ) from None
    return loaded, label


def _refuse_script(path: str, name: str, label: str) -> None:
    """A dataset directory that is a loading script: NAME.py in it, where `datasets` looks for one (in
    a hub snapshot, NAME is the repository's), is refused before `datasets` is asked."""
    for script in dict.fromkeys([Path(path) / f"{Path(path).name}.py", Path(path) / f"{Path(name).name}.py"]):
        if script.is_file():
            raise _script_refusal(label, script.name)


def _scripted(error: RuntimeError, label: str) -> Exception:
    """`datasets`' refusal of a loading script it found ("Dataset scripts are no longer supported, but
    found NAME.py") as grpokit's line; any other RuntimeError as it is."""
    if "scripts are no longer supported" not in str(error):
        return error
    return _script_refusal(label, str(error).rpartition(" ")[2] or "a .py file")


def _script_refusal(label: str, script: str) -> DataError:
    """A dataset given as a loading script (`NAME.py` beside, or instead of, its data): code that
    `datasets` no longer runs (since 4.0), and grpokit runs no dataset's code either."""
    return DataError(
        f"{label} holds a loading script ({script}), and grpokit does not run dataset scripts; convert "
        "the data to JSONL or Parquet files (the script's output, loaded once with datasets<4.0, saved by "
        ".to_json() or .to_parquet()) and give dataset=FILE or a directory of them."
    )


def split_rows(loaded: Any, label: str, split: str) -> list[dict[str, Any]]:
    """The rows of `split` of a loaded DatasetDict; a split that is not there is one DataError
    listing the splits there are."""
    if split not in loaded:
        raise DataError(
            f"{label} has no split {split!r} (splits: {', '.join(loaded) or 'none'}); "
            "set dataset_train_split / dataset_test_split to one of them."
        )
    return loaded[split].to_list()


def dataset_splits(source: str | Path, config: str | None) -> list[str]:
    """The split names of a dataset directory or hub name (with `config`); [] for anything else."""
    return list(load_dataset_dict(source, config)[0]) if is_dataset_name(source) else []
