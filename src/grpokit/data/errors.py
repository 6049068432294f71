"""What every data module shares without importing the others: the error type and the file suffixes
that are read as files (anything else may name a hub dataset or a dataset directory)."""

from __future__ import annotations

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")  # prompts.READERS has one reader each (tested)


class DataError(ValueError):
    """The prompt data cannot be used; the message names the file, row or column and the fix."""
