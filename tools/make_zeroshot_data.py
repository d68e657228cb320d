"""Derive clipkit's packaged zero-shot data (``plugins/evals/zeroshot/``) from the upstream source files.

Usage: ``python tools/make_zeroshot_data.py [SHARED_DATA_DIR]`` (default ``../shared/data``, the
project's copy of the sources: ``zeroshot/`` and ``fashion-mnist/classes.json``). It rewrites
``plugins/evals/zeroshot/classnames.json`` and ``templates.json`` and copies the licence texts.

Every list keeps its provenance (``from``: upstream file and key). A list identical to another
source's list for the same dataset is stored once and referenced with ``same_as`` (classes:
another source; templates: another style, or the dataset-independent ``clip80`` / ``clip7``).
``tests/test_prompts.py`` checks every stored list against the source files again.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "plugins" / "evals" / "zeroshot"

CLIP_COMMIT = "d05afc436d78f1c48dc0dbf8e5980a9d471f35f6"
PROMPTS_MD = "data/prompts.md"
NOTEBOOK = "notebooks/Prompt_Engineering_for_ImageNet.ipynb"
SLIP_LABELS, SLIP_TEMPLATES = "labels.json", "templates.json"
CB_CLASSES = "clip_benchmark/datasets/en_classnames.json"
CB_TEMPLATES = "clip_benchmark/datasets/en_zeroshot_classification_templates.json"
FASHION_README = "README.md"

SOURCES = {
    "clip": {
        "origin": f"github.com/openai/CLIP {PROMPTS_MD} and {NOTEBOOK} @ {CLIP_COMMIT}",
        "licence": "LICENSE.openai-clip.txt",
    },
    "slip": {
        "origin": f"github.com/facebookresearch/SLIP {SLIP_LABELS} and {SLIP_TEMPLATES}",
        "licence": "LICENSE.slip.txt",
    },
    "clip_benchmark": {
        "origin": f"github.com/LAION-AI/CLIP_benchmark {CB_CLASSES} and {CB_TEMPLATES}",
        "licence": "LICENSE.clip_benchmark.txt",
    },
    "fashion_mnist": {
        "origin": "github.com/zalandoresearch/fashion-mnist README.md (Labels table) "
        "@ b2617bb6d3ffa2e429640350f613e3291e10b141",
        "licence": "LICENSE.fashion-mnist.txt",
    },
}

# canonical clipkit name -> (CLIP prompts.md section, SLIP key, CLIP_benchmark key); None = absent there
KEYS = {
    "cifar10": ("CIFAR10", "cifar10", "cifar10"),
    "cifar100": ("CIFAR100", "cifar100", "cifar100"),
    "mnist": ("MNIST", "mnist", "mnist"),
    "fashion_mnist": (None, None, None),
    "stl10": ("STL10", "stl10", "stl10"),
    "food101": ("Food101", "food101", "food101"),
    "caltech101": ("Caltech101", "caltech101", "caltech101"),
    "cars": ("StanfordCars", "cars", "cars"),
    "aircraft": ("FGVCAircraft", "aircraft", "fgvc_aircraft"),
    "flowers": ("Flowers102", "flowers", "flowers"),
    "eurosat": ("EuroSAT", "eurosat", "eurosat"),
    "dtd": ("DescribableTextures", "dtd", "dtd"),
    "pets": ("OxfordPets", "pets", "pets"),
    "sun397": ("SUN397", "sun397", "sun397"),
    "imagenet": (None, "imagenet", "imagenet1k"),  # CLIP's ImageNet lists are in the notebook
    "birdsnap": ("Birdsnap", "birdsnap", None),
    "country211": ("Country211", "country211", "country211"),
    "gtsrb": ("GTSRB", "gtsrb", "gtsrb"),
    "resisc45": ("RESISC45", "resisc45", "resisc45"),
    "rendered_sst2": ("SST2", "rendered_sst2", "renderedsst2"),
    "pcam": ("PatchCamelyon", "patch_camelyon", "pcam"),
    "voc2007": ("PascalVOC2007", "voc2007", "voc2007"),
    "hateful_memes": ("HatefulMemes", "hateful_memes", None),
    "kinetics700": ("Kinetics700", "kinetics700_frames", None),
    "ucf101": ("UCF101", "ucf101_frames", None),
    "clevr_counts": ("CLEVRCounts", "clevr_counts", "clevr_count_all"),
    "kitti": ("KITTI", "kitti_distance", "kitti_closest_vehicle_distance"),
    "fer2013": ("FacialEmotionRecognition2013", "fer2013", "fer2013"),
    "cub200": (None, "cub200", None),
    "svhn": (None, None, "svhn"),
}

# Which class-name list clipkit uses when no source is named, and why (README.md repeats this).
DEFAULTS = {
    "eurosat": "slip",
    "pets": "clip_benchmark",
    "fashion_mnist": "fashion_mnist",
    "cub200": "slip",
    "svhn": "clip_benchmark",
}
NOTES = {
    "caltech101": "102 classes: index 0 is 'background' (BACKGROUND_Google), then CLIP's names in the "
    "case-sensitive order of the 101_ObjectCategories folders (Faces, Faces_easy, Leopards, "
    "Motorbikes, accordion, ...). torchvision's Caltech101 drops the background class (101 classes, "
    "every index one lower).",
    "eurosat": "Default: SLIP's list = CLIP_benchmark's = CLIP's names in the alphabetical order of the "
    "EuroSAT folders (AnnualCrop, Forest, ...), the usual label order. CLIP's own list has the same "
    "names in another order.",
    "pets": "Default: CLIP_benchmark's list = CLIP's names (Title Case) in the official Oxford-IIIT Pet "
    "class-id order (annotations/list.txt, torchvision). CLIP's and SLIP's lists put the 12 "
    "capitalised cat breeds first (case-sensitive sort).",
    "fashion_mnist": "No CLIP, SLIP or CLIP_benchmark list; the dataset's own label names (label 0..9).",
    "imagenet": "CLIP's list names two classes twice: 'missile' (657, 744) and 'sunglasses' (836, 837); "
    "match labels by index, not by name.",
    "fer2013": "CLIP and SLIP give several names for some classes (classnames() returns the first, "
    "class_synonyms() all). SLIP and CLIP_benchmark order the classes alphabetically, CLIP in "
    "FER2013's label order (angry ... surprised, neutral).",
    "kitti": "SLIP orders the 4 classes differently from CLIP and CLIP_benchmark.",
    "clevr_counts": "CLIP/SLIP: digits in string order ('10', '3', ..., '9'); CLIP_benchmark: "
    "'three' ... 'ten' in count order.",
}


def load(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def python_placeholders(template: str) -> str:
    """CLIP_benchmark writes ``{c}``; clipkit's templates use ``str.format``'s ``{}``."""
    return template.replace("{c}", "{}")


def entry(value: list, origin: str, known: dict[str, dict]) -> dict:
    """A provenance-tagged list, or a reference to an identical list already stored."""
    for name, other in known.items():
        if other.get("names", other.get("templates")) == value:
            return {"from": origin, "same_as": name}
    return {"from": origin}


def class_lists(shared: Path) -> dict:
    zeroshot = shared / "zeroshot"
    clip = load(zeroshot / "openai_clip_prompts.json")["datasets"]
    notebook = load(zeroshot / "openai_clip_imagenet_classes_templates.json")
    slip, cb = load(zeroshot / "slip_labels.json"), load(zeroshot / "clip_benchmark_en_classnames.json")
    fashion = load(shared / "fashion-mnist" / "classes.json")["classes"]
    datasets = {}
    for name, (clip_key, slip_key, cb_key) in KEYS.items():
        candidates = []
        if clip_key:
            candidates.append(("clip", clip[clip_key]["classes"], f"{PROMPTS_MD}#{clip_key}"))
        if name == "imagenet":
            candidates.append(("clip", notebook["classes"], f"{NOTEBOOK}#imagenet_classes"))
        if slip_key in slip:
            candidates.append(("slip", slip[slip_key], f"{SLIP_LABELS}#{slip_key}"))
        if cb_key in cb:
            candidates.append(("clip_benchmark", cb[cb_key], f"{CB_CLASSES}#{cb_key}"))
        if name == "fashion_mnist":
            candidates.append(("fashion_mnist", fashion, f"{FASHION_README}#Labels"))
        lists: dict[str, dict] = {}
        for source, names, origin in candidates:
            stored = entry(names, origin, lists)
            if "same_as" not in stored:
                stored["names"] = names
            lists[source] = stored
        record = {"default": DEFAULTS.get(name, "clip")}
        if name in NOTES:
            record["note"] = NOTES[name]
        datasets[name] = {**record, "lists": lists}
    return {
        "about": "Zero-shot class names per dataset: see README.md",
        "sources": SOURCES,
        "datasets": datasets,
    }


def template_lists(shared: Path) -> dict:
    zeroshot = shared / "zeroshot"
    clip = load(zeroshot / "openai_clip_prompts.json")["datasets"]
    notebook = load(zeroshot / "openai_clip_imagenet_classes_templates.json")
    slip = load(zeroshot / "slip_templates.json")
    cb = load(zeroshot / "clip_benchmark_en_zeroshot_classification_templates.json")
    generic = {
        "clip80": {"from": f"{NOTEBOOK}#imagenet_templates", "templates": notebook["templates"]},
        "clip7": {"from": f"{NOTEBOOK}#selected 7 templates", "templates": notebook["selected_7_templates"]},
    }
    datasets = {}
    for name, (clip_key, slip_key, cb_key) in KEYS.items():
        candidates = []
        if clip_key:
            candidates.append(("clip", clip[clip_key]["templates"], f"{PROMPTS_MD}#{clip_key}"))
        if name == "imagenet":
            candidates.append(("clip", notebook["templates"], f"{NOTEBOOK}#imagenet_templates"))
        if slip_key in slip:
            candidates.append(("slip", slip[slip_key], f"{SLIP_TEMPLATES}#{slip_key}"))
        if cb_key in cb:
            converted = [python_placeholders(t) for t in cb[cb_key]]
            candidates.append(("clip_benchmark", converted, f"{CB_TEMPLATES}#{cb_key}"))
        styles: dict[str, dict] = {}
        for style, templates, origin in candidates:
            stored = entry(templates, origin, {**generic, **styles})
            if "same_as" not in stored:
                stored["templates"] = templates
            styles[style] = stored
        datasets[name] = styles
    sources = {key: SOURCES[key] for key in ("clip", "slip", "clip_benchmark")}
    about = "Zero-shot prompt templates ({} = class name) per dataset and style: see README.md"
    return {"about": about, "sources": sources, "any_dataset": generic, "datasets": datasets}


def dumps(value, indent: int = 0) -> str:
    """JSON with one line per list (compact, yet diffs stay readable)."""
    if isinstance(value, dict) and value:
        pad = " " * (indent + 1)
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return json.dumps(value, ensure_ascii=False)


def main(shared: Path) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "classnames.json").write_text(dumps(class_lists(shared)) + "\n", encoding="utf-8")
    (OUT / "templates.json").write_text(dumps(template_lists(shared)) + "\n", encoding="utf-8")
    for licence in ("LICENSE.openai-clip.txt", "LICENSE.slip.txt", "LICENSE.clip_benchmark.txt"):
        shutil.copyfile(shared / "zeroshot" / licence, OUT / licence)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared" / "data")
