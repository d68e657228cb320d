"""Registers every YAML file shipped in ``clipkit.recipes`` (the repository's recipes/)."""

from __future__ import annotations

import copy
import functools
from importlib import resources

from clipkit.contract.hookspecs import hookimpl


def read_recipe_file(resource) -> dict:
    """The recipe file as a plain dict; a fresh copy each call (callers amend it)."""
    return copy.deepcopy(parse_recipe_text(resource.read_text(encoding="utf-8")))


@functools.lru_cache(maxsize=64)
def parse_recipe_text(text: str) -> dict:
    """YAML text -> dict, once per distinct text: OmegaConf's YAML parse costs ~50 ms for a recipe
    file, and a process resolves recipes many times (validate, train, the variants of one file).
    Keyed by the text itself, so an edited file is parsed anew."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(text))


@hookimpl
def register_recipes(register):
    for resource in sorted(resources.files("clipkit.recipes").iterdir(), key=lambda r: r.name):
        if resource.name.endswith(".yaml"):
            register(resource.name[: -len(".yaml")], functools.partial(read_recipe_file, resource))
