"""The rules that make the house (docs/plugins.md, "Layout"), checked on the source itself.

Imports are read with ``ast`` from every module of ``clipkit/`` and ``plugins/`` (installed as
``clipkit.plugins``), function-level imports included — a lazy import is still a dependency.
``if TYPE_CHECKING:`` blocks never run, so the rules about what a module may import at run time
leave them out; the rule against import cycles counts them (a cycle held apart only by
``TYPE_CHECKING`` is still a knot a reader must untie).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGE = "clipkit.train.runtime"
DISTRIBUTED_LIBRARIES = ("torch.distributed", "accelerate", "deepspeed")
#: Parts of those libraries that are not about processes or precision: Accelerate's experiment
#: tracker classes, which the trackers plugin offers by name (train.report_to).
NOT_DISTRIBUTED = ("accelerate.tracking",)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the core and the built-in plugins."""
    modules = {}
    for top, package in ((ROOT / "clipkit", "clipkit"), (ROOT / "plugins", "clipkit.plugins")):
        for path in sorted(top.rglob("*.py")):
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = module_files()


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once for both import maps below."""
    return ast.parse(path.read_text(encoding="utf-8"))


def imported_names(module: str, path: Path, *, type_checking: bool = False) -> set[str]:
    """Every module name ``module`` imports (absolute; ``from X import y`` gives X and X.y);
    ``type_checking``: also those under ``if TYPE_CHECKING:``."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()

    def visit(statements: list) -> None:
        # Imports are statements: only statement bodies are walked, not expressions (~10x fewer nodes).
        for node in statements:
            if is_type_checking_block(node) and not type_checking:
                continue
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit(children)

    visit(parsed(path).body)
    return names


@functools.cache
def run_time_imports() -> dict[str, set[str]]:
    """Module -> what it imports when it runs (``TYPE_CHECKING`` blocks left out). Built on first
    use, not at collection: every pytest worker collects this file, one runs it."""
    return {module: imported_names(module, path) for module, path in MODULES.items()}


@functools.cache
def all_imports() -> dict[str, set[str]]:
    """Module -> everything it imports, ``TYPE_CHECKING`` blocks included."""
    return {module: imported_names(module, path, type_checking=True) for module, path in MODULES.items()}


def internal_edges(module: str, imports: dict[str, set[str]] | None = None) -> set[str]:
    """The clipkit modules ``module`` depends on (a package's __init__ counts for its name)."""
    imports = run_time_imports() if imports is None else imports
    return {name for name in imports[module] if name in MODULES and name != module}


def test_the_source_was_read():
    # Guards the other tests: an empty graph would pass them all.
    assert "clipkit.train.loop" in MODULES and "clipkit.plugins.losses.nuclr" in MODULES
    assert "clipkit.train.runtime" in internal_edges("clipkit.train.build")


@pytest.mark.parametrize("library", DISTRIBUTED_LIBRARIES)
def test_distributed_libraries_only_in_the_runtime(library):
    offenders = sorted(
        module
        for module, names in run_time_imports().items()
        if not (module == RUNTIME_PACKAGE or module.startswith(RUNTIME_PACKAGE + "."))
        and any(
            (name == library or name.startswith(library + ".")) and not name.startswith(NOT_DISTRIBUTED)
            for name in names
        )
    )
    assert not offenders, f"{library} is imported outside {RUNTIME_PACKAGE}: {offenders}"


def strategy_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read an attribute named ``strategy`` or ``_strategy`` of any object."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ("strategy", "_strategy")
    )


def test_the_runtime_is_closed():
    """Nothing outside the runtime package reaches its strategy: callers ask the Runtime for what
    they need (prepare, backward, step, save), so the strategy can change without them. The recipe's
    own ``train.distributed.strategy`` setting is read inside the runtime too."""
    offenders = {
        module: lines
        for module, path in MODULES.items()
        if not (module == RUNTIME_PACKAGE or module.startswith(RUNTIME_PACKAGE + "."))
        and (lines := strategy_reads(path))
    }
    assert not offenders, f"`.strategy` read outside {RUNTIME_PACKAGE} (module: lines): {offenders}"


