"""Data that changed or broke after it was sharded is never mixed in or read half unseen.

* A shard run interrupted and resumed after its source file was edited is refused (it would join
  rows of two versions), naming the partial folder to delete.
* ``clipkit train --data TABLE`` shards an edited table anew (into another folder) instead of
  training on the shards of its earlier version.
* A held-out split over a shard set with a truncated or missing shard trains on what can be read
  (as the loader does, with a warning naming the shard); evaluating such a set names the problem.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from PIL import Image
from typer.testing import CliRunner

from clipkit.app import api, own_data
from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.data.loader import training_split
from clipkit.data.shard import ShardSource
from clipkit.data.shard_writer import source_state
from clipkit.errors import DataError

runner = CliRunner()


def write_table(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def images(tmp_path):
    for i in range(4):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    return tmp_path


def test_a_resumed_shard_run_refuses_a_source_edited_since_it_started(images, monkeypatch):
    monkeypatch.chdir(images)
    app = make_app(make_plugin_manager(autoload=False))
    rows = [{"image": f"{i % 4}.png", "caption": f"row {i}"} for i in range(12)]
    rows[9]["image"] = "missing.png"  # --strict stops there, two shards of four already written
    write_table(images / "t.jsonl", rows)
    command = ["shard", "t.jsonl", "out", "--samples-per-shard", "4", "--strict"]
    assert runner.invoke(app, command).exit_code == 2
    assert (images / "out.partial").is_dir()
    rows[9]["image"] = "3.png"
    del rows[2]  # an edit before the resume point: finishing would keep row 2 and lose row 8
    write_table(images / "t.jsonl", rows)
    refused = runner.invoke(app, command)
    assert refused.exit_code == 2 and "t.jsonl changed since" in refused.output, refused.output
    assert "delete out.partial" in refused.output
    # The table unchanged (the missing image restored), the same resume goes on.
    rows[2:2] = [{"image": "2.png", "caption": "row 2"}]
    rows[9]["image"] = "missing.png"
    write_table(images / "t2.jsonl", rows)
    second = ["shard", "t2.jsonl", "out2", "--samples-per-shard", "4", "--strict"]
    assert runner.invoke(app, second).exit_code == 2
    assert (images / "out2.partial" / "journal.json").is_file()
    Image.new("RGB", (16, 16)).save(images / "missing.png")
    resumed = runner.invoke(app, second)
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((images / "out2" / "manifest.json").read_text())["n"] == 12


def test_an_edited_table_gets_other_shards_and_an_unchanged_one_the_same(images):
    table = images / "t.jsonl"
    write_table(table, [{"image": "0.png", "caption": "version one"}])
    first = own_data.shards_for(str(table))
    assert own_data.shards_for(str(table)) == first
    write_table(table, [{"image": "0.png", "caption": "VERSION TWO"}])
    assert own_data.shards_for(str(table)) != first


def test_source_state_covers_one_local_file_only(images):
    tar = images / "x.tar"
    tar.write_bytes(b"0" * 10)
    assert source_state(f"webdataset:{tar}").startswith("10:")
    assert source_state(f"{tar}?image=jpg") == source_state(str(tar))
    assert source_state(str(images)) is None  # a folder: no cheap fingerprint
    assert source_state("synthetic://shapes?n=8") is None
    assert source_state("https://example.org/t.csv") is None
    assert source_state(str(images / "absent.csv")) is None


@pytest.fixture
def shards(tmp_path):
    out = tmp_path / "shards"
    api.shard("synthetic://shapes?n=24&seed=1", out, samples_per_shard=8)
    return out


def test_a_held_out_split_reads_what_a_damaged_or_missing_shard_holds_with_a_warning(shards, caplog):
    whole = training_split(shards, 0.25)
    assert sum(count for _, count in whole.counts) + len(whole.held_out) == 24
    tars = sorted(shards.glob("shard-*.tar"))
    os.truncate(tars[1], 3000)  # a few samples of the second shard survive
    tars[2].unlink()
    with caplog.at_level(logging.WARNING, logger="clipkit.data"):
        damaged = training_split(shards, 0.25)  # a ReadError / FileNotFoundError traceback before
    named = [record.getMessage() for record in caplog.records]
    assert any(tars[1].name in m and "cannot be read whole" in m for m in named), named
    assert any(tars[2].name in m for m in named), named
    counts = dict(damaged.counts)
    assert counts[str(tars[0])] == dict(whole.counts)[str(tars[0])] and counts[str(tars[2])] == 0
    assert counts[str(tars[1])] < dict(whole.counts)[str(tars[1])]
    with pytest.raises(DataError, match=r"a shard cannot be read whole .*--verify"):
        list(ShardSource(shards))
