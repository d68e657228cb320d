"""Hooks beyond registration: extra CLI commands, data sources that take over a URI, metric loggers."""

from __future__ import annotations

import pytest
import typer
from smoke_data import place_smoke_shards
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.types import Sample
from clipkit.data.shard import open_source
from clipkit.errors import PluginError


class HelloCommand:
    @hookimpl
    def register_commands(self, app):
        @app.command("hello")
        def hello(name: str = typer.Option("world")):
            """Say hello."""
            typer.echo(f"hello {name}")


class ShapesOverride:
    """A source plugin that takes over the built-in synthetic:// scheme (built-ins are trylast)."""

    @hookimpl
    def open_source(self, uri, options):
        if uri.startswith("synthetic://"):
            return [Sample(key="mine", image=b"", image_ext="png", captions=("x",))]
        return None


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def on_metrics(self, step, metrics, run):
        self.calls.append((step, dict(metrics), run.recipe))


def test_register_commands_adds_a_cli_command():
    app = make_app(make_plugin_manager(autoload=False, extra_plugins=[HelloCommand()]))
    result = CliRunner().invoke(app, ["hello", "--name", "clip"])
    assert result.exit_code == 0 and result.output.strip() == "hello clip"
    assert "hello" in CliRunner().invoke(app, ["--help"]).output


class BrokenCommand:
    @hookimpl
    def register_commands(self, app):
        raise RuntimeError("no such option")


def test_a_command_hook_that_raises_is_one_line_naming_the_plugin():
    """Was a traceback from every command, ``--help`` included (main() prints a PluginError as one
    ``error:`` line and exits 2)."""
    with pytest.raises(
        PluginError, match=r"BrokenCommand.*register_commands hook raised RuntimeError: no such"
    ):
        make_app(make_plugin_manager(autoload=False, extra_plugins=[HelloCommand(), BrokenCommand()]))


def test_plugin_source_wins_over_builtin():
    pm = make_plugin_manager(autoload=False, extra_plugins=[ShapesOverride()])
    assert [s.key for s in open_source("synthetic://shapes", pm=pm)] == ["mine"]
    builtin = open_source("synthetic://shapes?n=2", pm=make_plugin_manager(autoload=False))
    assert len(list(builtin)) == 2


def test_on_metrics_reaches_every_logger(in_tmp, smoke_shards):
    place_smoke_shards(in_tmp, smoke_shards)  # sharding is not the point here
    from clipkit.app import api
    from clipkit.contract.registry import Registry

    recorder = Recorder()
    registry = Registry(make_plugin_manager(autoload=False, extra_plugins=[recorder]))
    overrides = ["train.steps=4", "train.log_every=2", "train.export=false"]
    api.train("quickstart@smoke", overrides, run_dir=in_tmp / "run", registry=registry)
    assert [step for step, _, _ in recorder.calls] == [2, 4]
    assert recorder.calls[0][2] == "quickstart@smoke"
    assert {"loss", "lr", "logit_scale", "samples_per_s"} <= set(recorder.calls[0][1])
    # The built-in JSONL logger ran too.
    assert len((in_tmp / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_help_through_cli_runner():
    result = CliRunner().invoke(make_app(make_plugin_manager(autoload=False)), ["--help"])
    assert result.exit_code == 0 and "clipkit train quickstart" in result.output
