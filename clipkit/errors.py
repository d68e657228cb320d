"""Errors clipkit reports to users (the CLI prints them without a traceback)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any


class ClipkitError(Exception):
    """An error whose message is meant for the user (exit code 2 from the CLI)."""


class PluginError(ClipkitError):
    """A plugin misbehaved: duplicate names, bad registrations."""


class UnknownNameError(ClipkitError, KeyError):
    """A recipe or command named a plugin that is not registered."""

    def __init__(self, kind: str, name: str, known: Iterable[str], where: str = "") -> None:
        known = sorted(known)
        self.kind, self.name, self.suggestions = kind, name, close_matches(name, known)
        hint = f" Did you mean: {', '.join(self.suggestions)}?" if self.suggestions else ""
        location = f"{where}: " if where else ""
        listing = ", ".join(known) or "(none)"
        message = f"{location}unknown {kind} {name!r}.{hint} Known {plural(kind)}: {listing}."
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class RecipeError(ClipkitError):
    """A recipe failed validation; ``errors`` lists every problem as 'key.path: message'.

    ``recipe`` is what the user named: ``NAME[@VARIANT]``, or a YAML file's path (then named as
    the file, not by its stem)."""

    def __init__(self, recipe: str, errors: list[str]) -> None:
        self.recipe, self.errors = recipe, errors
        lines = "\n".join(f"  - {e}" for e in errors)
        is_file = recipe.partition("@")[0].endswith((".yaml", ".yml"))
        what = f"recipe file {recipe}" if is_file else f"recipe {recipe!r}"
        super().__init__(f"{what} has {len(errors)} error(s):\n{lines}")


class SlotArgumentError(ClipkitError, ValueError):
    """A plugin's factory refused the arguments a recipe slot gave it (its ValueError, named with
    the slot); still a ValueError for code that catches the factory's own."""


class BatchRefusedError(ClipkitError, ValueError):
    """A loss or similarity refused a training batch (its ValueError, named with the plugin): e.g.
    meta-data its kernel reads that the batch does not carry; still a ValueError for code that
    catches the plugin's own."""


class DataError(ClipkitError):
    """Bad input data; the message names the file, key or sample."""


class ArtifactError(ClipkitError):
    """An export, checkpoint, manifest or recipe file cannot be read; names the file and what to do."""


class IntegrityError(ArtifactError):
    """A file's sha256 differs from the one recorded when it was written (damaged or edited)."""


class UnsafeCheckpointError(ArtifactError):
    """A checkpoint file holds Python objects that only unpickling (which can run code) would load."""


def plural(kind: str) -> str:
    return {"loss": "losses", "similarity": "similarities"}.get(kind, f"{kind}s")


def close_matches(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    return difflib.get_close_matches(name, list(known), n=n, cutoff=0.5)


def choice_error(value: Any, choices: Iterable[Any]) -> str | None:
    """The one wording of "not one of the choices" (None when ``value`` is one); a bool is not
    taken for 1 or 0 unless the choices hold bools."""
    choices = tuple(choices)
    bool_allowed = any(isinstance(choice, bool) for choice in choices)
    if value in choices and (bool_allowed or not isinstance(value, bool)):
        return None
    return f"must be one of {', '.join(map(str, choices))}, got {value!r}"


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices`` (for factories' argument checks)."""
    message = choice_error(value, choices)
    if message:
        raise ValueError(f"{name} {message}")


#: Schemes of network locations, whose query values may be signatures or session tokens (clipkit's
#: own source URIs — ``synthetic://shapes?n=8`` — carry settings, shown as they are).
NETWORK_SCHEMES = "https?|s3a?|gs|gcs|az|abfss?|hf|ftps?|sftp|webhdfs|wss?"
#: A network URL inside free text (a message, a ``pipe:`` command): up to whitespace or a quote.
URL_IN_TEXT = re.compile(rf"\b((?:{NETWORK_SCHEMES})://)([^\s'\"<>]*)", re.IGNORECASE)


def redact_text(text: str) -> str:
    """``text`` with every URL in it made safe to print: user info dropped, query values hidden
    (``?session=***``). The CLI's error boundary passes every message through it."""

    def hide(match: re.Match) -> str:
        scheme, rest = match.group(1), match.group(2)
        rest, hash_, fragment = rest.partition("#")
        address, question, query = rest.partition("?")
        host, slash, path = address.partition("/")
        host = host.rpartition("@")[2]
        if question:
            query = "&".join(f"{item.partition('=')[0]}=***" if item else "" for item in query.split("&"))
        return f"{scheme}{host}{slash}{path}{question}{query}{hash_}{fragment}"

    return URL_IN_TEXT.sub(hide, text)
