"""Zero-shot on any labelled table: class names from the label's values or a file, a label -> prompt
map, templates from a file, unknown labels listing the classes, and a suite that survives a failing
task (report written, non-zero exit)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipkit.app import api
from clipkit.app.cli import make_app
from clipkit.contract.types import Sample
from clipkit.errors import DataError
from clipkit.plugins.evals.zero_shot import ZeroShot

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def sample(key: str, **meta) -> Sample:
    return Sample(key=key, image=b"", image_ext="png", captions=("x",), meta=meta)


@pytest.fixture
def table(tmp_path):
    rows = []
    for i in range(6):
        name = list(COLOURS)[i % 3]
        Image.new("RGB", (24, 24), COLOURS[name]).save(tmp_path / f"{i}.png")
        rows.append({"image": f"{i}.png", "caption": f"a {name} square", "category": name, "size": i % 2})
    path = tmp_path / "colours.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def export(tmp_path):
    from clipkit.artifacts.export import write_export
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry
    from clipkit.model import build_model

    registry = Registry(make_plugin_manager(autoload=False))
    recipe = api.resolve("clip@tiny", [], registry)
    torch.manual_seed(0)
    write_export(build_model(recipe, registry), recipe, tmp_path / "export", registry)
    return tmp_path / "export"


def test_class_names_default_to_the_label_values():
    task = ZeroShot("t.jsonl", label="category")
    samples = [sample("0", category="red"), sample("1", category="blue"), sample("2", category="red")]
    classes, templates = task.prompts({}, samples)
    assert classes == ["blue", "red"] and templates == ["{}"]
    assert [task.class_index(s, classes) for s in samples] == [1, 0, 1]
    numbers = ZeroShot("t.jsonl", label="size")
    values = [sample(str(i), size=v) for i, v in enumerate([10, 2, 10])]
    classes, _ = numbers.prompts({}, values)
    assert classes == [2, 10] and [numbers.class_index(s, classes) for s in values] == [1, 0, 1]


def test_classnames_file_prompt_map_and_templates_file(tmp_path):
    (tmp_path / "classes.txt").write_text("red\nblue\n\ngreen\n")
    (tmp_path / "map.json").write_text(json.dumps({"red": "a scarlet thing"}))
    (tmp_path / "templates.txt").write_text("a drawing of {}.\n{} on paper\n")
    files = {"classnames_file": "classes.txt", "prompt_map": "map.json", "templates": "templates.txt"}
    task = ZeroShot("t", label="category", **{key: str(tmp_path / name) for key, name in files.items()})
    classes, templates = task.prompts({}, [])
    assert classes == ["red", "blue", "green"]
    assert templates == ["a drawing of {}.", "{} on paper"]
    assert task.prompt_names(classes) == ["a scarlet thing", "blue", "green"]
    assert ZeroShot("t", prompt_map={"blue": "navy"}).prompt_names(["red", "blue"]) == ["red", "navy"]
    (tmp_path / "bad.txt").write_text("no placeholder\n")
    with pytest.raises(DataError, match="bad.txt: every line needs a"):
        ZeroShot("t", templates=str(tmp_path / "bad.txt")).prompts({}, [sample("0", label="a")])


def test_unknown_label_lists_the_known_classes():
    task = ZeroShot("t.jsonl", label="category", classnames=["red", "blue"])
    with pytest.raises(DataError, match=r"category='pink', not a known class; the classes are 'red', 'blue'"):
        task.class_index(sample("7", category="pink"), ["red", "blue"])


def eval_zero_shot(export, table, out):
    """``clipkit eval EXPORT --task zero_shot`` on ``table`` over its ``category`` column."""
    args = ["eval", str(export), "--task", "zero_shot", "--data", str(table), "--label", "category",
            "--output", str(out), "--no-plots"]  # fmt: skip
    return CliRunner().invoke(make_app(), args)


def test_eval_zero_shot_on_a_table_needs_no_class_list(table, export, tmp_path):
    out = tmp_path / "zs.json"
    outcome = eval_zero_shot(export, table, out)
    assert outcome.exit_code == 0, outcome.output
    (result,) = json.loads(out.read_text())["results"]
    assert result["num_classes"] == 3 and result["n"] == 6 and result["chance"] == pytest.approx(1 / 3)
    assert 0 <= result["mean_per_class_recall"] <= 1  # 2 samples per class: equal to top-1 here
    assert result["mean_per_class_recall"] == pytest.approx(result["top1"])
    majority = result["baselines"]["majority"]
    assert majority["top1"] == pytest.approx(1 / 3) and majority["class"] in COLOURS
    table_text = out.with_suffix(".md").read_text()
    assert "uniform chance 0.3333" in table_text and "× chance" not in table_text


def reports_of(export):
    """clipkit's own reports in ``export`` (not the CLIP_benchmark result files beside them)."""
    return sorted(p for p in export.glob("eval-zero_shot-*.json") if "-clip_benchmark-" not in p.name)


