"""Your own data: the key-hash held-out split (training stream, eval source, `shard --split` agree),
and `--data` as recipe overrides."""

from __future__ import annotations

import json

import pytest

from clipkit.app.own_data import is_held_out, own_data_overrides, parse_split, split_position
from clipkit.data.loader import BatchStream, ImageTransform, TrainingSplit, training_split
from clipkit.data.shard import ShardSource, open_source
from clipkit.data.shard_writer import write_shards
from clipkit.errors import ClipkitError, DataError
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes

TRANSFORM = ImageTransform(image_size=16, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
FRACTION = 0.25


@pytest.fixture
def shards(tmp_path):
    source = SyntheticShapes(n=48, seed=5, image_size=16)
    write_shards(source, tmp_path / "shards", source="synthetic://shapes?n=48&seed=5", info=source.info(),
                 samples_per_shard=10)  # fmt: skip
    keys = {s.meta["index"]: s.key for s in ShardSource(tmp_path / "shards")}
    return tmp_path / "shards", keys


def test_split_is_a_function_of_the_key_and_near_the_fraction():
    keys = [str(i) for i in range(20_000)]
    held = [k for k in keys if is_held_out(k, 0.05)]
    assert 0.04 < len(held) / len(keys) < 0.06
    assert all(0 <= split_position(k) < 1 for k in keys[:100])
    # Nested: a larger fraction holds out a superset (raising --holdout never moves a sample back).
    assert set(held) <= {k for k in keys if is_held_out(k, 0.1)}
    assert not any(is_held_out(k, 0.0) for k in keys[:100])


@pytest.mark.parametrize("world_size", [1, 2])
def test_training_stream_leaves_out_exactly_the_held_out_samples(shards, world_size):
    directory, keys = shards
    held = {i for i, key in keys.items() if is_held_out(key, FRACTION)}
    assert 0 < len(held) < len(keys)  # the fixture exercises both sides
    seen: list[int] = []
    for rank in range(world_size):
        stream = BatchStream(directory, batch_size=1, transform=TRANSFORM, tokenizer=None, seed=0,
                             shuffle_buffer=1, rank=rank, world_size=world_size,
                             holdout=FRACTION)  # fmt: skip
        assert stream.num_samples == len(keys) - len(held)
        batches = stream.plan(0).batches
        for _, batch in zip(range(batches), stream, strict=False):
            seen += batch["index"].tolist()
    kept = sorted(set(keys) - held)
    # The batch's index is the place among the training samples (per-sample state such as NUCLR's ζ
    # is sized by the training count), so it stays below it; a held-out sample would repeat a place.
    assert all(0 <= place < len(kept) for place in seen)
    # One epoch covers every kept sample once (up to the remainder world_size leaves out).
    assert len(seen) == len(set(seen)) and len(kept) - len(seen) < world_size


def test_training_places_skip_the_held_out_indices():
    split = TrainingSplit([("a.tar", 7)], held_out=(0, 3, 4, 9))
    kept = [i for i in range(11) if i not in split.held_out]
    assert [split.position(i) for i in kept] == list(range(len(kept)))
    assert split.num_samples == 7


def test_training_split_finds_the_held_out_indices(shards):
    directory, keys = shards
    split = training_split(directory, FRACTION)
    assert split.held_out == tuple(sorted(i for i, key in keys.items() if is_held_out(key, FRACTION)))
    assert split.num_samples == len(keys) - len(split.held_out)
    assert training_split(directory).held_out == () and training_split(directory).num_samples == len(keys)


def test_holdout_source_and_shard_split_agree(shards, tmp_path, registry):
    from clipkit.app import api

    directory, keys = shards
    held = sorted(key for key in keys.values() if is_held_out(key, FRACTION))
    source = open_source(f"holdout:{directory}?fraction={FRACTION}", pm=registry.pm)
    assert sorted(s.key for s in source) == held
    assert source.info()["split"]["part"] == "holdout"
    rest = open_source(f"holdout:{directory}?fraction={FRACTION}&part=train", pm=registry.pm)
    assert sorted(s.key for s in rest) == sorted(set(keys.values()) - set(held))
    manifests = api.shard_split(str(directory), tmp_path / "split", f"val={FRACTION}", registry=registry)
    assert sorted(s.key for s in ShardSource(tmp_path / "split" / "val")) == held
    assert manifests["train"]["n"] + manifests["val"]["n"] == len(keys)
    assert manifests["val"]["info"]["split"] == {"part": "val", "fraction": FRACTION}


@pytest.mark.parametrize("uri", ["holdout:x", "holdout:x?fraction=2", "holdout:x?fraction=0.1&part=test",
                                 "holdout:x?fraction=a"])  # fmt: skip
def test_bad_holdout_uris_name_the_uri(uri, registry):
    with pytest.raises(ClipkitError, match="holdout:x"):
        open_source(uri, pm=registry.pm)


@pytest.mark.parametrize(
    "bad", ["val", "val=0", "val=1.5", "train=0.1", "=0.1", "../x=0.5", "/abs=0.5", "a/b=0.1", ".x=0.1"]
)
def test_parse_split_rejects(bad):
    with pytest.raises(ClipkitError, match="--split"):
        parse_split(bad)


def overrides_dict(overrides: list[str]) -> dict:
    return {key: json.loads(value) for key, _, value in (o.partition("=") for o in overrides)}


def test_data_table_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPKIT_DATA_DIR", str(tmp_path / "cache"))
    table = tmp_path / "pets.jsonl"
    table.write_text("")
    overrides, notes = own_data_overrides(str(table), holdout=0.1, label="category",
                                          eval_data=["other.csv"], recipe_eval=[{"name": "x"}])  # fmt: skip
    got = overrides_dict(overrides)
    assert got["data.source"] == str(table) and got["data.shards"].startswith(
        str(tmp_path / "cache" / "pets-")
    )
    assert got["data.holdout"] == 0.1
    held = f"holdout:{got['data.shards']}?fraction=0.1"
    trained = f"holdout:{got['data.shards']}?fraction=0.1&part=train"  # what the checks compare with
    other = got["eval"][2]["data"]
    assert got["data.holdout_by"] is None
    assert got["eval"] == [
        {"name": "retrieval", "data": held, "training_data": trained},
        {"name": "zero_shot", "data": held, "label": "category", "training_data": trained},
        {"name": "retrieval", "data": other, "training_data": trained},
        {"name": "zero_shot", "data": other, "label": "category", "training_data": trained},
    ]
    assert other.endswith("/other.csv") and other.startswith("/")
    assert any("10.0%" in note for note in notes)


def test_data_shards_and_synthetic_overrides(shards):
    directory, _ = shards
    got = overrides_dict(own_data_overrides(str(directory))[0])
    assert got["data.source"] == "" and got["data.shards"] == str(directory.resolve())
    assert [t["name"] for t in got["eval"]] == ["retrieval"]
    # Synthetic data keeps the recipe's own (synthetic) evaluation; --eval-data adds to it.
    synthetic = overrides_dict(own_data_overrides("synthetic://shapes?n=64", recipe_eval=[{"name": "a"}],
                                                  eval_data=["t.jsonl"])[0])  # fmt: skip
    assert synthetic["eval"][0] == {"name": "a"} and synthetic["eval"][1]["name"] == "retrieval"
    assert "data.holdout" not in synthetic


def test_label_without_data_and_bad_holdout_are_errors():
    with pytest.raises(ClipkitError, match="--label"):
        own_data_overrides(None, label="category")
    with pytest.raises(ClipkitError, match="--holdout"):
        own_data_overrides("x.jsonl", holdout=1.0)


def test_stream_counts_only_the_kept_samples_for_its_batch_check(shards):
    directory, keys = shards
    kept = sum(not is_held_out(key, FRACTION) for key in keys.values())
    BatchStream(directory, batch_size=kept, transform=TRANSFORM, tokenizer=None, seed=0, holdout=FRACTION)
    with pytest.raises(DataError, match=f"{kept} samples .* fewer than one batch"):
        BatchStream(
            directory, batch_size=kept + 1, transform=TRANSFORM, tokenizer=None, seed=0, holdout=FRACTION
        )


def test_holdout_holds_with_loader_workers(shards):
    directory, keys = shards
    held = {i for i, key in keys.items() if is_held_out(key, FRACTION)}
    stream = BatchStream(directory, batch_size=4, transform=TRANSFORM, tokenizer=None, seed=0, num_workers=2,
                         holdout=FRACTION)  # fmt: skip
    seen = [
        i
        for _, batch in zip(range(stream.plan(0).batches), stream, strict=False)
        for i in batch["index"].tolist()
    ]
    assert seen and len(seen) == len(set(seen)) and max(seen) < len(keys) - len(held)


def test_shard_split_and_resume_conflict_on_the_command_line(in_tmp, shards):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    directory, keys = shards
    runner, app = CliRunner(), make_app()
    outcome = runner.invoke(app, ["shard", str(directory), "split", "--split", "val=0.25"])
    assert outcome.exit_code == 0, outcome.output
    assert (in_tmp / "split" / "train" / "manifest.json").is_file() and "val: wrote" in outcome.output
    outcome = runner.invoke(
        app, ["train", "clip@tiny", "--resume", "--run-dir", "r", "--data", str(directory)]
    )
    assert outcome.exit_code == 2 and "start a new run" in outcome.output


def test_a_recipe_meta_key_missing_from_your_table_names_the_setting():
    """yaware@tiny reads `label`, `age`, `sex` from the synthetic shapes' columns; on a user's table
    the error says which column is missing, which ones exist, and the override that fixes it."""
    from types import SimpleNamespace

    from clipkit.data.loader import batch_meta

    samples = [SimpleNamespace(meta={"index": 0, "category": "red", "size": 3.0})]
    with pytest.raises(
        DataError, match=r"label <- 'combo'.*\['category', 'size'\].*data.meta_keys.label=COLUMN"
    ):
        batch_meta(samples, {"label": "combo"})
    assert batch_meta(samples, {"label": "category"})["label"] == ["red"]


@pytest.mark.parametrize(
    ("data", "eval_data", "user"),
    [
        ("synthetic://shapes?n=64", ("t.jsonl",), ["train.steps=2", "eval.0.label=shape"]),
        ("pets.jsonl", (), ["data.shards=elsewhere", "train.steps=3"]),
        ("pets.jsonl", ("other.csv",), ["eval=[]"]),
        (None, ("t.jsonl",), []),
    ],
)
def test_own_data_resolves_once_as_if_its_overrides_came_before_the_users(
    registry, tmp_path, monkeypatch, data, eval_data, user
):
    """`train --data` resolves the recipe once: its overrides, made from the resolved recipe's eval
    tasks, give what resolving again with them placed before the user's overrides gave (the user's
    still win: data.shards=elsewhere, eval=[] stay)."""
    from clipkit.app import api
    from clipkit.app.own_data import OwnData

    monkeypatch.setenv("CLIPKIT_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for name in (data, *eval_data):
        if name and not name.startswith("synthetic://"):
            (tmp_path / name).write_text("{}\n")  # --data must exist (never a place to fill)
    own = OwnData(data, holdout=0.1, eval_data=eval_data)
    extra = own.overrides(api.resolve("quickstart@smoke", user, registry).get("eval"))
    twice = api.resolve("quickstart@smoke", extra + user, registry)
    assert api.resolve("quickstart@smoke", user, registry, own_data=own) == twice
