"""clipkit.plugins.evals.prompts: the zero-shot class names and templates shipped with the package."""

from __future__ import annotations

import ast
import importlib.resources
import json
import re
import string
from pathlib import Path

import pytest
from shared_data_path import SHARED_DATA

from clipkit.errors import ClipkitError
from clipkit.plugins.evals import prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = SHARED_DATA

# Class counts from the datasets' own papers / CLIP's Table 9 (Caltech-101: 102 with the
# background class, as CLIP's prompts.md and CLOOB's Table A2 count it).
CLASS_COUNTS = {
    "cifar10": 10,
    "cifar100": 100,
    "mnist": 10,
    "fashion_mnist": 10,
    "stl10": 10,
    "food101": 101,
    "caltech101": 102,
    "cars": 196,
    "aircraft": 100,
    "flowers": 102,
    "eurosat": 10,
    "dtd": 47,
    "pets": 37,
    "sun397": 397,
    "imagenet": 1000,
}
SLIP_DATASETS = set(CLASS_COUNTS) - {"fashion_mnist"}


def placeholder_fields(template: str) -> list[str | None]:
    return [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]


@pytest.mark.parametrize("dataset", sorted(CLASS_COUNTS))
def test_class_counts(dataset):
    names = prompts.classnames(dataset)
    assert len(names) == CLASS_COUNTS[dataset]
    assert all(isinstance(n, str) and n.strip() == n and n for n in names)
    for source in prompts.classname_sources(dataset):
        assert len(prompts.classnames(dataset, source)) == CLASS_COUNTS[dataset], source


def test_every_template_has_one_placeholder_and_formats():
    checked = 0
    for dataset in prompts.dataset_names():
        for style in prompts.template_styles(dataset):
            templates = prompts.templates(dataset, style)
            assert templates, (dataset, style)
            for template in templates:
                assert placeholder_fields(template) == [""], (dataset, style, template)
                assert template.format("XYZ").count("XYZ") == 1
                checked += 1
    assert checked > 2000  # 30 datasets × 6 styles, 87 of them with the 80 or 7 ImageNet templates


def test_imagenet_template_sets():
    clip80, clip7 = prompts.templates("imagenet", "clip80"), prompts.templates("imagenet", "clip7")
    assert len(clip80) == len(set(clip80)) == 80 and len(clip7) == len(set(clip7)) == 7
    assert set(clip7) <= set(clip80)
    assert clip7[0] == "itap of a {}." and clip80[0] == "a bad photo of a {}."  # CLIP's notebook
    assert prompts.templates("imagenet") == clip80  # "clip" for ImageNet is the 80
    assert prompts.templates("imagenet", "imagenet7") == clip7
    assert prompts.templates("imagenet", "slip") == clip7  # SLIP evaluates ImageNet with the 7
    assert prompts.templates("cifar10", "clip80") == clip80  # dataset-independent styles
    assert prompts.templates("imagenet", "clip_benchmark") == clip80


def test_per_dataset_templates():
    assert len(prompts.templates("cifar10")) == 18 and len(prompts.templates("caltech101")) == 34
    assert prompts.templates("food101") == ["a photo of {}, a type of food."]
    assert prompts.templates("mnist") == ['a photo of the number: "{}".']
    for dataset in SLIP_DATASETS:
        assert "slip" in prompts.template_styles(dataset)
        slip = prompts.templates(dataset, "slip")
        assert slip == (prompts.templates(dataset) if dataset != "imagenet" else slip), dataset
    # CLIP_benchmark's own templates where they differ from CLIP's, {c} converted to {}
    assert prompts.templates("pcam", "clip_benchmark") == [
        "a histopathology slide showing {}",
        "histopathology image of {}",
    ]


def test_datasets_without_own_templates():
    """'clip' / 'clip_benchmark' fall back to the 80 ImageNet templates; 'slip' refuses."""
    clip80 = prompts.templates("imagenet", "clip80")
    assert prompts.templates("fashion_mnist") == clip80
    assert prompts.templates("fashion_mnist", "clip_benchmark") == clip80
    assert "slip" not in prompts.template_styles("fashion_mnist")
    with pytest.raises(ClipkitError, match=r"'slip' templates for dataset 'fashion_mnist'.*clip80"):
        prompts.templates("fashion_mnist", "slip")


