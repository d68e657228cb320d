"""Where the modules of clipkit's root went when it was grouped into rooms (docs/architecture.md):
the old import paths keep working for this release through an import alias (the same module
object, so patching one patches the other). The plugin contract's public paths — ``clipkit.types``,
``clipkit.testing``, ``clipkit.hookspecs`` — are kept for good; the others warn once
(DeprecationWarning) and go in a later release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: Old dotted path -> where the module lives now.
MOVED = {
    "clipkit.hookspecs": "clipkit.contract.hookspecs",
    "clipkit.manager": "clipkit.contract.manager",
    "clipkit.registry": "clipkit.contract.registry",
    "clipkit.types": "clipkit.contract.types",
    "clipkit.testing": "clipkit.contract.testing",
    "clipkit.recipe": "clipkit.config.recipe",
    "clipkit.settings_schema": "clipkit.config.settings_schema",
    "clipkit.constraints": "clipkit.config.constraints",
    "clipkit.machine": "clipkit.config.machine",
    "clipkit.export": "clipkit.artifacts.export",
    "clipkit.export_reader": "clipkit.artifacts.reader",
    "clipkit.integrity": "clipkit.artifacts.integrity",
    "clipkit.io": "clipkit.artifacts.io",
    "clipkit.safe_load": "clipkit.artifacts.safe_load",
    "clipkit.dotted": "clipkit.config.dotted",
    "clipkit.loading": "clipkit.artifacts.loading",
    "clipkit.cli": "clipkit.app.cli",
    "clipkit.api": "clipkit.app.api",
    "clipkit.commands": "clipkit.app.commands",
    "clipkit.own_data": "clipkit.app.own_data",
    "clipkit.run_length": "clipkit.app.run_length",
    "clipkit.watch": "clipkit.app.watch",
    "clipkit.quiet": "clipkit.app.quiet",
    "clipkit.init_weights": "clipkit.model.init_weights",
}
#: Old paths that are the documented plugin API: aliased without a warning.
PUBLIC = ("clipkit.types", "clipkit.testing", "clipkit.hookspecs")


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__  # the import system overwrites it with the alias's spec
        return module

    def exec_module(self, module) -> None:
        """The target ran its own code when imported; give it back its own spec."""
        module.__spec__ = self.own_spec


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old path of :data:`MOVED` as an alias of the module's new home."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        if fullname not in PUBLIC:
            warnings.warn(
                f"{fullname} moved to {new}; the old path goes in a later release",
                DeprecationWarning,
                stacklevel=2,
            )
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the alias finder at the end of ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
