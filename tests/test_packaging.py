"""The wheel ships plugins/ and recipes/ inside clipkit, never as top-level packages."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clean_copy(destination: Path) -> Path:
    """The source tree without build outputs: a wheel built in the checkout itself could pick up
    stale files from an ignored build/ folder and pass although package-data misses them."""
    anywhere = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__")
    top_only = {"build", "runs", "data", "exports"}  # run outputs at the root; clipkit/data/ is a package

    def ignore(directory: str, names: list[str]) -> set[str]:
        ignored = set(anywhere(directory, names))
        if Path(directory) == ROOT:
            ignored |= top_only & set(names)
        return ignored

    return Path(shutil.copytree(ROOT, destination, ignore=ignore))


def test_wheel_contents(tmp_path):
    source = clean_copy(tmp_path / "src")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        str(tmp_path / "wheel"),
        str(source),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    # The distribution is clipkit-contrastive (PyPI's `clipkit` is another project); the import
    # package and the command stay `clipkit`.
    (wheel,) = (tmp_path / "wheel").glob("clipkit_contrastive-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "clipkit/plugins/similarities/dot.py" in names
    assert "clipkit/plugins/sources/synthetic_shapes.py" in names
    # every package of the layout (stages and plugin kinds) ships
    packages = {
        "data",
        "train",
        "train/runtime",
        "eval",
        "plugins/encoders",
        "plugins/evals",
        "plugins/interop",
    }
    assert {f"clipkit/{package}/__init__.py" for package in packages} <= set(names)
    assert "clipkit/plugins/interop/open_clip.py" in names and "clipkit/plugins/interop/hf.py" in names
    assert "clipkit/artifacts/loading.py" in names and "clipkit/model/init_weights.py" in names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "Name: clipkit-contrastive" in zipfile.ZipFile(wheel).read(metadata).decode()
    assert "clipkit/recipes/quickstart.yaml" in names and "clipkit/recipes/clip.yaml" in names
    # CLIP's BPE vocabulary ships as package data with its (MIT) licence
    assert "clipkit/plugins/tokenizers/clip_bpe_vocab/bpe_simple_vocab_16e6.txt.gz" in names
    assert "clipkit/plugins/tokenizers/clip_bpe_vocab/LICENSE.openai-clip.txt" in names
    # zero-shot class names / templates (clipkit.plugins.evals.prompts) with their licences
    zeroshot = {"classnames.json", "templates.json", "README.md", "LICENSE.openai-clip.txt"}
    zeroshot |= {"LICENSE.slip.txt", "LICENSE.clip_benchmark.txt", "LICENSE.fashion-mnist.txt"}
    assert {f"clipkit/plugins/evals/zeroshot/{name}" for name in zeroshot} <= set(names)
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"clipkit", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "clipkit = clipkit.app.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


#: `clipkit` with an extra, as an install instruction would write it; on PyPI that name is an
#: unrelated tool (it pulled biopython and took over the `clipkit` command). The pattern is split so
#: this file does not match itself.
WRONG_DISTRIBUTION = re.compile(r"(?<![\w.-])" + "clipkit" + r"\[")


def test_install_instructions_name_the_real_distribution():
    """Every `pip install` in the package, its plugins, tests and docs names clipkit-contrastive[...]
    or the local path (CHANGELOG.md is history and is not scanned)."""
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("clipkit", "plugins", "docs", "tests", "recipes", "benchmarks", "tools"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh")]
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if WRONG_DISTRIBUTION.search(line)
    ]
    assert not offending, "install text names the wrong distribution:\n" + "\n".join(offending)


def test_install_hint_names_the_distribution():
    from clipkit import DISTRIBUTION, install_hint

    assert DISTRIBUTION == "clipkit-contrastive"
    assert "pip install 'clipkit-contrastive[trackers]'" in install_hint("trackers")
    assert "pip install -e '.[trackers]'" in install_hint("trackers")


def test_license_file_matches_the_metadata():
    assert re.search(r'^license = \{ text = "MIT" \}$', (ROOT / "pyproject.toml").read_text(), re.M)
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "clipkit authors" in text
    assert "Permission is hereby granted, free of charge" in text
