import pytest

from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import BUILTIN_PLUGINS, make_plugin_manager, plugin_distribution
from clipkit.contract.registry import Registry
from clipkit.errors import PluginError, UnknownNameError


class DuplicateLoss:
    @hookimpl
    def register_losses(self, register):
        register("infonce", lambda: None)


class Misspelled:
    @hookimpl
    def register_loss(self, register):  # typo: the hook is register_losses
        pass


def test_builtins_register_through_the_same_hooks(registry):
    owned = registry.by_plugin()
    assert set(owned) <= set(BUILTIN_PLUGINS)
    assert {"infonce", "siglip", "nuclr"} <= set(owned["clipkit.plugins.losses"]["loss"])
    assert "quickstart" in registry.names("recipe")


def test_duplicate_name_names_both_plugins():
    pm = make_plugin_manager(autoload=False, extra_plugins=[DuplicateLoss()])
    with pytest.raises(PluginError) as error:
        Registry(pm)
    message = str(error.value)
    assert "clipkit.plugins.losses" in message and "DuplicateLoss" in message
    assert "'infonce' is registered twice" in message


def test_unknown_name_suggests_close_matches(registry):
    with pytest.raises(UnknownNameError) as error:
        registry.get("loss", "infonse")
    assert error.value.suggestions[0] == "infonce"
    assert "Did you mean: infonce" in str(error.value)


def test_misspelled_hook_is_an_error():
    with pytest.raises(PluginError, match="implements 'register_loss', which is no clipkit hook; did you "
                       "mean 'register_losses'"):  # fmt: skip
        make_plugin_manager(autoload=False, extra_plugins=[Misspelled()])


def install_plugin(root, module: str, source: str, distribution: str = "evil-plugin") -> None:
    """A distribution ``DISTRIBUTION 0.1`` in ``root`` (put on sys.path by the caller) whose
    ``clipkit`` entry point ``module`` is the module ``module`` with ``source``."""
    (root / f"{module}.py").write_text(source, encoding="utf-8")
    info = root / f"{distribution.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(f"[clipkit]\n{module} = {module}\n", encoding="utf-8")


@pytest.mark.parametrize(
    "module, source, expected",
    [
        (
            "evil_import",
            "import no_such_module_xyz\n",
            "ModuleNotFoundError: No module named 'no_such_module_xyz'",
        ),
        ("evil_syntax", "def f(:\n", "SyntaxError: "),
        ("evil_raise", "raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    ],
)
def test_an_entry_point_that_fails_to_import_is_one_line(tmp_path, monkeypatch, module, source, expected):
    install_plugin(tmp_path, module, source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as error:
        make_plugin_manager(autoload=True)
    message = str(error.value)
    assert message.startswith(
        f"plugin '{module}' (entry point {module} = {module} in evil-plugin 0.1) cannot"
    )
    assert expected in message and "CLIPKIT_DISABLE_PLUGIN_AUTOLOAD=1" in message and "\n" not in message


def test_a_misspelled_hook_of_an_installed_plugin_names_its_package(tmp_path, monkeypatch):
    hook = "def register_optimizer(register):  # the hook is register_optimizers\n    pass\n"
    source = f"from clipkit.contract.hookspecs import hookimpl\n\n@hookimpl\n{hook}"
    install_plugin(tmp_path, "evil_typo", source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as error:
        make_plugin_manager(autoload=True)
    assert str(error.value).startswith(
        "plugin 'evil_typo' (entry point evil_typo = evil_typo in evil-plugin 0.1) "
    )
    assert "'register_optimizer', which is no clipkit hook; did you mean 'register_optimizers'?" in str(
        error.value
    )


def test_autoload_can_be_disabled(monkeypatch):
    calls = []
    import pluggy

    monkeypatch.setattr(
        pluggy.PluginManager, "load_setuptools_entrypoints", lambda self, group: calls.append(group)
    )
    monkeypatch.setenv("CLIPKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    make_plugin_manager()
    assert calls == []
    monkeypatch.setenv("CLIPKIT_DISABLE_PLUGIN_AUTOLOAD", "0")
    make_plugin_manager()
    assert calls == ["clipkit"]


def test_builtin_distribution_is_clipkit(registry):
    from clipkit import __version__

    plugin = registry.pm.get_plugin("clipkit.plugins.losses")
    assert plugin_distribution(registry.pm, plugin) == ("clipkit-contrastive", __version__)


def test_registry_is_read_only(registry):
    with pytest.raises(TypeError):
        registry._table("loss")["x"] = None


def test_a_preset_is_its_factory_with_fixed_and_default_arguments():
    import inspect

    from clipkit.contract.registry import preset

    def factory(*, width: int, depth: int = 2, act: str = "gelu") -> tuple:
        return width, depth, act

    small = preset(factory, "Small.", fixed={"depth": 1}, width=8)
    assert list(inspect.signature(small).parameters) == ["width", "act"]  # fixed ones hidden
    assert inspect.signature(small).parameters["width"].default == 8
    assert small() == (8, 1, "gelu") and small(width=4, act="relu") == (4, 1, "relu")
    assert small.__doc__ == "Small." and small.__annotations__["width"] is int
    with pytest.raises(TypeError, match="no parameter"):
        preset(factory, "Bad.", colour="red")
