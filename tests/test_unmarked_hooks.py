"""A plugin function named exactly like a clipkit hook but without ``@hookimpl`` is ignored by pluggy:
its names never reached any recipe, without a word. Registering such a plugin now warns in one line
naming the plugin and the function (docs/plugins.md); clipkit's own plugins warn about nothing."""

from __future__ import annotations

from test_registry import install_plugin

from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry

SOURCE = """
from clipkit.contract.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    pass


def register_losses(register):  # the decorator was forgotten
    register("forgotten_loss", object)


def register_loss_helper():  # not a hook's name: nothing to say
    pass
"""


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


def test_an_installed_plugin_with_an_unmarked_hook_warns_naming_plugin_and_function(
    tmp_path, monkeypatch, capsys
):
    install_plugin(tmp_path, "forgetful", SOURCE, "forgetful-plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = make_plugin_manager(autoload=True)
    (line,) = warnings_in(capsys.readouterr().err)
    assert line.startswith(
        "warning: plugin 'forgetful' (entry point forgetful = forgetful in forgetful-plugin 0.1) "
        "defines register_losses() without @hookimpl, so clipkit never calls it"
    )
    assert "@clipkit.hookimpl" in line
    assert "forgotten_loss" not in Registry(pm).names("loss")  # what the warning is about


class Forgetful:
    @hookimpl
    def register_losses(self, register):
        pass

    def register_similarities(self, register):
        pass

    def on_metrics(self, step, metrics, run):
        pass


def test_a_plugin_object_with_unmarked_hooks_warns_once_for_each(capsys):
    make_plugin_manager(autoload=False, extra_plugins=[Forgetful()])
    lines = warnings_in(capsys.readouterr().err)
    assert len(lines) == 2
    assert all(line.startswith(f"warning: plugin '{__name__}.Forgetful' defines ") for line in lines)
    assert "on_metrics() without @hookimpl" in lines[0] and "register_similarities()" in lines[1]


def test_clipkits_own_plugins_warn_about_nothing(capsys):
    make_plugin_manager(autoload=False)
    make_plugin_manager(autoload=True)  # and whatever this environment has installed
    assert warnings_in(capsys.readouterr().err) == []
