"""Reading JSON and YAML files users hand to clipkit, with one kind of error for every failure.

Every problem — missing, unreadable, not UTF-8, empty, a syntax error (with line and column), the
wrong kind of document — becomes an :class:`~clipkit.errors.ArtifactError` naming the file, what is
wrong and what to do, which the CLI prints without a traceback (exit code 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clipkit.errors import ArtifactError


def read_text(path: Path, what: str, advice: str = "") -> str:
    """A UTF-8 text file, or an error naming it."""
    path = Path(path)
    tail = f"; {advice}" if advice else ""
    if not path.is_file():
        raise ArtifactError(f"{path}: {what} is missing{tail}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ArtifactError(f"{path}: {what} is not UTF-8 text (byte {error.start}){tail}") from error
    except OSError as error:
        raise ArtifactError(f"{path}: cannot read {what} ({error.strerror or error}){tail}") from error


def read_json(path: Path, what: str, advice: str = "", *, expect: type | tuple[type, ...] = object) -> Any:
    """The one reader of JSON artifacts (reports, their index, results, metadata, manifests): the
    parsed value, or an :class:`ArtifactError` line naming the file and what is wrong — missing,
    unreadable, not UTF-8, empty, not JSON (line and column), or a top level other than ``expect``.
    Values inside are checked by the caller with :func:`json_problem` / :func:`require`."""
    text = read_text(path, what, advice)
    tail = f"; {advice}" if advice else ""
    if not text.strip():
        raise ArtifactError(f"{path}: {what} is empty{tail}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ArtifactError(
            f"{path}: {what} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}){tail}"
        ) from error
    except (ValueError, RecursionError) as error:  # absurd nesting, numbers beyond int conversion
        raise ArtifactError(f"{path}: {what} cannot be parsed ({one_line(error)}){tail}") from error
    if expect is not object and not isinstance(value, expect):
        raise ArtifactError(
            f"{path}: {what} holds a JSON {json_type(value)}, expected {json_kind(expect)}{tail}"
        )
    return value


def read_json_object(path: Path, what: str, advice: str = "") -> dict[str, Any]:
    """A JSON file whose top level is an object."""
    return read_json(path, what, advice, expect=dict)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (object, array, string, number, true/false, null)."""
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def json_kind(expect: type | tuple[type, ...]) -> str:
    kinds = expect if isinstance(expect, tuple) else (expect,)
    names = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return " or ".join(dict.fromkeys(names.get(kind, kind.__name__) for kind in kinds))


def require(
    value: Any, key: str, expect: type | tuple[type, ...], path: Path, what: str, advice: str = ""
) -> Any:
    """``value`` (the entry ``key`` of a JSON artifact) when it is of type ``expect`` (a bool is
    never a number), else an ArtifactError naming the file and the key."""
    kinds = expect if isinstance(expect, tuple) else (expect,)
    wrong_bool = isinstance(value, bool) and bool not in kinds
    if wrong_bool or not isinstance(value, kinds):
        tail = f"; {advice}" if advice else ""
        raise ArtifactError(
            f"{path}: {what}: `{key}` must be {json_kind(expect)}, got a JSON {json_type(value)}{tail}"
        )
    return value


def read_yaml_mapping(path: Path, what: str = "recipe file", advice: str = "") -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping), as a plain dict.

    Interpolations (``${...}``) are kept unresolved; they are resolved with the overrides applied.
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    text = read_text(path, what, advice)
    tail = f"; {advice}" if advice else ""
    try:
        loaded = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except yaml.MarkedYAMLError as error:
        raise ArtifactError(f"{path}: {what} is not valid YAML ({yaml_problem(error)}){tail}") from error
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ArtifactError(f"{path}: {what} cannot be read ({one_line(error)}){tail}") from error
    if not OmegaConf.is_dict(loaded):
        kind = "list" if OmegaConf.is_list(loaded) else type(loaded).__name__
        raise ArtifactError(f"{path}: {what} is a YAML {kind}; expected a mapping (key: value lines){tail}")
    return OmegaConf.to_container(loaded, resolve=False)


def read_safetensors(path: Path, what: str = "weights file", advice: str = "") -> dict[str, Any]:
    """The tensors of a ``.safetensors`` file ({name: tensor}), or an ArtifactError line naming it:
    missing, truncated, a header that is not JSON or absurdly long, an unknown dtype, a shape the
    bytes do not hold — whatever safetensors (a Rust library with its own error type) says."""
    from safetensors.torch import load_file

    path = Path(path)
    tail = f"; {advice}" if advice else ""
    if not path.is_file():
        raise ArtifactError(f"{path}: {what} is missing{tail}")
    try:
        return load_file(str(path))
    except Exception as error:  # noqa: BLE001 - SafetensorError, OSError, MemoryError's kin, ValueError
        raise ArtifactError(
            f"{path}: {what} is not a readable safetensors file ({one_line(error)}){tail}"
        ) from None


def safetensors_metadata(path: Path, what: str = "weights file") -> dict[str, str]:
    """The ``__metadata__`` of a ``.safetensors`` header ({} when it has none), or an ArtifactError."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except Exception as error:  # noqa: BLE001 - as read_safetensors
        raise ArtifactError(
            f"{path}: {what} is not a readable safetensors file ({one_line(error)})"
        ) from None


def yaml_problem(error, column_offset: int = 0) -> str:
    """'line L, column C: problem' from a PyYAML error (its marks count from 0)."""
    mark = error.problem_mark or error.context_mark
    problem = error.problem or error.context or "syntax error"
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1 + column_offset}: {problem}"


def one_line(error: Exception) -> str:
    """The gist of an error: its first line, or two when the first only introduces a list."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