def test_the_closed_runtime_rule_can_fail(tmp_path):
    # Guards the test above: the reader finds both spellings.
    probe = tmp_path / "probe.py"
    probe.write_text("rt.strategy.step()\nx = runtime._strategy\nstrategy = 1\n")
    assert strategy_reads(probe) == [1, 2]


def test_plugins_do_not_import_the_cli_the_loop_or_the_runtime():
    forbidden = ("clipkit.app.cli", "clipkit.train")
    offenders = {
        module: sorted(name for name in run_time_imports()[module] if name.startswith(forbidden))
        for module in MODULES
        if module.startswith("clipkit.plugins")
    }
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, f"plugins import host internals: {offenders}"


def test_core_does_not_import_plugins():
    offenders = {
        module: sorted(name for name in run_time_imports()[module] if name.startswith("clipkit.plugins"))
        for module in MODULES
        if not module.startswith("clipkit.plugins")
    }
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, f"core modules import plugins (they are found through hooks): {offenders}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_of(module: str) -> str:
    return module.rpartition(".")[0]


def import_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> the clipkit modules it imports. A package's __init__ importing modules inside it
    (re-exports, a plugin kind's hook, ``clipkit.load``) is how packages work, not a cycle between
    modules: those edges are left out."""
    return {
        module: {
            name
            for name in internal_edges(module, imports)
            if not (MODULES[module].name == "__init__.py" and name.startswith(module + "."))
        }
        for module in MODULES
    }


def test_no_import_cycles_even_counting_type_checking_imports():
    graph = import_graph(all_imports())
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_type_checking_imports_are_read(tmp_path):
    # Guards the test above: a cycle held apart by TYPE_CHECKING alone is found.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from clipkit.train.loop import x\n"
    )
    assert "clipkit.train.loop" in imported_names("clipkit.probe", probe, type_checking=True)
    assert "clipkit.train.loop" not in imported_names("clipkit.probe", probe)


def reachable(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every clipkit module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for name in graph[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


#: Readers of artifacts, and what they must never load: reading an export (evaluation,
#: ``clipkit.load``, ``model.init``) needs no training code, nor the export writer.
READERS = (
    "clipkit.artifacts.reader",
    "clipkit.artifacts.loading",
    "clipkit.eval.evaluate",
    "clipkit.model.init_weights",
)
TRAINING = ("clipkit.train", "clipkit.artifacts.export")


@pytest.mark.parametrize("reader", READERS)
def test_readers_of_exports_do_not_import_training_code(reader):
    graph = import_graph(all_imports())
    loaded = {name for name in reachable(reader, graph) if name.startswith(TRAINING)}
    loaded = {name for name in loaded if name == TRAINING[1] or name.startswith(TRAINING[0])}
    assert not loaded, f"{reader} imports training code: {sorted(loaded)}"


def test_the_reader_rule_can_fail():
    graph = {"r": {"a"}, "a": {"clipkit.train.loop"}, "clipkit.train.loop": set()}
    assert reachable("r", graph) == {"a", "clipkit.train.loop"}


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# ----------------------------------------------------------------------------- old import paths


def test_every_old_module_path_imports_as_the_same_module():
    """The root's old flat paths (clipkit/moved.py) are aliases of the modules' new homes."""
    import importlib
    import warnings

    from clipkit.moved import MOVED, PUBLIC

    for old, new in MOVED.items():
        fresh = old not in sys.modules
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new) and module.__spec__.name == new, old
        warned = any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught)
        assert not fresh or warned == (old not in PUBLIC), old


def test_the_public_plugin_api_paths():
    import clipkit
    from clipkit.contract.hookspecs import hookimpl
    from clipkit.hookspecs import hookimpl as old_hookimpl
    from clipkit.testing import check_loss
    from clipkit.types import PointSet

    assert clipkit.hookimpl is hookimpl is old_hookimpl
    assert PointSet.__module__ == "clipkit.contract.types" and callable(check_loss)
