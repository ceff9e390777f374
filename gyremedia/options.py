"""Options are declared once, where they live: default, help, valid range, and checked before any model loads.

A component's options are a dataclass. Each field may be declared with :func:`option`, which records
its help string and its valid range (``gt``, ``ge``, ``lt``, ``le``, applied to each element of a
list) or a ``check`` callable; choices are ``typing.Literal`` annotations, which omegaconf enforces.
Constraints between fields go in a ``validate(self)`` method that raises :class:`OptionError`.
The config loader runs :func:`validate` on every options dataclass it builds, core sections and
third-party plugins alike, so a plugin gets the same one-line errors for free::

    @dataclass
    class MyRewardOptions:
        temperature: float = option(1.0, gt=0, help="softmax temperature of the scores")
        mode: Literal["mean", "max"] = option("mean", help="how crops are pooled")

        def validate(self) -> None:
            if self.mode == "max" and self.temperature != 1.0:
                raise OptionError("temperature", "only applies to mode=mean")
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable


class OptionError(ValueError):
    """A bad option value; ``key`` is the field name (dotted below nested options), ``message`` the fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass(frozen=True)
class Bounds:
    """An interval for a number (or for each number of a list)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def describe(self) -> str:
        """``> 0``, ``in (0, 1]``, ``>= 1``, ..."""
        low = (self.gt, "(") if self.gt is not None else (self.ge, "[") if self.ge is not None else None
        high = (self.lt, ")") if self.lt is not None else (self.le, "]") if self.le is not None else None
        if low and high:
            return f"in {low[1]}{_number(low[0])}, {_number(high[0])}{high[1]}"
        if low:
            return f"{'>' if low[1] == '(' else '>='} {_number(low[0])}"
        if high is None:
            return "any number"
        return f"{'<' if high[1] == ')' else '<='} {_number(high[0])}"


def _number(value: float) -> str:
    return f"{value:g}"


def option(
    default: Any = MISSING,
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    help: str = "",
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    check: Callable[[Any], str | None] | None = None,
    hint: str | None = None,
    owner: str | None = None,
) -> Any:
    """A dataclass field with its help string and its constraints.

    ``gt``/``ge``/``lt``/``le`` bound a number (each element of a list of numbers; ``None`` values
    are always allowed). ``check(value)`` returns an error message, or ``None`` when the value is
    fine (file existence, formats). ``hint`` is added to a wrong-type error (what to write instead).
    ``owner``: the plugin that reads this core key (a feature); set while that plugin is not loaded, it is refused.
    """
    bounds = Bounds(gt, ge, lt, le) if any(b is not None for b in (gt, ge, lt, le)) else None
    metadata = {"help": help, "bounds": bounds, "check": check, "hint": hint, "owner": owner}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def field_hint(schema: type, name: str) -> str | None:
    """What to write instead when a field gets a value of the wrong type (``option(hint=...)``)."""
    for f in dataclasses.fields(schema):
        if f.name == name:
            return f.metadata.get("hint")
    return None


def nested_schema(schema: type, dotted: str) -> tuple[type, str] | None:
    """The dataclass that declares the field at ``dotted`` (below ``schema``) and the field's name."""
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            return None
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return None
        schema = hints[part]
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return schema, parts[-1]
    return None


def validate(options: Any, prefix: str = "") -> list[str]:
    """Errors of an options dataclass instance (and the dataclasses nested in it), one line each.

    Each names the key with ``prefix``, the bad value and the valid range. A class's own
    ``validate()`` runs only once its fields are each in range.
    """
    if options is None or not dataclasses.is_dataclass(options):
        return []
    errors: list[str] = []
    hints = typing.get_type_hints(type(options))
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        key = f"{prefix}{f.name}"
        choices = typing.get_args(hints.get(f.name)) if typing.get_origin(hints.get(f.name)) is typing.Literal else None
        if choices and value not in choices:
            errors.append(f"{key}={value!r}: expected one of {', '.join(str(c) for c in choices)}")
            continue
        if dataclasses.is_dataclass(value):
            errors += validate(value, key + ".")
            continue
        if isinstance(value, (list, tuple)) and value and all(dataclasses.is_dataclass(v) for v in value):
            for i, item in enumerate(value):
                errors += validate(item, f"{key}.{i}.")
            continue
        errors += _field_errors(f, value, key)
    own = getattr(options, "validate", None)
    if not errors and callable(own):
        try:
            own()
        except OptionError as exc:
            value = _lookup(options, exc.key)
            shown = f"={value!r}" if value is not _ABSENT else ""
            errors.append(f"{prefix}{exc.key}{shown}: {exc.message}")
    return errors


