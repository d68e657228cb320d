"""CLIP_benchmark compatibility: its wds layout read, its result schema written and read back,
`clipkit report` with a published row beside a clipkit run, and the DataComp suite on what is local.

The wds sets are built here from ../shared/data (CIFAR-10 test JPEGs, Fashion-MNIST idx); tests
that need them skip where it is absent."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from clipkit.app import api
from clipkit.app.cli import make_app
from clipkit.data.shard import open_source
from clipkit.errors import ClipkitError, DataError
from clipkit.eval.clip_benchmark import (
    SCHEMA_KEYS,
    benchmark_name,
    read_result,
    wds_dataset,
    write_results,
)

SUITE = Path(__file__).resolve().parents[1] / "docs" / "datacomp.yaml"


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_wds(root: Path, samples: list[tuple[bytes, str, dict]], per_shard: int, **files: list[str]) -> Path:
    """A CLIP_benchmark wds folder: ``root/test/{0..}.tar`` + ``nshards.txt`` and the text files
    given (``classnames``, ``templates``, ``dataset_type``), as its exporter writes them."""
    test = root / "test"
    test.mkdir(parents=True)
    shards = [samples[i : i + per_shard] for i in range(0, len(samples), per_shard)]
    index = 0
    for number, shard in enumerate(shards):
        with tarfile.open(test / f"{number}.tar", "w") as tar:
            for image, ext, fields in shard:
                key = f"s{index:07d}"
                add_member(tar, f"{key}.{ext}", image)
                for field, text in fields.items():
                    add_member(tar, f"{key}.{field}", text.encode())
                index += 1
    (test / "nshards.txt").write_text(f"{len(shards)}\n")
    names = {"classnames": "classnames.txt", "templates": "zeroshot_classification_templates.txt"}
    for key, lines in files.items():
        (root / names.get(key, f"{key}.txt")).write_text("".join(f"{line}\n" for line in lines))
    return root


@pytest.fixture
def cifar_wds(shared_data, tmp_path) -> Path:
    """40 CIFAR-10 test images (4 per class) as ``wds_cifar10`` in 3 shards."""
    classes = json.loads((shared_data / "cifar10" / "classes.json").read_text())["classes"]
    taken: dict[str, int] = {}
    samples = []
    with tarfile.open(shared_data / "cifar10" / "cifar10_test_jpg.tar") as tar:
        for member in tar:
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 3 and taken.get(parts[1], 0) < 4:
                taken[parts[1]] = taken.get(parts[1], 0) + 1
                samples.append((tar.extractfile(member).read(), "jpg", {"cls": str(classes.index(parts[1]))}))
    templates = ["a photo of a {c}.", "a blurry photo of a {c}."]
    return write_wds(tmp_path / "bench" / "wds_cifar10", samples, 16, classnames=classes, templates=templates)


@pytest.fixture
def fashion_retrieval_wds(shared_data, tmp_path) -> Path:
    """24 Fashion-MNIST test images as a retrieval set: two captions per image in ``txt``."""
    from PIL import Image

    from clipkit.plugins.sources.idx_source import read_idx

    folder = shared_data / "fashion-mnist"
    images = read_idx(folder / "t10k-images-idx3-ubyte.gz", 3)[:24]
    labels = read_idx(folder / "t10k-labels-idx1-ubyte.gz", 1)[:24]
    classes = json.loads((folder / "classes.json").read_text())["classes"]
    samples = []
    for image, label in zip(images, labels, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        name = classes[int(label)]
        samples.append((buffer.getvalue(), "png", {"txt": f"a photo of a {name}.\na {name}"}))
    return write_wds(tmp_path / "bench" / "wds_fashion-retrieval", samples, 10, dataset_type=["retrieval"])


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


def test_benchmark_names():
    assert benchmark_name("/x/wds_vtab-cifar100") == "vtab/cifar100"
    assert benchmark_name("wds_imagenet-a/") == "imagenet-a" and benchmark_name("wds_cars") == "cars"
    assert benchmark_name("wds_fairness-dollar_street") == "fairness/dollar_street"
    assert wds_dataset("wds:/d/wds_vtab-dtd?split=train") == "vtab/dtd[train]"
    assert wds_dataset("/d/wds_mnist") == "mnist" and wds_dataset("wds:/d/mine") == "mine"
    assert wds_dataset("/d/cifar10/test") is None and wds_dataset("classes:/d/wds_x") is None


def test_reads_the_wds_layout(cifar_wds):
    source = open_source(f"wds:{cifar_wds}")
    samples = list(source)
    assert len(samples) == 40 and {s.meta["label"] for s in samples} == set(range(10))
    assert samples[0].key == "s0000000" and samples[-1].key == "s0000039"  # shard order: 0, 1, 2
    labels = source.info()["labels"]["label"]
    assert labels["classes"][:3] == ["airplane", "automobile", "bird"]
    assert labels["templates"] == ["a photo of a {}.", "a blurry photo of a {}."]  # {c} -> {}
    assert source.info()["benchmark"] == {"dataset": "cifar10", "retrieval": False}
    # detected without the scheme: a wds_<name> folder with a split holding nshards.txt
    assert type(open_source(str(cifar_wds))).__name__ == "ClipBenchmarkSource"
    with pytest.raises(DataError, match=r"no split 'train' \(its splits: test\)"):
        open_source(f"wds:{cifar_wds}?split=train")


def test_retrieval_sets_carry_every_caption(fashion_retrieval_wds):
    samples = list(open_source(str(fashion_retrieval_wds)))
    assert len(samples) == 24 and all(len(s.captions) == 2 for s in samples)
    assert samples[0].captions[0].startswith("a photo of a ")


def test_bad_layouts_name_the_file(tmp_path):
    root = write_wds(tmp_path / "wds_x", [], 1, templates=["a photo"])
    (root / "test" / "nshards.txt").write_text("2\n")
    with pytest.raises(DataError, match=r"0.tar: shard not found"):
        open_source(f"wds:{root}")
    (root / "test" / "nshards.txt").unlink()
    with pytest.raises(DataError, match=r"wds_x/test: no .tar shards \(and no nshards.txt\)"):
        open_source(f"wds:{root}")
    (root / "test" / "nshards.txt").write_text("0\n")
    with pytest.raises(DataError, match=r"templates.txt: template 'a photo' has no \{c\}"):
        open_source(f"wds:{root}")


def test_result_schema_round_trip(tmp_path):
    report = {
        "export": "/runs/a/export",
        "model": "clip@tiny",
        "results": [
            {"name": "zero_shot", "data": "wds:/d/wds_vtab-cifar10", "top1": 0.5, "top5": 0.9,
             "mean_per_class_recall": 0.45, "chance": 0.1, "baselines": {}},
            {"name": "linear_probe", "data": "/d/test.jsonl", "dataset": "cifar10", "top1": 0.7,
             "mean_per_class_recall": 0.6},
            {"name": "retrieval", "data": "/d/wds_mscoco", "i2t_R@1": 0.2, "t2i_R@1": 0.1,
             "mean_recall": 0.15},
            {"name": "diagnostics", "data": "/d/x", "gap": 0.3},
            {"name": "zero_shot", "data": "/d/broken", "failed": "no such file"},
        ],
    }  # fmt: skip
    written = write_results(report, tmp_path / "eval-x.json")
    assert [p.name for p in written] == [
        "eval-x-clip_benchmark-vtab_cifar10-zeroshot_classification.json",
        "eval-x-clip_benchmark-cifar10-linear_probe.json",
        "eval-x-clip_benchmark-mscoco-zeroshot_retrieval.json",
    ]
    zero_shot = json.loads(written[0].read_text())
    assert sorted(zero_shot) == sorted([*SCHEMA_KEYS, "language"])
    assert zero_shot["dataset"] == "wds/vtab/cifar10" and zero_shot["task"] == "zeroshot_classification"
    assert zero_shot["metrics"] == {"acc1": 0.5, "acc5": 0.9, "mean_per_class_recall": 0.45}
    assert zero_shot["model"] == "clip@tiny" and zero_shot["pretrained"] == "/runs/a/export"
    assert json.loads(written[1].read_text())["metrics"] == {"lp_acc1": 0.7, "lp_mean_per_class_recall": 0.6}
    retrieval = json.loads(written[2].read_text())["metrics"]
    assert retrieval == {"text_retrieval_recall@1": 0.2, "image_retrieval_recall@1": 0.1}
    # read back: clipkit's names again
    row = read_result(written[0])
    assert row["name"] == "zero_shot" and row["dataset"] == "vtab/cifar10"
    assert (row["top1"], row["top5"], row["mean_per_class_recall"]) == (0.5, 0.9, 0.45)
    assert read_result(written[2])["i2t_R@1"] == 0.2 and read_result(written[1])["top1"] == 0.7
    (tmp_path / "nan.json").write_text(
        '{"dataset": "renderedsst2", "model": "ViT-B-32", "pretrained": "openai", "task": '
        '"zeroshot_classification", "metrics": {"acc1": 0.6, "acc5": NaN}, "language": "en"}'
    )
    assert "top5" not in read_result(tmp_path / "nan.json")  # CLIP_benchmark's acc5 with < 5 classes
    (tmp_path / "other.json").write_text('{"results": 1}')
    with pytest.raises(ClipkitError, match="not a CLIP_benchmark result"):
        read_result(tmp_path / "other.json")


def test_eval_on_wds_then_report_beside_a_published_row(cifar_wds, export, tmp_path):
    runner, app = CliRunner(), make_app()
    outcome = runner.invoke(
        app, ["eval", str(export), "--task", "zero_shot", "--data", f"wds:{cifar_wds}", "--no-plots"]
    )
    assert outcome.exit_code == 0, outcome.output
    (mine,) = export.glob("eval-*-clip_benchmark-cifar10-zeroshot_classification.json")
    written = json.loads(mine.read_text())
    assert written["dataset"] == "wds/cifar10" and set(written["metrics"]) == {
        "acc1", "acc5", "mean_per_class_recall"}  # fmt: skip
    # a "published" row, as CLIP_benchmark writes it for another model
    published = tmp_path / "published"
    published.mkdir()
    row = {"dataset": "wds/cifar10", "model": "ViT-B-32", "pretrained": "openai", "task":
           "zeroshot_classification", "metrics": {"acc1": 0.8983, "acc5": 0.9951,
           "mean_per_class_recall": 0.8982}, "language": "en"}  # fmt: skip
    (published / "wds_cifar10_openai_ViT-B-32_en_zeroshot_classification.json").write_text(json.dumps(row))
    outcome = runner.invoke(app, ["report", str(export), str(published), "--out", str(tmp_path / "cmp")])
    assert outcome.exit_code == 0, outcome.output
    table = (tmp_path / "cmp" / "eval.md").read_text()
    top1 = next(line for line in table.splitlines() if line.startswith("| zero_shot cifar10 | top1 |"))
    assert "0.8983" in top1 and f"{written['metrics']['acc1']:.4f}" in top1  # one row, both columns
    assert not (tmp_path / "cmp" / "loss.png").exists()  # neither has training curves


def test_datacomp_suite_names_38_tasks():
    import yaml

    suite = yaml.safe_load(SUITE.read_text())
    tasks = suite["eval"]
    assert len(tasks) == 38 and len({t["data"] for t in tasks}) == 38
    assert {t["name"] for t in tasks} == {"zero_shot", "retrieval", "winogavil"}
    assert sum(t["name"] == "retrieval" for t in tasks) == 2
    (unsupported,) = [t for t in tasks if t["about"].get("unsupported")]  # WinoGAViL: no clipkit eval
    assert unsupported["name"] == "winogavil" and all(
        t["about"]["title"] and t["about"]["metric"] for t in tasks
    )
    balanced = {t["about"]["title"] for t in tasks if t["about"]["metric"] == "mean_per_class_recall"}
    assert balanced == {"Caltech-101", "FGVC Aircraft", "Oxford Flowers-102", "Oxford-IIIT Pet"}
    assert all(t["data"].startswith("wds:${root}/wds_") for t in tasks)


def test_datacomp_suite_runs_what_is_local(cifar_wds, export, tmp_path):
    outcome = CliRunner().invoke(
        make_app(),
        ["eval", str(export), "--tasks", str(SUITE), "--data", str(cifar_wds.parent), "--no-plots",
         "--output", str(tmp_path / "dc.json")],
    )  # fmt: skip
    assert outcome.exit_code == 0, outcome.output
    assert "37 of the 38 tasks have no data under" in outcome.output
    report = json.loads((tmp_path / "dc.json").read_text())
    ran = [r for r in report["results"] if not r.get("missing")]
    assert [r["data"] for r in ran] == [f"wds:{cifar_wds}"] and "top1" in ran[0] and ran[0]["n"] == 40
    missing = [r for r in report["results"] if r.get("missing")]
    assert len(missing) == 37 and any(r["data"].endswith("/wds_imagenet1k") for r in missing)
    assert "| missing |" in (tmp_path / "dc.md").read_text()