def test_default_class_lists_and_label_order():
    assert prompts.classnames("cifar10")[:3] == ["airplane", "automobile", "bird"]
    assert prompts.classnames("mnist") == [str(i) for i in range(10)]
    assert prompts.classnames("caltech101")[:3] == ["background", "off-center face", "centered face"]
    fashion = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag"]
    assert prompts.classnames("fashion_mnist") == [*fashion, "Ankle boot"]
    # EuroSAT: CLIP's names in the alphabetical folder order AnnualCrop, Forest, HerbaceousVegetation, ...
    eurosat = prompts.classnames("eurosat")
    assert eurosat[:3] == ["annual crop land", "forest", "brushland or shrubland"]
    assert eurosat[-1] == "lake or sea" and eurosat != prompts.classnames("eurosat", "clip")
    assert sorted(eurosat) == sorted(prompts.classnames("eurosat", "clip"))
    # Pets: Oxford-IIIT class ids 1..6 are Abyssinian, american_bulldog, ..., beagle, Bengal
    pets = prompts.classnames("pets")
    assert pets[:6] == [
        "Abyssinian",
        "American Bulldog",
        "American Pit Bull Terrier",
        "Basset Hound",
        "Beagle",
        "Bengal",
    ]
    assert sorted(n.lower() for n in pets) == sorted(n.lower() for n in prompts.classnames("pets", "clip"))
    assert prompts.classnames("pets", "clip")[1] == "Bengal"  # CLIP's case-sensitive order
    imagenet = prompts.classnames("imagenet")
    assert imagenet[0] == "tench" and imagenet[657] == imagenet[744] == "missile"
    defaults = {d: prompts.default_classname_source(d) for d in CLASS_COUNTS}
    assert defaults == {
        **dict.fromkeys(CLASS_COUNTS, "clip"),
        "eurosat": "slip",
        "pets": "clip_benchmark",
        "fashion_mnist": "fashion_mnist",
    }


def test_synonyms():
    fer = prompts.class_synonyms("fer2013")
    assert fer[3] == ["happy", "smiling"] and prompts.classnames("fer2013")[3] == "happy"
    assert prompts.class_synonyms("cifar10")[0] == ["airplane"]


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("oxford_pets", "pets"),
        ("Oxford-IIIT-Pet", "pets"),
        ("stanford_cars", "cars"),
        ("StanfordCars", "cars"),
        ("fgvc_aircraft", "aircraft"),
        ("CIFAR-10", "cifar10"),
        ("Fashion-MNIST", "fashion_mnist"),
        ("imagenet1k", "imagenet"),
        ("flowers102", "flowers"),
        ("DescribableTextures", "dtd"),
        ("sun397", "sun397"),
    ],
)
def test_aliases(alias, canonical):
    assert prompts.canonical_name(alias) == canonical
    assert prompts.classnames(alias) == prompts.classnames(canonical)
    assert prompts.templates(alias) == prompts.templates(canonical)


def test_alias_table_is_consistent():
    names = prompts.dataset_names()
    assert all(re.fullmatch(r"[a-z0-9_]+", n) for n in names)
    assert len({prompts.squash(n) for n in names}) == len(names)
    assert set(prompts.ALIASES.values()) <= set(names)
    assert not set(prompts.ALIASES) & {prompts.squash(n) for n in names}


def test_errors_name_the_bad_key_and_list_the_known_ones():
    with pytest.raises(ClipkitError, match=r"unknown dataset 'cifar11'.*Did you mean: cifar10.*imagenet"):
        prompts.classnames("cifar11")
    with pytest.raises(ClipkitError, match=r"unknown template style 'clip81'.*clip80.*slip"):
        prompts.templates("cifar10", "clip81")
    with pytest.raises(ClipkitError, match=r"unknown class-name source 'openai'.*clip_benchmark.*slip"):
        prompts.classnames("cifar10", "openai")
    with pytest.raises(
        ClipkitError, match=r"no 'clip_benchmark' class names for dataset 'cifar10'.*clip, slip"
    ):
        prompts.classnames("cifar10", "clip_benchmark")
    with pytest.raises(ClipkitError, match="unknown dataset"):
        prompts.templates("nope", "clip80")  # dataset-independent styles still check the name


