"""The one plugin manager: built-ins and entry points, loaded through the same hooks."""

from __future__ import annotations

import importlib
import os

import pluggy

from clipkit.contract import hookspecs

#: Built-in plugin modules, registered exactly like third-party plugins.
BUILTIN_PLUGINS = (
    "clipkit.plugins.encoders",
    "clipkit.plugins.tokenizers",
    "clipkit.plugins.similarities",
    "clipkit.plugins.losses",
    "clipkit.plugins.optim",
    "clipkit.plugins.evals",
    "clipkit.plugins.sources",
    "clipkit.plugins.loggers",
    "clipkit.plugins.loggers.progress_log",
    "clipkit.plugins.loggers.trackers",
    "clipkit.plugins.recipes",
    "clipkit.plugins.experiments",
    "clipkit.plugins.interop",
)

AUTOLOAD_ENV = "CLIPKIT_DISABLE_PLUGIN_AUTOLOAD"


def autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


def make_plugin_manager(*, autoload: bool | None = None, extra_plugins=()) -> pluggy.PluginManager:
    """Build a fresh manager: built-ins, then ``clipkit`` entry points (unless disabled), then
    ``extra_plugins`` (modules or objects, handy in tests). ``check_pending`` turns a
    misspelled hook name in any plugin into an error instead of a silently ignored function.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if autoload is None:
        autoload = not autoload_disabled()
    if autoload:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    for plugin in extra_plugins:
        pm.register(plugin, name=plugin_label(plugin))
    pm.check_pending()
    return pm


def plugin_label(plugin) -> str:
    """A readable name for a plugin object: its module name, or its class's qualified name."""
    if isinstance(plugin, type(os)):
        return plugin.__name__
    return f"{type(plugin).__module__}.{type(plugin).__qualname__}"


def plugin_distribution(pm: pluggy.PluginManager, plugin) -> tuple[str, str]:
    """(distribution name, version) that provided ``plugin``; built-ins report clipkit's."""
    for dist_plugin, dist in pm.list_plugin_distinfo():
        if dist_plugin is plugin:
            return dist.project_name, dist.version
    name = pm.get_name(plugin) or ""
    if name.startswith("clipkit."):
        from clipkit import DISTRIBUTION, __version__

        return DISTRIBUTION, __version__
    return "(not installed)", ""
