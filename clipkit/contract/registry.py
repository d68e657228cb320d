"""Immutable name -> factory tables built from the plugin manager.

Each ``register_<kind>`` hook implementation is called with its own ``register``
callback so the registry knows which plugin registered which name; a name registered
twice is an error naming both plugins (the host validates, as in ``llm``).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pluggy

from clipkit.errors import ClipkitError, PluginError, UnknownNameError

#: kind -> the hook that registers it. The kind is also the recipe vocabulary ("loss" -> losses).
KINDS = {
    "encoder": "register_encoders",
    "tokenizer": "register_tokenizers",
    "similarity": "register_similarities",
    "loss": "register_losses",
    "distill_loss": "register_distill_losses",
    "optimizer": "register_optimizers",
    "schedule": "register_schedules",
    "eval": "register_evals",
    "stream": "register_streams",
    "recipe": "register_recipes",
}


@dataclass(frozen=True)
class Entry:
    """One registered name: its factory and the plugin (manager name) that registered it."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str


class Registry:
    """Read-only view of every registered factory, by kind and name."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._tables: dict[str, Mapping[str, Entry]] = {
            kind: MappingProxyType(_collect(pm, kind, hook)) for kind, hook in KINDS.items()
        }

    def names(self, kind: str) -> list[str]:
        return sorted(self._table(kind))

    def entries(self, kind: str) -> list[Entry]:
        return [self._table(kind)[name] for name in self.names(kind)]

    def get(self, kind: str, name: str, *, where: str = "") -> Entry:
        table = self._table(kind)
        if name not in table:
            raise UnknownNameError(kind, name, table, where=where)
        return table[name]

    def factory(self, kind: str, name: str) -> Callable[..., Any]:
        return self.get(kind, name).factory

    def origin(self, entry: Entry) -> str:
        """Who registered ``entry``, for error messages: ``plugin 'my_loss' (my-dist 0.1.0)``."""
        from clipkit.contract.manager import plugin_distribution

        plugin = self.pm.get_plugin(entry.plugin)
        distribution, version = plugin_distribution(self.pm, plugin) if plugin is not None else ("", "")
        label = f"{distribution} {version}".strip()
        return f"plugin {entry.plugin!r}" + (f" ({label})" if label else "")

    def by_plugin(self) -> dict[str, dict[str, list[str]]]:
        """plugin name -> kind -> names it registered."""
        owned: dict[str, dict[str, list[str]]] = {}
        for kind in KINDS:
            for entry in self.entries(kind):
                owned.setdefault(entry.plugin, {}).setdefault(kind, []).append(entry.name)
        return owned

    def _table(self, kind: str) -> Mapping[str, Entry]:
        if kind not in self._tables:
            raise KeyError(f"unknown plugin kind {kind!r}; kinds: {sorted(self._tables)}")
        return self._tables[kind]


def _collect(pm: pluggy.PluginManager, kind: str, hook_name: str) -> dict[str, Entry]:
    table: dict[str, Entry] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():

        def register(name: str, factory: Callable[..., Any], *, _plugin: str = impl.plugin_name) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"plugin {_plugin!r} registered a {kind} with an invalid name {name!r}")
            if not callable(factory):
                raise PluginError(
                    f"plugin {_plugin!r} registered {kind} {name!r} with a non-callable factory"
                )
            if name in table:
                raise PluginError(
                    f"{kind} {name!r} is registered twice: by plugin {table[name].plugin!r} "
                    f"and by plugin {_plugin!r}; uninstall or disable one of them"
                )
            table[name] = Entry(kind, name, factory, _plugin)

        call_registration(pm, impl, hook_name, register=register)
    return table


def call_registration(pm: pluggy.PluginManager, impl: Any, hook_name: str, **arguments: Any) -> None:
    """Run one plugin's ``register_<kind>`` (or ``register_commands``) hook with ``arguments``; an
    exception it raises (a plugin bug, not a :class:`ClipkitError`) becomes one line naming the
    plugin, its distribution and the hook."""
    try:
        impl.function(**arguments)
    except ClipkitError:
        raise
    except Exception as error:
        from clipkit.contract.manager import plugin_distribution

        label = " ".join(plugin_distribution(pm, impl.plugin)).strip()
        lines = str(error).strip().splitlines() or [""]
        raise PluginError(
            f"plugin {impl.plugin_name!r} ({label}): its {hook_name} hook raised "
            f"{type(error).__name__}: {lines[0]}".rstrip(": ")
        ) from error


_DEFAULT: Registry | None = None
_DEFAULT_PM: pluggy.PluginManager | None = None


def use_plugin_manager(pm: pluggy.PluginManager) -> None:
    """Make ``pm`` the one the default registry is built from (the CLI's manager)."""
    global _DEFAULT, _DEFAULT_PM
    _DEFAULT, _DEFAULT_PM = None, pm


def default_registry(*, refresh: bool = False) -> Registry:
    """The process-wide registry (built-ins + installed plugins), built on first use.

    Registration hooks import the implementations (and torch), so this is deferred until
    a command needs it.
    """
    global _DEFAULT, _DEFAULT_PM
    if _DEFAULT is None or refresh:
        if _DEFAULT_PM is None or refresh:
            from clipkit.contract.manager import make_plugin_manager

            _DEFAULT_PM = make_plugin_manager()
        _DEFAULT = Registry(_DEFAULT_PM)
    return _DEFAULT


def preset(factory: Callable, doc: str, *, fixed: dict[str, Any] | None = None, **defaults: Any) -> Callable:
    """A preset as data: ``factory`` with ``fixed`` arguments (hidden from recipes, always passed)
    and new ``defaults`` for others (recipes may still set them) — torchtune's ``vit_b16()`` over
    ``vit(...)`` without re-listing every keyword.

    The returned factory carries a real ``__signature__`` (keyword-only parameters, the fixed ones
    removed), so recipe validation binds it exactly like a hand-written factory.
    """
    fixed = dict(fixed or {})
    signature = inspect.signature(factory)
    unknown = (set(fixed) | set(defaults)) - set(signature.parameters)
    if unknown:
        raise TypeError(f"preset of {factory.__name__}: no parameter(s) {sorted(unknown)}")
    parameters = [
        parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name, parameter.default))
        for name, parameter in signature.parameters.items()
        if name not in fixed
    ]

    def build(**kwargs: Any):
        return factory(**{**defaults, **kwargs, **fixed})

    target = factory.__init__ if inspect.isclass(factory) else factory
    try:  # resolved now, so recipe validation type-checks a preset's values like the factory's, and
        # with their Annotated ranges (include_extras), so `clipkit validate` checks those too
        hints = typing.get_type_hints(target, include_extras=True)
        build.__annotations__ = {k: v for k, v in hints.items() if k not in fixed}
    except Exception:  # unresolvable annotations: validation then skips type checks, as for any factory
        build.__annotations__ = {}
    returns = factory if inspect.isclass(factory) else signature.return_annotation
    build.__signature__ = signature.replace(parameters=parameters, return_annotation=returns)
    build.__doc__ = doc
    build.__name__ = build.__qualname__ = f"{factory.__name__}_preset"
    build.__module__ = factory.__module__
    return build