_ABSENT = object()


def _lookup(options: Any, dotted: str) -> Any:
    node = options
    for part in dotted.split("."):
        if not hasattr(node, part):
            return _ABSENT
        node = getattr(node, part)
    return node


def _field_errors(f: dataclasses.Field, value: Any, key: str) -> list[str]:
    bounds: Bounds | None = f.metadata.get("bounds")
    check = f.metadata.get("check")
    help_text = f.metadata.get("help")
    about = f" — {help_text}" if help_text else ""
    if bounds is not None and value is not None:
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                continue  # omegaconf has checked the type
            if not bounds.contains(item):
                where = f" (element {item!r})" if isinstance(value, (list, tuple)) else ""
                return [f"{key}={value!r}{where}: must be {bounds.describe()}{about}"]
    if check is not None and value is not None:
        message = check(value)
        if message:
            return [f"{key}={value!r}: {message}"]
    return []


# --------------------------------------------------------------------------- reusable checks


def prompts_file(value: str) -> str | None:
    """A text file with one prompt per line, at least one of them not blank; or a file of records (its records
    are read with the run's prompt column, when the whole config is checked)."""
    from pathlib import Path

    from gyremedia.data import RECORD_SUFFIXES, PromptFileError, read_prompts

    if not Path(value).expanduser().is_file():
        return f"no such file: give a text file with one prompt per line, or a {', '.join(RECORD_SUFFIXES)} file"
    if Path(value).suffix.lower() in RECORD_SUFFIXES:
        return None
    try:
        prompts = read_prompts(value)
    except PromptFileError as exc:
        return str(exc)
    return None if prompts else "the file holds no prompt (it is empty or blank): write one prompt per line"


def regular_expression(value: str) -> str | None:
    """A pattern ``re`` compiles."""
    import re

    try:
        re.compile(value)
    except re.error as exc:
        return f"not a regular expression: {exc}"
    return None


def existing_folder(what: str) -> Callable[[str], str | None]:
    """A check that the value is a folder that exists; ``what`` says what a valid one is."""

    def check(value: str) -> str | None:
        from pathlib import Path

        return None if Path(value).expanduser().is_dir() else f"no such folder: give {what}"

    return check


#: How a hub id looks: ``organisation/name``.
_HUB_ID = r"[A-Za-z0-9][\w.-]*/[\w.-]+"


def pretrained_source(value: str) -> str | None:
    """A local model folder, or a hub id ``org/name`` (which must be in the local cache when offline).

    Checked without network access, so a run that cannot load its model fails before loading anything.
    """
    import os
    import re
    from pathlib import Path

    path = Path(value).expanduser()
    if path.is_dir():
        return None
    example = "a local model folder, or a hub id like 'stabilityai/stable-diffusion-3.5-medium'"
    if path.exists():
        return f"is a file; give the folder that holds the model: {example}"
    if value.startswith((".", "/", "~")) or os.sep != "/" and os.sep in value or not re.fullmatch(_HUB_ID, value):
        return f"no such folder: give {example}"
    from huggingface_hub import is_offline_mode, snapshot_download

    if is_offline_mode():
        try:
            snapshot_download(value, local_files_only=True)
        except Exception:  # noqa: BLE001 - any miss means the same to the user
            return (
                f"no folder of that name here, and the hub id is not in the local cache while the run is offline "
                f"(HF_HUB_OFFLINE=1): download it once (`hf download {value}`) or give {example}"
            )
    return None