def test_a_second_eval_keeps_the_first_report(table, export):
    """No --output: each eval writes a new EXPORT/eval-<task>-<data>-<time>.json and lists it in
    EXPORT/eval-index.json; the first report is kept, byte for byte."""
    args = [
        "eval",
        str(export),
        "--task",
        "zero_shot",
        "--data",
        str(table),
        "--label",
        "category",
        "--no-plots",
    ]
    first = CliRunner().invoke(make_app(), args)
    assert first.exit_code == 0, first.output
    (report,) = reports_of(export)
    assert report.name.startswith("eval-zero_shot-") and "colours.jsonl" in report.name
    kept = report.read_bytes()
    second = CliRunner().invoke(make_app(), args)
    assert second.exit_code == 0, second.output
    reports = reports_of(export)
    assert len(reports) == 2 and report.read_bytes() == kept
    index = json.loads((export / "eval-index.json").read_text())["reports"]
    assert [entry["report"] for entry in index] == [report.name, next(p.name for p in reports if p != report)]
    assert index[0]["tasks"] == [f"zero_shot {table.parent.name}/colours.jsonl:category"]
    # `clipkit report EXPORT` reads the newest indexed report (an export has no eval.json)
    written = api.report([export], export.parent / "cmp")
    assert [p.name for p in written][:2] == ["eval.json", "eval.md"]


def test_a_failing_task_does_not_stop_the_suite(table, export, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        f"- {{name: zero_shot, data: {table}, label: missing_column}}\n"
        f"- {{name: retrieval, data: {table}}}\n"
        f"- {{name: zero_shot, data: {table}, label: category, classnames: [red, blue]}}\n"
    )
    out = tmp_path / "suite.json"
    args = ["eval", str(export), "--tasks", str(suite), "--output", str(out), "--no-plots"]
    outcome = CliRunner().invoke(make_app(), args)
    assert outcome.exit_code != 0
    assert "2 of 3 eval task(s) failed" in outcome.output and "missing_column" in outcome.output
    results = json.loads(out.read_text())["results"]  # written although tasks failed
    assert [bool(r.get("failed")) for r in results] == [True, False, True]
    assert "green" in results[2]["failed"] and "the classes are 'red', 'blue'" in results[2]["failed"]
    assert 0 <= results[1]["mean_recall"] <= 1
    assert "**failed**" in out.with_suffix(".md").read_text()


# ------------------------------------------------------------------- a class list that is not the data's

CIFAR10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture
def cifar_folder(tmp_path):
    """A `classes:` folder in CIFAR-10's layout (test/<class>/<image>), one tiny image per class."""
    root = tmp_path / "cifar10" / "test"
    for i, name in enumerate(CIFAR10):
        (root / name).mkdir(parents=True)
        Image.new("RGB", (16, 16), (20 * i, 100, 200 - 15 * i)).save(root / name / "0000.png")
    return root


def run_zero_shot(export, tmp_path, data, *args):
    out = tmp_path / "zs-out" / "eval.json"
    command = ["eval", str(export), "--task", "zero_shot", "--data", data, "--output", str(out), "--no-plots"]
    return CliRunner().invoke(make_app(), [*command, *args]), out


@pytest.mark.parametrize(("dataset", "count"), [("cifar100", 100), ("imagenet1k", 1000)])
def test_zero_shot_refuses_a_dataset_whose_classes_are_not_the_datas(
    cifar_folder, export, tmp_path, dataset, count
):
    """`eval --data classes:cifar10/test --dataset cifar100` exited 0 with top-1 0.0: the folder's
    labels were read as indices into CIFAR-100's names."""
    outcome, out = run_zero_shot(export, tmp_path, f"classes:{cifar_folder}", "--dataset", dataset)
    assert outcome.exit_code == 2, outcome.output
    assert "Traceback" not in outcome.output
    (line,) = [text for text in outcome.output.splitlines() if text.startswith("error:")]
    assert f"10 classes in the data but {count} in dataset '{dataset}'" in line
    assert "does not match" in line and str(cifar_folder) in line  # names the data and both lists
    assert "data classes: 'airplane'" in line and f"dataset '{dataset}': '" in line
    (result,) = json.loads(out.read_text())["results"]
    assert "top1" not in result and "does not match" in result["failed"]  # no number written
    assert sorted(p.name for p in cifar_folder.iterdir()) == CIFAR10  # the data is untouched


