"""Issue 41: held-out splits that cannot leak (``--holdout-by``), evaluations that say what they
cannot know (overlap with training, class names never seen, tiny classes, majority ties), and the
small things a new user hits (``clipkit eval`` on runs and ``latest``, the flattened count)."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.app.own_data import Holdout, own_data_overrides
from clipkit.contract.types import Sample
from clipkit.data.loader import BatchStream, ImageTransform, training_split
from clipkit.data.shard import ShardSource, open_source
from clipkit.data.shard_writer import write_shards
from clipkit.errors import ClipkitError, DataError
from clipkit.eval import data_checks
from clipkit.eval.data_checks import TrainingText, overlap_checks, zero_shot_checks
from clipkit.eval.targets import resolve_target, resolve_targets
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes

TRANSFORM = ImageTransform(image_size=16, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
BY_SHAPE = Holdout(0.4, by="shape")


@pytest.fixture
def shards(tmp_path):
    """48 synthetic shapes in 5 shard files; meta-data ``shape`` (5 values) is the group column."""
    source = SyntheticShapes(n=48, seed=5, image_size=16)
    write_shards(source, tmp_path / "shards", source="synthetic://shapes?n=48&seed=5", info=source.info(),
                 samples_per_shard=10)  # fmt: skip
    samples = list(ShardSource(tmp_path / "shards"))
    return tmp_path / "shards", {s.key: s.meta for s in samples}


def held_groups(metas: dict, rule: Holdout) -> set:
    return {meta[rule.by] for key, meta in metas.items() if rule.holds(key, meta)}


def test_a_grouped_split_puts_every_group_on_one_side(shards):
    _, metas = shards
    by_group = defaultdict(set)
    for key, meta in metas.items():
        by_group[meta["shape"]].add(BY_SHAPE.holds(key, meta))
    assert all(len(sides) == 1 for sides in by_group.values())  # never both sides
    assert {True, False} == {side for sides in by_group.values() for side in sides}  # both used
    # Row by row, the same fraction splits groups: what --holdout-by prevents.
    rows = Holdout(0.4)
    assert any(len({rows.holds(k, m) for k, m in metas.items() if m["shape"] == g}) == 2 for g in by_group)


def test_training_stream_and_held_out_source_agree_on_groups(shards, registry):
    directory, metas = shards
    held = held_groups(metas, BY_SHAPE)
    source = open_source(f"holdout:{directory}?fraction=0.4&by=shape", pm=registry.pm)
    evaluated = list(source)
    assert evaluated and {s.meta["shape"] for s in evaluated} == held
    assert source.info()["split"] == {"part": "holdout", "fraction": 0.4, "of": str(directory), "by": "shape"}
    rest = list(open_source(f"holdout:{directory}?fraction=0.4&by=shape&part=train", pm=registry.pm))
    assert len(rest) + len(evaluated) == len(metas) and not {s.meta["shape"] for s in rest} & held

    split = training_split(directory, BY_SHAPE)
    assert split.num_samples == len(rest)
    stream = BatchStream(directory, batch_size=1, transform=TRANSFORM, tokenizer=None, seed=0,
                         shuffle_buffer=1, holdout=BY_SHAPE, meta_keys={"shape": "shape"})  # fmt: skip
    assert stream.num_samples == len(rest)
    trained = [batch for _, batch in zip(range(stream.plan(0).batches), stream, strict=False)]
    assert len(trained) == len(rest)


def test_a_row_without_the_group_column_is_named(shards):
    with pytest.raises(DataError, match=r"sample 'k7': no value in column 'album'.*--holdout-by"):
        Holdout(0.2, by="album").holds("k7", {"shape": "circle"})


def test_holdout_survives_pickling_into_loader_workers():
    import pickle

    rule = pickle.loads(pickle.dumps(BY_SHAPE))
    assert isinstance(rule, Holdout) and rule == 0.4 and rule.by == "shape"


def test_holdout_by_overrides_group_the_eval_and_training_uris(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPKIT_DATA_DIR", str(tmp_path / "cache"))
    (tmp_path / "pets.jsonl").write_text("")
    overrides, notes = own_data_overrides(str(tmp_path / "pets.jsonl"), holdout=0.2, holdout_by="album",
                                          label="category")  # fmt: skip
    got = {key: json.loads(value) for key, _, value in (o.partition("=") for o in overrides)}
    assert got["data.holdout_by"] == "album" and got["data.holdout"] == 0.2
    shards = got["data.shards"]
    assert [task["data"] for task in got["eval"]] == [f"holdout:{shards}?fraction=0.2&by=album"] * 2
    trained = f"holdout:{shards}?fraction=0.2&by=album&part=train"
    assert {task["training_data"] for task in got["eval"]} == {trained}
    assert any("'album' groups (all rows of a group on one side)" in note for note in notes)
    with pytest.raises(ClipkitError, match="--holdout-by names a column of your own --data"):
        own_data_overrides(None, holdout_by="album", eval_data=["x.csv"])


# --- what the report says -------------------------------------------------------------------------


def sample(key: str, caption: str, **meta) -> Sample:
    return Sample(key=key, image=b"", image_ext="png", captions=(caption,), meta=meta)


def training(*rows: tuple[str, str]) -> TrainingText:
    text = TrainingText()
    for caption, category in rows:
        text.add([caption], {"category": category})
    return text


TRAINED = training(("A red  Frog", "animals"), ("a blue car", "vehicles"), ("green apple", "food"))


def test_row_split_overlap_is_measured_and_warned():
    held = [
        sample("1", "a red frog", category="animals"),
        sample("2", "a new tree", category="plants"),
        sample("3", "a blue car", category="vehicles"),
        sample("4", "a moon", category="animals"),
    ]
    overlap, warnings = overlap_checks("holdout:/s?fraction=0.05", held, TRAINED, label="category")
    assert overlap["captions"] == 0.5  # case and spaces do not hide a repeat
    assert overlap["label"] == 0.75 and overlap["training_samples"] == 3
    (warning,) = warnings
    assert "50.0% of the captions and 75.0% of the 'category' values of the held-out samples" in warning
    assert "--holdout-by COLUMN" in warning


def test_grouped_split_warns_about_repeated_captions_only():
    held = [sample("1", "a new tree", category="plants")]
    assert overlap_checks("holdout:/s?fraction=0.05&by=category", held, TRAINED, "category")[1] == []
    repeat = [sample("1", "green apple", category="plants")]
    overlap, warnings = overlap_checks("holdout:/s?fraction=0.05&by=category", repeat, TRAINED, "category")
    assert overlap == {"captions": 1.0, "training_samples": 3, "label": 0.0}
    (warning,) = warnings
    assert "100.0% of the captions" in warning and "'category'" not in warning
    other = overlap_checks("/data/more.jsonl", [sample("1", "a pear", category="food")], TRAINED, "category")
    assert other == ({"captions": 0.0, "training_samples": 3, "label": 1.0}, [])  # seen labels: zero-shot


def test_class_names_no_training_caption_holds_are_flagged():
    fields, warnings = zero_shot_checks(
        ["frog", "meats_and_eggs", "blue whale", "car"], ["frog", "meats and eggs", "blue whale", "car"],
        [0] * 10 + [1] * 10 + [2] * 10 + [3] * 10, TRAINED,
    )  # fmt: skip
    assert fields["classes_unknown"] == ["meats and eggs"]  # 'and' is no evidence; 'blue' is
    assert fields["classes_small"] == {} and "majority_tie" in fields
    assert "1 of 4 class names share no word with any training caption ('meats and eggs')" in warnings[0]


def test_small_classes_carry_their_counts_and_ties_name_every_class():
    labels = [0, 0, 0, 1, 1, 1, 2]  # class 3 never occurs
    fields, warnings = zero_shot_checks(["a", "b", "c", "d"], ["a", "b", "c", "d"], labels, None, minimum=3)
    assert "classes_unknown" not in fields  # no training data given: not checked
    assert fields["classes_small"] == {"c": 1, "d": 0}
    assert fields["majority_tie"] == ["a", "b"]
    assert "2 class(es) with fewer than 3 samples ('c' 1, 'd' 0)" in warnings[0]
    assert "a tie of 2 classes ('a', 'b'), 3 samples each" in warnings[1]


def test_training_text_is_read_from_the_training_split(shards, registry):
    directory, metas = shards
    data_checks._TRAINING.clear()
    text = data_checks.training_text(f"holdout:{directory}?fraction=0.4&by=shape&part=train", registry)
    trained_shapes = {m["shape"] for m in metas.values()} - held_groups(metas, BY_SHAPE)
    assert text.values["shape"] == trained_shapes and text.n == sum(
        m["shape"] in trained_shapes for m in metas.values()
    )


@pytest.fixture
def drawings(tmp_path):
    """A table: 4 classes, training captions name 'red' and 'blue' only; 'green' has 1 image."""
    rows = []
    for i, (name, n) in enumerate({"red": 4, "blue": 4, "green": 1, "violet": 3}.items()):
        for j in range(n):
            Image.new("RGB", (16, 16), (40 * i, 80, 200 - 40 * j)).save(tmp_path / f"{name}{j}.png")
            rows.append({"image": f"{name}{j}.png", "caption": f"a {name} square {j}", "category": name})
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = [{"image": "red0.png", "caption": "a red square", "category": "red"},
             {"image": "blue1.png", "caption": "a blue square 1", "category": "blue"}]  # fmt: skip
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    return tmp_path


def test_zero_shot_and_retrieval_report_the_checks(drawings, registry):
    from clipkit.app import api
    from clipkit.eval.evaluate import run_evals
    from clipkit.model import build_model

    torch.manual_seed(0)
    model = build_model(api.resolve("clip@tiny", [], registry), registry)
    data_checks._TRAINING.clear()
    common = {"data": str(drawings / "eval.jsonl"), "training_data": str(drawings / "train.jsonl")}
    zero_shot, retrieval = run_evals(
        model, [{"name": "zero_shot", "label": "category", "min_class_samples": 2, **common},
                {"name": "retrieval", **common}], registry,
    )  # fmt: skip
    assert zero_shot["classes_unknown"] == ["green", "violet"]
    assert zero_shot["classes_small"] == {"green": 1}
    assert zero_shot["majority_tie"] == ["blue", "red"]
    assert zero_shot["baselines"]["majority"]["tied"] in (["blue", "red"], ["red", "blue"])
    assert zero_shot["overlap"]["captions"] == pytest.approx(1 / 12)  # 'a blue square 1'
    assert len(zero_shot["warnings"]) == 5  # small set, repeated caption, unknown, small, tie
    assert zero_shot["warning"] == "; ".join(zero_shot["warnings"])
    assert retrieval["overlap"]["captions"] == pytest.approx(1 / 12)
    from clipkit.eval.report import markdown_table

    table = markdown_table({"results": [zero_shot]})
    assert table.count("| *warning* |") == 5 and "share no word with any training caption" in table


# --- small things ---------------------------------------------------------------------------------


def make_run(root, name: str, mtime: int):
    export = root / "runs" / name / "export"
    export.mkdir(parents=True)
    (export / "clipkit.json").write_text("{}")
    os.utime(export / "clipkit.json", (mtime, mtime))
    return export


def test_eval_targets_runs_and_latest(in_tmp):
    first, second = make_run(in_tmp, "clip-tiny-b", 1_000), make_run(in_tmp, "clip-tiny-a", 2_000)
    assert resolve_target("runs/clip-tiny-b") == first.relative_to(in_tmp)
    assert resolve_target(str(first)) == first  # an export is kept as given
    assert resolve_target("latest") == second.relative_to(in_tmp)  # exported last, whatever its name
    # README's glob over two runs: both are evaluated, each once.
    assert resolve_targets([str(first), "runs/clip-tiny-b", str(second)], None) == [first, second]
    with pytest.raises(ClipkitError, match="--output names one report but 2 exports"):
        resolve_targets([str(first), str(second)], in_tmp / "r.json")


def test_latest_without_runs_says_where_it_looked(in_tmp):
    with pytest.raises(ClipkitError, match="latest: no run in runs/ has an export"):
        resolve_target("latest")


@pytest.mark.slow
def test_readme_eval_glob_over_two_runs(in_tmp, drawings):
    """`clipkit eval runs/clip-tiny-*/export --task zero_shot ...` with two runs evaluates both."""
    from clipkit.app import api
    from clipkit.artifacts.export import write_export
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry
    from clipkit.model import build_model

    registry = Registry(make_plugin_manager(autoload=False))
    recipe = api.resolve("clip@tiny", [], registry)
    for name in ("clip-tiny-1", "clip-tiny-2"):
        write_export(build_model(recipe, registry), recipe, in_tmp / "runs" / name / "export", registry)
    exports = sorted(str(p) for p in (in_tmp / "runs").glob("clip-tiny-*/export"))
    args = ["eval", *exports, "--task", "zero_shot", "--data", str(drawings / "eval.jsonl"), "--label",
            "category", "--no-plots"]  # fmt: skip
    outcome = CliRunner().invoke(make_app(), args)
    assert outcome.exit_code == 0, outcome.output
    assert outcome.output.count("report written to") == 2
    latest = CliRunner().invoke(make_app(), ["eval", "latest", "--task", "retrieval", "--data",
                                             str(drawings / "eval.jsonl"), "--no-plots"])  # fmt: skip
    assert latest.exit_code == 0, latest.output


def test_shard_says_how_many_images_it_flattened_none_included(tmp_path):
    rows = []
    for i, mode in enumerate(["RGBA", "RGB", "P"]):
        image = Image.new(mode, (8, 8))
        image.save(tmp_path / f"{i}.png")
        rows.append({"image": f"{i}.png", "caption": f"image {i}"})
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runner = CliRunner()
    out = runner.invoke(make_app(), ["shard", str(tmp_path / "t.jsonl"), str(tmp_path / "s"), "-o",
                                     "background=white"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "flattened 1 of 3 image(s) with transparency onto [255, 255, 255]" in out.output
    rows = rows[1:]
    (tmp_path / "u.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = runner.invoke(make_app(), ["shard", str(tmp_path / "u.jsonl"), str(tmp_path / "s2"), "-o",
                                     "background=white"])  # fmt: skip
    assert "flattened 0 of 2 image(s)" in out.output  # said even when there was nothing to flatten


def test_eval_of_an_export_checks_against_its_runs_training_data(drawings, registry):
    """`clipkit eval RUN/export --task zero_shot --data more.jsonl`: the run's recorded training
    data is used for the checks when it is still readable, and left out when it is not."""
    from clipkit.eval.evaluate import with_training_data

    trained = str(drawings / "train.jsonl")
    recipe = {
        "eval": [
            {"name": "retrieval", "data": "x"},
            {"name": "retrieval", "data": "y", "training_data": trained},
        ]
    }
    tasks = [{"name": "zero_shot", "data": "more.jsonl"}, {"name": "linear_probe", "train": "a", "test": "b"},
             {"name": "retrieval", "data": "z", "training_data": "mine.jsonl"}]  # fmt: skip
    got = with_training_data(tasks, recipe, registry)
    assert got[0]["training_data"] == trained and "training_data" not in got[1]
    assert got[2]["training_data"] == "mine.jsonl"  # a task's own is kept
    moved = {"eval": [{"name": "retrieval", "data": "y", "training_data": str(drawings / "gone.jsonl")}]}
    assert with_training_data(tasks, moved, registry) == tasks
    assert with_training_data(tasks, {}, registry) == tasks


def test_train_holdout_by_counts_and_evaluates_whole_groups(in_tmp, registry):
    """`clipkit train clip@tiny --data TABLE --holdout-by category`: the recipe carries the column,
    the run is sized on the rows of the groups left in training, and its eval tasks read the
    grouped split."""
    from test_own_data_flow import write_drawings

    from clipkit.app import api
    from clipkit.app.own_data import OwnData
    from clipkit.app.run_length import plan

    table = in_tmp / write_drawings(in_tmp, n=40)  # categories 'red' and 'blue', 20 rows each
    rule = Holdout(0.5, by="category")
    held = {name for name in ("red", "blue") if rule.holds("any key", {"category": name})}
    assert len(held) == 1, "the fixture needs one group on each side at this fraction"
    own = OwnData(str(table), holdout=0.5, holdout_by="category", label="category")
    recipe = api.resolve("clip@tiny", [], registry, own_data=own)
    assert recipe["data"]["holdout_by"] == "category"
    assert all(
        "by=category" in task["data"] and "by=category" in task["training_data"] for task in recipe["eval"]
    )
    assert plan(recipe, registry, epochs=1, by_default=False).num_samples == 20  # the other group, whole
