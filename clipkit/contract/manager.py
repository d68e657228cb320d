"""The one plugin manager: built-ins and entry points, loaded through the same hooks."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys

import pluggy

from clipkit.contract import hookspecs
from clipkit.errors import PluginError, close_matches

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
    loaded = import_entry_points(pm) if autoload else {}
    try:
        if autoload:
            pm.load_setuptools_entrypoints(hookspecs.PROJECT)  # the modules imported above
        for plugin in extra_plugins:
            pm.register(plugin, name=plugin_label(plugin))
        pm.check_pending()
    except pluggy.PluginValidationError as error:
        raise invalid_plugin(pm, error, loaded) from None
    warn_unmarked_hooks(pm, loaded)
    return pm


def warn_unmarked_hooks(pm: pluggy.PluginManager, loaded: dict[int, str]) -> None:
    """One ``warning:`` line per function of a registered plugin named like a clipkit hook but not
    marked ``@hookimpl``: pluggy registers only marked functions, so such a hook (say a
    ``register_losses`` whose decorator was forgotten) was silently never called, and its names
    were unknown to every recipe. ``loaded``: entry-point descriptions, as for :func:`invalid_plugin`."""
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        where = loaded.get(id(plugin)) or f"plugin {name!r}"
        for hook in unmarked_hooks(pm, plugin):
            print(
                f"warning: {where} defines {hook}() without @hookimpl, so clipkit never calls it; "
                "decorate it with @clipkit.hookimpl (from clipkit.contract.hookspecs import hookimpl)",
                file=sys.stderr,
            )


def unmarked_hooks(pm: pluggy.PluginManager, plugin) -> list[str]:
    """The clipkit hook names ``plugin`` has as callables that pluggy does not take as its hooks."""
    unmarked = []
    for hook, caller in sorted(vars(pm.hook).items()):
        if hook.startswith("_") or not caller.has_spec():
            continue
        try:
            function = getattr(plugin, hook, None)
        except Exception:  # noqa: BLE001 - a plugin object's property raising: not a hook either way
            continue
        if callable(function) and pm.parse_hookimpl_opts(plugin, hook) is None:
            unmarked.append(hook)
    return unmarked


def import_entry_points(pm: pluggy.PluginManager) -> dict[int, str]:
    """Import the module of every ``clipkit`` entry point not yet registered, as pluggy's
    ``load_setuptools_entrypoints`` then does, so that one which fails to import (ImportError,
    SyntaxError, any exception at import) is a :class:`PluginError` naming the entry point and its
    distribution instead of a traceback. Returns ``id(plugin) ->`` that description."""
    loaded: dict[int, str] = {}
    for dist in importlib.metadata.distributions():
        for entry_point in dist.entry_points:
            if entry_point.group != hookspecs.PROJECT or pm.has_plugin(entry_point.name):
                continue
            where = entry_point_label(entry_point, dist)
            try:
                plugin = entry_point.load()
            except Exception as error:
                raise PluginError(f"{where} cannot be loaded: {error_line(error)}; {REMEDY}") from error
            loaded[id(plugin)] = where
    return loaded


#: What a user does about a third-party plugin that cannot be loaded.
REMEDY = f"fix or uninstall that package, or set {AUTOLOAD_ENV}=1 to run with the built-in plugins only"


def entry_point_label(entry_point: importlib.metadata.EntryPoint, dist) -> str:
    """``plugin 'name' (entry point name = module in distribution version)`` for messages."""
    package = f"{dist.metadata['Name']} {dist.version}"
    return f"plugin {entry_point.name!r} (entry point {entry_point.name} = {entry_point.value} in {package})"


def error_line(error: BaseException) -> str:
    """``TypeName: first line of the message`` (the name alone when the message is empty)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def invalid_plugin(
    pm: pluggy.PluginManager, error: pluggy.PluginValidationError, loaded: dict
) -> PluginError:
    """pluggy's refusal of a plugin (a misspelled hook name, a hook with arguments its
    specification does not have) as one line naming the plugin and its package; a misspelled
    name gets the closest hook name."""
    name = pm.get_name(error.plugin) or plugin_label(error.plugin)
    where = loaded.get(id(error.plugin)) or f"plugin {name!r}"
    unknown = re.match(r"unknown hook '(\w+)'", str(error))
    if unknown is None:
        return PluginError(f"{where} is invalid: {error_line(error)}; {REMEDY}")
    hooks = [name for name, hook in vars(pm.hook).items() if not name.startswith("_") and hook.has_spec()]
    suggestion = close_matches(unknown.group(1), hooks, n=1)
    hint = f"; did you mean {suggestion[0]!r}?" if suggestion else ""
    return PluginError(
        f"{where} implements {unknown.group(1)!r}, which is no clipkit hook{hint} "
        "(the hooks: clipkit/contract/hookspecs.py, docs/plugins.md)"
    )


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
