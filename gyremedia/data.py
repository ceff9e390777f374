"""Prompts as records, and which of them a step trains on: a deterministic function of (seed, step), the same on
every rank.

A prompt is a record: its text plus any fields (GenEval's metadata, the text an OCR reward should read, an
answer). :class:`Prompt` is a ``str`` with a ``fields`` mapping, so everything that takes prompts as strings
(the backbones' text encoders, rewards written for ``__call__(media, prompts)``) keeps working, and a reward that
wants ground truth reads ``prompt.fields`` instead of parsing it out of the text. Records come from a text file
(one prompt per line, no fields), a jsonl, json, csv or parquet file, or a Hugging Face dataset.
"""

from __future__ import annotations

import csv
import functools
import io
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gyremedia.runtime.streams import Stream, stream_rng

RECORD_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class Prompt(str):
    """A prompt's text (this ``str``) and its record's other fields (``fields``, read-only)."""

    fields: Mapping[str, Any]

    def __new__(cls, text: str, fields: Mapping[str, Any] | None = None) -> Prompt:
        prompt = super().__new__(cls, text)
        prompt.fields = MappingProxyType(dict(fields or {}))
        return prompt

    def __reduce__(self):  # pickled (a process pool, a gather across ranks) with its fields
        return Prompt, (str(self), dict(self.fields))


def prompt_fields(prompt: str) -> Mapping[str, Any]:
    """The fields of ``prompt`` (none for a plain string)."""
    return getattr(prompt, "fields", MappingProxyType({}))


class PromptFileError(ValueError):
    """A prompts file cannot be read: the message names the file's problem (the line, the column) and the fix."""


def _text(data: bytes) -> str:
    """Strict UTF-8 (a byte-order mark is tolerated and dropped): text decoded wrongly would train on prompts
    nobody wrote, so anything else raises naming the line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data[:start].count(b"\n") + 1
        column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise PromptFileError(
            f"line {line} is not UTF-8 (byte 0x{data[start]:02x} at column {column}): save the file "
            "as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from exc


def records_to_prompts(rows: list[Any], column: str, where: str) -> list[Prompt]:
    """Records (mappings with the text under ``column``; a plain string is a record with no fields) as prompts.
    ``where`` names the rows in an error (``line``, ``row``)."""
    prompts = []
    for number, row in enumerate(rows, start=1):
        if isinstance(row, str):
            row = {column: row}
        if not isinstance(row, Mapping):
            raise PromptFileError(
                f"{where} {number} is a {type(row).__name__}, not a record: write one object per "
                f"{where} with the prompt under {column!r}"
            )
        text = row.get(column)
        if not isinstance(text, str):
            fields = ", ".join(map(repr, row)) or "none"
            raise PromptFileError(
                f"{where} {number} has no text under {column!r} (its fields: {fields}): set "
                "data.prompt_column to the field that holds the prompt"
            )
        if text.strip():
            prompts.append(Prompt(text.strip(), {k: v for k, v in row.items() if k != column}))
    return prompts


def read_prompts(path: str, column: str = "prompt") -> list[Prompt]:
    """The prompts of a file, by its suffix: ``.jsonl`` (one JSON object per line), ``.json`` (a list of
    objects or strings), ``.csv`` (a header row), ``.parquet``, each record's text under ``column``; any other
    suffix is text, one prompt per line (blank lines skipped, each stripped).

    Read once while the file is unchanged: the config check, the trainer and every evaluation share the reading."""
    try:
        file = Path(path).expanduser()
        stat = file.stat()
    except OSError as exc:
        raise _unreadable(exc) from exc
    return list(_read_prompts(str(file), column, stat.st_mtime_ns, stat.st_size))


def _unreadable(exc: OSError) -> PromptFileError:
    return PromptFileError(
        f"cannot be read ({exc.strerror or exc}): give a text file with one prompt per line, "
        f"or a {', '.join(RECORD_SUFFIXES)} file of records"
    )


@functools.lru_cache(maxsize=16)
def _read_prompts(path: str, column: str, modified: int, size: int) -> tuple[Prompt, ...]:
    """:func:`read_prompts` of one version of the file (``modified`` and ``size`` tell versions apart)."""
    return tuple(_parse_prompts(path, column))


def _parse_prompts(path: str, column: str) -> list[Prompt]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise _unreadable(exc) from exc
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet

        return records_to_prompts(pyarrow.parquet.read_table(io.BytesIO(data)).to_pylist(), column, "row")
    text = _text(data)
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise PromptFileError(f"line {number} is not JSON ({exc.msg}): write one object per line") from exc
        return records_to_prompts(rows, column, "line")
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"is not JSON ({exc.msg} at line {exc.lineno}): write a list of records") from exc
        if not isinstance(rows, list):
            raise PromptFileError("holds a JSON object, not a list: write a list of records (or use .jsonl)")
        return records_to_prompts(rows, column, "item")
    if suffix == ".csv":
        return records_to_prompts(list(csv.DictReader(io.StringIO(text))), column, "row")
    return [Prompt(line.strip()) for line in text.splitlines() if line.strip()]


def read_dataset(source: str, split: str, column: str) -> list[Prompt]:
    """A Hugging Face dataset's split as prompts: a folder written by ``Dataset.save_to_disk``, or anything
    ``datasets.load_dataset`` takes (a hub id, a folder of data files). Needs ``pip install gyremedia[data]``.
    Read once per process, as :func:`read_prompts`."""
    return list(_read_dataset(source, split, column))


@functools.lru_cache(maxsize=8)
def _read_dataset(source: str, split: str, column: str) -> tuple[Prompt, ...]:
    try:
        import datasets
    except ImportError as exc:
        raise PromptFileError("needs the datasets package: pip install 'gyremedia[data]'") from exc
    folder = Path(source).expanduser()
    if (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise PromptFileError(f"has no split {split!r} (it has {', '.join(loaded)}): set the split")
            loaded = loaded[split]
    else:
        loaded = datasets.load_dataset(source, split=split)
    if column not in loaded.column_names:
        raise PromptFileError(
            f"has no column {column!r} (its columns: {', '.join(loaded.column_names)}): set "
            "data.prompt_column to the column that holds the prompt"
        )
    return tuple(records_to_prompts(loaded.to_list(), column, "row"))


class PromptSource:
    """Draws each step's prompt groups from a fixed list of prompts."""

    def __init__(
        self,
        prompts: list[str],
        prompts_file: str | None = None,
        column: str = "prompt",
        dataset: str | None = None,
        split: str = "train",
    ) -> None:
        self.prompts = [p if isinstance(p, Prompt) else Prompt(p) for p in prompts]
        if prompts_file:
            self.prompts += read_prompts(prompts_file, column)
        if dataset:
            self.prompts += read_dataset(dataset, split, column)
        if not self.prompts:
            raise ValueError("no prompts: set data.prompts, data.prompts_file or data.dataset")

    def groups_for_step(self, seed: int, step: int, num_groups: int) -> list[Prompt]:
        """``num_groups`` prompts for ``step``: without repetition while the list is long enough."""
        rng = stream_rng(seed, step, Stream.PROMPTS)
        replace = num_groups > len(self.prompts)
        picks = rng.choice(len(self.prompts), size=num_groups, replace=replace)
        return [self.prompts[i] for i in picks]
