"""The config file and its JSON schema: read (refusing what YAML lets through), defaults filled in,
validated into one error that names the key and the fix.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from shardfuse.experiment.keys import SEED_LIMITS
from shardfuse.io import MAX_EXPANDED_VALUES, UserError, yaml_values

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "workflow" / "schemas" / "config.schema.yaml"


# YAML 1.1 (PyYAML) reads a number with an exponent as a float only with a dot and a signed exponent:
# 1e-8 and 1.0e8 are strings there, 1.0e-8 and 1.0e+8 are floats.
YAML_TEXT_EXPONENT = re.compile(r"^([-+]?\d+(?:\.\d*)?)[eE]([-+]?)(\d+)$")


class ConfigError(UserError):
    """The configuration is invalid; the message names the key and the fix."""


_PARSED_SCHEMAS: dict[tuple[str, int, int], dict[str, Any]] = {}


def load_schema(path: str | os.PathLike = SCHEMA_PATH) -> dict[str, Any]:
    """The schema, parsed once per version of its file (YAML parsing is most of a config check's time)
    and handed out as a copy: a caller that edits it edits its own."""
    stat = os.stat(path)
    key = (os.fspath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _PARSED_SCHEMAS:
        with open(path) as fh:  # libyaml's parser where PyYAML has it: the same safe loader, in C
            _PARSED_SCHEMAS[key] = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return copy.deepcopy(_PARSED_SCHEMAS[key])


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    key = error.absolute_path[-1] if error.absolute_path else None
    if error.validator == "maximum" and key in SEED_LIMITS:
        reason = "seeds are 64-bit integers" if "datasets" in error.absolute_path else SEED_LIMITS[key]
        return f"seed {error.instance} is too large; use a seed from 0 to {error.validator_value} ({reason})"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        close = difflib.get_close_matches(extra[0], allowed, n=1) if extra else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        hint += f"; valid keys: {', '.join(allowed)}" if allowed else ""
        return f"unknown key {', '.join(repr(k) for k in extra)}{hint}"
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {', '.join(map(str, error.validator_value))}"
    if error.validator == "oneOf" and _where(error) == "runs":
        return "must be a path to a TSV file or a mapping {run name: {key: value}}"
    exponent = YAML_TEXT_EXPONENT.match(error.instance) if isinstance(error.instance, str) else None
    if error.validator == "type" and exponent:
        mantissa, sign, digits = exponent.groups()
        written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{sign or '+'}{digits}"
        return f"{error.message} (YAML reads {error.instance} as text; write {written})"
    return error.message


def validate(instance: Any, schema: dict[str, Any], where: str, fix: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        # The deepest error is the most specific one (if/then and oneOf report on the parent first).
        error = max(errors, key=lambda e: len(e.absolute_path))
        location = _where(error)
        if location == "(top level)":
            prefix = where or location
        else:
            prefix = f"{where}.{location}" if where else location
        raise ConfigError(f"config error at {prefix}: {_describe(error)}; {fix}")


def _non_finite(value: Any, path: tuple = ()) -> tuple[tuple, float] | None:
    """The path and value of the first NaN or infinity in ``value`` (JSON Schema's number admits them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, (*path, key))
        if found:
            return found
    return None


def check_finite(instance: Any, where: str, fix: str) -> None:
    """YAML's .nan and .inf and a TSV cell's nan or inf are floats: refuse them, wherever they are."""
    found = _non_finite(instance)
    if found:
        path, value = found
        location = ".".join([where, *map(str, path)]) if where else ".".join(map(str, path))
        raise ConfigError(
            f"config error at {location}: {value} is not a finite number (NaN and infinity are not "
            f"allowed); {fix}"
        )


def with_defaults(instance: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    filled = dict(instance)
    for key, sub in schema.get("properties", {}).items():
        if key not in filled and "default" in sub:
            filled[key] = copy.deepcopy(sub["default"])
    return filled


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A config file (YAML or JSON) as a mapping, read strictly: a key written twice in one mapping
    (at any depth) and a tag such as ``!!python/object`` are errors naming the file, the key or tag
    and the line. Snakemake's own loader keeps the last of two equal keys without a word."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --configfile PATH") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path} ({exc}); check the file") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _check_nodes(root, path)
            _check_expansion(root, path)
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML ({reason}); fix the syntax") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"config file {path} holds a {type(config).__name__}, not a mapping of keys; see config/README.md"
        )
    return config


def _check_expansion(root: yaml.Node, path: str | os.PathLike) -> None:
    """Refuse a file whose aliases (``*name`` of an ``&name`` anchor) write out to more than
    :data:`MAX_EXPANDED_VALUES` values (a "billion laughs": nine aliases of nine aliases of ...), before
    anything walks or copies the expanded config. Counted over the node graph, each node once."""
    size = yaml_values(root)
    if size > MAX_EXPANDED_VALUES:
        raise ConfigError(
            f"config file {path} writes out to {size:,} values through its aliases (*name of an "
            f"&name anchor), more than {MAX_EXPANDED_VALUES:,}; write the values out or use fewer aliases"
        )


def _check_nodes(root: yaml.Node, path: str | os.PathLike) -> None:
    """Refuse a key that appears twice in one mapping and any tag the safe loader cannot build."""
    known = (set(yaml.SafeLoader.yaml_constructors) - {None}) | {"tag:yaml.org,2002:merge"}  # <<
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:  # an alias shares its anchor's node
            continue
        seen.add(id(node))
        line = node.start_mark.line + 1
        if node.tag not in known:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(
                f"config file {path} line {line} uses the YAML tag {tag}, which is not allowed; plain "
                "YAML only (mappings, lists, strings, numbers, true/false, null)"
            )
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                key_line = key_node.start_mark.line + 1
                _check_name_key(key_node, where, f"config file {path} line {key_line}")
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = (key_node.tag, key_node.value)
                    if key in first_lines:
                        inside = f" under {where}" if where else " at the top level"
                        raise ConfigError(
                            f"config file {path} line {key_line}: key {key_node.value!r} appears twice"
                            f"{inside} (first on line {first_lines[key]}); YAML would silently "
                            "keep only the second: merge them into one"
                        )
                    first_lines[key] = key_line
                child = f"{where}.{key_node.value}" if where else str(key_node.value)
                stack += [(key_node, where), (value_node, child)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{where}[{index}]") for index, item in enumerate(node.value)]


# The mappings whose keys are names (run and dataset names become directory names).
NAMED_MAPPINGS = {"runs": "run", "datasets": "dataset"}
STR_TAG = "tag:yaml.org,2002:str"


def _check_name_key(key_node: yaml.Node, where: str, at: str) -> None:
    """A run or dataset name YAML 1.1 reads as something else than text (unquoted 010 is the number
    8, yes is true, ~ is null): refused, naming what was written, as it cannot be told apart later."""
    kind = NAMED_MAPPINGS.get(where)
    if kind is None or not isinstance(key_node, yaml.ScalarNode) or key_node.tag == STR_TAG:
        return
    written = key_node.value
    value = yaml.safe_load(written)
    if isinstance(value, bool) or value is None:
        reading = "true" if value is True else "false" if value is False else "null"
    elif isinstance(value, (int, float)):
        reading = f"the number {value}"
    else:
        reading = f"a {type(value).__name__}"
    raise ConfigError(
        f"config error at {where}: {kind} name {value} is not a string: YAML reads unquoted {written} "
        f"as {reading} ({at}); quote it ('{written}')"
    )
