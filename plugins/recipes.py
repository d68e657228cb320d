"""Registers every YAML file shipped in ``clipkit.recipes`` (the repository's recipes/)."""

from __future__ import annotations

import functools
from importlib import resources

from clipkit.contract.hookspecs import hookimpl


def read_recipe_file(resource) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(resource.read_text(encoding="utf-8")))


@hookimpl
def register_recipes(register):
    for resource in sorted(resources.files("clipkit.recipes").iterdir(), key=lambda r: r.name):
        if resource.name.endswith(".yaml"):
            register(resource.name[: -len(".yaml")], functools.partial(read_recipe_file, resource))