def test_results_are_copies():
    prompts.classnames("cifar10").append("spoon")
    prompts.templates("cifar10").clear()
    assert len(prompts.classnames("cifar10")) == 10 and len(prompts.templates("cifar10")) == 18


def test_package_data_and_licences_ship():
    folder = importlib.resources.files("clipkit.plugins.evals").joinpath("zeroshot")
    readme = folder.joinpath("README.md").read_text(encoding="utf-8")
    data = json.loads(folder.joinpath("classnames.json").read_text(encoding="utf-8"))
    licences = {source["licence"] for source in data["sources"].values()}
    assert len(licences) == 4
    for licence in licences:
        assert folder.joinpath(licence).read_text(encoding="utf-8").startswith("MIT License"), licence
        assert licence in readme
    # (no tomllib on Python 3.10: read the one line of [tool.setuptools.package-data])
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    package_data = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert re.search(r'^"clipkit.plugins.evals" = \[[^]]*"zeroshot/\*"', package_data, re.M)


# ---- provenance: every stored list equals its upstream list (needs the project's ../shared/data) ----


def clip_prompts_md(path: Path) -> dict[str, dict]:
    """CLIP's data/prompts.md: each '## Name' section holds Python `classes = [...]`, `templates = [...]`."""
    sections = re.finditer(r"^## (\S+)\n+```bash\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S)
    return {
        name: {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(code).body}
        for name, code in (match.groups() for match in sections)
    }


def upstream(origin: str, field: str):
    zeroshot = SHARED / "zeroshot"
    file, key = origin.split("#")
    if file == "data/prompts.md":
        return clip_prompts_md(zeroshot / "openai_clip_prompts.md")[key][field]
    if file.startswith("notebooks/"):
        notebook = json.loads((zeroshot / "openai_clip_imagenet_classes_templates.json").read_text())
        keys = {"imagenet_classes": "classes", "imagenet_templates": "templates"}
        return notebook[keys.get(key, "selected_7_templates")]
    if file in ("labels.json", "templates.json"):
        return json.loads((zeroshot / f"slip_{file}").read_text())[key]
    if file.startswith("clip_benchmark/"):
        stored = json.loads((zeroshot / f"clip_benchmark_{Path(file).name}").read_text())[key]
        return [t.replace("{c}", "{}") for t in stored] if field == "templates" else stored
    if file == "README.md":
        return json.loads((SHARED / "fashion-mnist" / "classes.json").read_text())["classes"]
    raise AssertionError(f"unknown origin {origin}")


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs the project's shared data folder")
def test_every_list_matches_its_source():
    folder = importlib.resources.files("clipkit.plugins.evals").joinpath("zeroshot")
    names = json.loads(folder.joinpath("classnames.json").read_text(encoding="utf-8"))
    checked = 0
    for dataset, record in names["datasets"].items():
        for source, stored in record["lists"].items():
            assert prompts.class_synonyms(dataset, source) == [
                n if isinstance(n, list) else [n] for n in upstream(stored["from"], "classes")
            ], (dataset, source)
            checked += 1
    templates = json.loads(folder.joinpath("templates.json").read_text(encoding="utf-8"))
    for style, stored in templates["any_dataset"].items():
        assert prompts.templates("imagenet", style) == upstream(stored["from"], "templates")
    for dataset, styles in templates["datasets"].items():
        for style, stored in styles.items():
            expected = upstream(stored["from"], "templates")
            assert prompts.templates(dataset, style) == expected, (dataset, style)
            checked += 1
    assert checked > 100
    # the prompts.md parser really read all 26 CLIP datasets
    assert len(clip_prompts_md(SHARED / "zeroshot" / "openai_clip_prompts.md")) == 26
