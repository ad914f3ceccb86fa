"""The runs table (config/runs.tsv): one run per row, each cell read as its key's schema type."""

from __future__ import annotations

import csv
import difflib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError, read_text


def _coerce_cell(value: str, key: str, prop: dict[str, Any], where: str) -> Any:
    """Turn one TSV cell into the JSON type the schema expects for ``key``."""
    kind = prop.get("type") or ("string" if "enum" in prop else None)
    text = value.strip()
    if isinstance(kind, list):  # e.g. [integer, "null"]: a key that may also be null
        if "null" in kind and text.lower() in {"null", "none"}:
            return None
        # [number, array]: a merge parameter given as a gradient or filter list, a JSON cell
        kind = (
            "array"
            if "array" in kind and text.startswith("[")
            else next((k for k in kind if k != "null"), None)
        )
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            return float(text)
        if kind == "boolean":
            lowered = text.lower()
            if lowered in {"true", "yes", "1"}:
                return True
            if lowered in {"false", "no", "0"}:
                return False
            raise ValueError(text)
        if kind == "object":
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        if kind == "array":
            if text.startswith("["):
                return json.loads(text)
            item_kind = prop.get("items", {}).get("type")  # [number, array, object]: a number per rank
            item_kind = item_kind[0] if isinstance(item_kind, list) else item_kind
            item = {"integer": int, "string": str}.get(item_kind, float)
            return [item(part) for part in re.split(r"[,\s]+", text) if part]
    except (ValueError, json.JSONDecodeError):
        _refuse_decimal(text, key, kind, prop, where)
        raise ConfigError(
            f"config error at {where}.{key}: {text!r} is not a valid {kind}; "
            f"write e.g. {_example(kind)} in that cell"
        ) from None
    return text


def _refuse_decimal(text: str, key: str, kind: str | None, prop: dict[str, Any], where: str) -> None:
    """A decimal such as 2.5 where the column takes integers: say that the column expects integers."""
    items = prop.get("items", {}).get("type") if kind == "array" else None
    if kind != "integer" and items != "integer":
        return
    parts = [part for part in re.split(r"[,\s\[\]]+", text) if part] if items else [text]
    decimal = next((part for part in parts if _is_decimal(part)), None)
    if decimal is not None:
        expects = "a list of integers" if items else "an integer"
        raise ConfigError(
            f"config error at {where}.{key}: {decimal!r} is a decimal but column {key} expects {expects}; "
            f"write e.g. {_example(kind)} in that cell"
        )


def _is_decimal(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        try:
            float(text)
        except ValueError:
            return False
        return True
    return False


def _example(kind: str | None) -> str:
    examples = {
        "integer": "2",
        "number": "0.05",
        "boolean": "true",
        "array": "64,32",
        "object": '{"width": 32}',
    }
    return examples.get(kind or "", "a word")


def read_runs_table(path: str | os.PathLike, run_props: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Read the TSV experiment table: a `run` column plus any run keys; empty cells take the default."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config error at runs: runs table {path} does not exist; create it or point "
            "`runs:` at your TSV (paths are relative to the working directory)"
        )
    try:
        text = read_text(path, "save it as UTF-8 (spreadsheets: export as 'UTF-8 tab-separated')")
    except UserError as exc:
        raise ConfigError(f"config error at runs: {exc}") from None
    text = text.removeprefix("\ufeff")  # a leading byte-order mark (spreadsheets write one) is dropped
    # Comment and blank lines are left out; line_numbers maps what the reader sees to the file.
    numbered = [
        (number, line)
        for number, line in enumerate(io.StringIO(text, newline=""), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    line_numbers = [number for number, _ in numbered]
    reader = csv.DictReader([line for _, line in numbered], delimiter="\t")
    header = reader.fieldnames or []
    if "run" not in header:
        raise ConfigError(
            f"config error at runs: {path} has no `run` column; the first header cell must be "
            "`run` (columns are tab-separated)"
        )
    twice = sorted({col for col in header if header.count(col) > 1})
    if twice:
        raise ConfigError(
            f"config error at runs: column {twice[0]!r} appears more than once in the header of {path}; "
            "keep one column per key"
        )
    unknown = [col for col in header if col != "run" and col not in run_props]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(run_props), n=1)
        if close:
            raise ConfigError(
                f"config error at runs: {path} has unknown column {unknown[0]!r} (did you mean "
                f"{close[0]!r}?); rename the column"
            )
        raise ConfigError(
            f"config error at runs: {path} has unknown column {unknown[0]!r}; valid columns: "
            f"run, {', '.join(sorted(run_props))}"
        )
    runs: dict[str, dict[str, Any]] = {}
    last_line = reader.line_num
    for row in reader:
        line_no, last_line = line_numbers[last_line], reader.line_num  # the row's first line in the file
        name = (row.get("run") or "").strip()
        if None in row:
            raise ConfigError(
                f"config error at runs: {path} line {line_no} has more cells than the header; "
                "separate columns with single tabs"
            )
        if None in row.values():
            num_cells = sum(value is not None for value in row.values())
            raise ConfigError(
                f"config error at runs: {path} line {line_no} has {num_cells} cell(s) but the header has "
                f"{len(header)} columns; give every row one cell per column (an empty cell takes the "
                "default), separated by single tabs"
            )
        if name in runs:
            raise ConfigError(
                f"config error at runs: run {name!r} appears twice in {path}; run names must be unique"
            )
        where = f"runs[{name}]"
        runs[name] = {
            key: _coerce_cell(value, key, run_props[key], where)
            for key, value in row.items()
            if key != "run" and value.strip() != ""
        }
    if not runs:
        raise ConfigError(f"config error at runs: {path} has no rows; add one line per run below the header")
    return runs
