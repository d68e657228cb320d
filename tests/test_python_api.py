"""`clipkit.load` for notebooks: any layout -> (model, preprocess, tokenizer); the example in
docs/python.md runs; loading imports no training machinery."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import clipkit
from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.model import build_model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "python.md"
OVERRIDES = ["model.tokenizer.name=clip_bpe", "model.tokenizer.context_length=16"]


@pytest.fixture
def export(tmp_path, registry):
    """A tiny CLIP export (untrained: loading does not care)."""
    recipe = validate_or_raise(load_recipe("clip@tiny", OVERRIDES, registry=registry), registry)
    torch.manual_seed(0)
    return write_export(build_model(recipe, registry), recipe, tmp_path / "export", registry)


def test_load_gives_model_preprocess_tokenizer(export):
    model, preprocess, tokenizer = clipkit.load(export)
    pictures = [Image.new("RGB", (50, 40), colour) for colour in ("red", "blue")]
    images = torch.stack([preprocess(p) for p in pictures])
    assert images.shape == (2, 3, 48, 48)
    expected = model.model.transform(pictures[0], random.Random(123))  # the eval transform, any rng
    assert torch.equal(images[0], expected)

    from_tensors, from_pil = model.encode_image(images), model.encode_image(pictures)
    torch.testing.assert_close(from_pil.points, from_tensors.points)
    texts = ["a red circle", "a blue square", "a dog"]
    from_strings, from_ids = model.encode_text(texts), model.encode_text(tokenizer(texts))
    torch.testing.assert_close(from_strings.points, from_ids.points)
    logits = model.similarity(from_tensors, from_strings)
    assert logits.shape == (2, 3)
    scale = model.model.similarity.scale()
    torch.testing.assert_close(logits, scale * from_tensors.points[:, 0] @ from_strings.points[:, 0].t())
    assert not model.training and not logits.requires_grad


def test_docs_example_runs(export, capsys):
    """The first Python block of docs/python.md, on a real export instead of its placeholder path."""
    code = re.search(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S).group(1)
    assert 'MODEL = "runs/clip-tiny/export"' in code
    code = code.replace('"runs/clip-tiny/export"', repr(str(export)))
    exec(compile(code, str(DOCS), "exec"), {})
    printed = capsys.readouterr().out
    assert "tensor" in printed and "torch.Size([1, 64])" in printed


def test_load_imports_no_training_machinery(export):
    script = (
        "import sys, clipkit\n"
        f"model, preprocess, tokenizer = clipkit.load({str(export)!r})\n"
        "model.encode_text(['a cat'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('accelerate', 'deepspeed'))\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_load_of_something_else_is_a_clear_error(tmp_path):
    from clipkit.errors import ClipkitError

    with pytest.raises(ClipkitError, match="clipkit.json is missing"):
        clipkit.load(tmp_path)
