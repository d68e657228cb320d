"""A model clipkit did not train, evaluated as it is: `clipkit convert` / `clipkit eval` on open_clip
and Hugging Face directories, zero-shot equal to open_clip's own classifier, and `clipkit report`
putting the baseline next to a clipkit model. Skipped without the ``interop`` extra."""

from __future__ import annotations

import json
import random

import pytest
import torch
from interop_support import import_open_clip, import_transformers
from test_interop_hf import hf_model, save_hf
from test_interop_open_clip import VIT, open_clip_model, save_open_clip_dir
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.eval.evaluate import load_samples
from clipkit.eval.report_index import eval_report_path
from clipkit.plugins.evals.zero_shot import ZeroShot
from clipkit.plugins.interop.layouts import load_model

runner = CliRunner()
DATA = "synthetic://shapes?n=48&split=train&image_size=32"
TEMPLATES = ["a photo of a {}.", "a {} shape", "something {}"]


def app():
    return make_app(make_plugin_manager(autoload=False))


def test_zero_shot_equals_open_clips_own_classifier(tmp_path, registry):
    """Same images (clipkit's preprocessing), same prompts: clipkit's zero-shot task on the converted
    model predicts exactly what open_clip's build_zero_shot_classifier does with the original."""
    open_clip = import_open_clip()
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    original = open_clip_model(VIT, seed=1)  # a seed whose random model predicts several classes
    source = save_open_clip_dir(original, VIT, tmp_path / "oc")
    ours, _ = load_model(source, registry)

    task = ZeroShot(data=DATA, label="colour", templates=TEMPLATES)
    result = task(ours, registry)

    samples, info = load_samples(DATA, registry=registry)
    classnames = info["labels"]["colour"]["classes"]
    labels = torch.tensor([classnames.index(s.meta["colour"]) for s in samples])
    rng = random.Random(0)
    from clipkit.data.transforms import decode_transformed

    images = torch.stack([decode_transformed(s.image, ours.transform, rng, s.key)[0] for s in samples])
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=VIT["text_cfg"]["context_length"])
    with torch.no_grad():
        classifier = build_zero_shot_classifier(original, tokenizer, classnames, TEMPLATES)  # [d, C]
        predictions = (original.encode_image(images, normalize=True) @ classifier).argmax(dim=1)
    assert len(set(predictions.tolist())) > 1  # a model that predicts one class would prove little
    assert result["top1"] == float((predictions == labels).double().mean())


@pytest.mark.slow
def test_cli_convert_eval_and_report_a_baseline(tmp_path):
    """`clipkit eval` reads a Hugging Face directory directly; `clipkit report` compares it with a
    clipkit export of the same weights (converted with `clipkit convert`): identical scores."""
    import_transformers()
    source = save_hf(hf_model(seed=5), tmp_path / "hf-baseline")
    converted = runner.invoke(app(), ["convert", str(source), str(tmp_path / "mine"), "--to", "clipkit"])
    assert converted.exit_code == 0, converted.output
    for model in (source, tmp_path / "mine"):
        args = ["eval", str(model), "--task", "zero_shot", "--data", DATA, "--label", "shape", "--no-plots"]
        result = runner.invoke(app(), args)
        assert result.exit_code == 0, result.output
    baseline = json.loads(eval_report_path(source).read_text())  # the newest report beside each
    mine = json.loads(eval_report_path(tmp_path / "mine").read_text())
    assert baseline["results"][0]["top1"] == mine["results"][0]["top1"]

    report = runner.invoke(
        app(), ["report", str(source), str(tmp_path / "mine"), "--out", str(tmp_path / "r")]
    )
    assert report.exit_code == 0, report.output
    table = (tmp_path / "r" / "eval.md").read_text()
    assert "hf-baseline" in table and "mine" in table


def test_cli_convert_refuses_pickles(tmp_path):
    (tmp_path / "ViT-B-32.pt").write_bytes(b"not read")
    result = runner.invoke(app(), ["convert", str(tmp_path / "ViT-B-32.pt"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "never loaded" in result.output and not (tmp_path / "out").exists()


def test_plugins_says_what_converts():
    result = runner.invoke(app(), ["plugins"])
    assert result.exit_code == 0
    assert "plain CLIP models only" in result.output and "clip_resnet" in result.output