def test_zero_shot_refuses_class_names_in_another_order(cifar_folder, export, tmp_path):
    names = ",".join(["automobile", "airplane", *CIFAR10[2:]])
    outcome, _ = run_zero_shot(export, tmp_path, f"classes:{cifar_folder}", "--set", f"classnames=[{names}]")
    assert outcome.exit_code == 2, outcome.output
    assert "class 0 is 'airplane' in the data but 'automobile' in classnames" in outcome.output


def test_zero_shot_with_the_datas_own_class_list_runs(cifar_folder, export, tmp_path):
    """The matching dataset, and no dataset at all, score the folder by its class names."""
    for extra in (["--dataset", "cifar10"], []):
        outcome, out = run_zero_shot(export, tmp_path, f"classes:{cifar_folder}", *extra)
        assert outcome.exit_code == 0, outcome.output
        (result,) = json.loads(out.read_text())["results"]
        assert result["num_classes"] == 10 and result["n"] == 10


def test_the_data_class_list_of_index_labels(cifar_folder):
    """Index labels take their class names from the entry the samples name beside the index."""
    from clipkit.data.shard import open_source

    source = open_source(f"classes:{cifar_folder}")
    samples, info = list(source), dict(source.info())
    task = ZeroShot("d", dataset="cifar100")
    assert task.data_labels(info, samples)["classes"] == CIFAR10
    assert ZeroShot("d").prompts(info, samples)[0] == CIFAR10  # not "0".."9"
    with pytest.raises(DataError, match="10 classes in the data but 100 in dataset 'cifar100'"):
        task.prompts(info, samples)
    # A list in another vocabulary (e.g. WordNet ids against words) is matched by index.
    ids = [f"n{i:08d}" for i in range(10)]
    assert ZeroShot("d", classnames=ids).prompts(info, samples)[0] == ids


@pytest.mark.parametrize(
    "options, message",
    [
        ({"classnames": ["red", "red"]}, "names 'red' twice"),
        ({"classnames": ["blue", "Blue"]}, "the same name up to case"),
        ({"classnames": ["sea_lion", "sea lion"]}, "the same name up to case"),
        ({"classnames": []}, "non-empty list"),
        ({"templates": []}, "non-empty list"),
        ({"templates": ["a photo"]}, "has no {} for the class name"),
        ({"templates": ["a {} photo of {}"]}, "has 2 fields"),
        ({"templates": ["a {c} photo"]}, "has 1 fields \\['{c}'\\]"),
        ({"templates": ["a {} photo {"]}, "not a format text"),
    ],
)
def test_a_class_list_or_templates_that_cannot_tell_classes_apart_are_refused_up_front(options, message):
    # Accepted before, they scored one class's images under another's name, or every class
    # under the same prompt (chance-level top-1 and no word of why); some failed only after the
    # model had loaded (IndexError, KeyError from str.format).
    from clipkit.errors import ClipkitError

    with pytest.raises(ClipkitError, match=message):
        ZeroShot(data="classes:x", **options)


def test_a_classnames_file_naming_a_class_twice_is_refused(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\nCat\n")
    from clipkit.errors import ClipkitError

    with pytest.raises(ClipkitError, match=r"classnames_file .*names.txt names 'Cat' and 'cat'"):
        ZeroShot(data="classes:x", classnames_file=str(names)).file_classnames()


def test_the_shipped_class_lists_and_templates_pass_the_checks():
    # ImageNet's CLIP class list names two classes twice ('missile', 'sunglasses'): a shipped list
    # is used as it is; only lists a user gives are checked for repeats.
    from clipkit.plugins.evals import prompts

    task = ZeroShot(data="classes:x", dataset="imagenet")
    assert len(task.dataset_classnames()) == 1000
    for style in ("clip", "clip80", "clip7", "slip", "clip_benchmark"):
        styled = ZeroShot(data="classes:x", dataset="imagenet", templates=style)
        assert all("{}" in template for template in styled.resolve_templates({}))
    for name in prompts.dataset_names():
        assert ZeroShot(data="classes:x", dataset=name).resolve_templates({})


def test_rows_without_a_label_are_not_scored_and_are_counted(table, export, tmp_path):
    # One empty label cell failed the whole task ("has no meta-data"), after a full training run
    # when it was the run's final evaluation.
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    del rows[4]["category"]
    rows[5]["category"] = None
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "zs.json"
    outcome = eval_zero_shot(export, table, out)
    assert outcome.exit_code == 0, outcome.output
    (result,) = json.loads(out.read_text())["results"]
    assert result["n"] == 4 and result["unlabelled"] == 2 and result["num_classes"] == 3
    assert any("2 of 6 samples have no 'category' value" in w for w in result["warnings"])
