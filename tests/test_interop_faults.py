"""Damaged foreign weights are refused in one line naming the file and the tensor, before anything is
written: never converted or evaluated into a wrong result (docs/interop.md). Built without open_clip:
clipkit writes the open_clip directory itself."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import clipkit
from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.errors import ClipkitError
from clipkit.plugins.interop import layouts, open_clip
from clipkit.plugins.interop.spec import ClipSpec, TextSpec, VisionSpec

runner = CliRunner()


def tiny_spec() -> ClipSpec:
    vision = VisionSpec("vit", 64, 1, 1, 32, patch_size=16)
    text = TextSpec(width=64, layers=1, heads=1, context_length=16)
    return ClipSpec(embed_dim=16, vision=vision, text=text, quick_gelu=True)


@pytest.fixture
def open_clip_dir(tmp_path, registry):
    """A tiny open_clip checkpoint directory, written by clipkit's own open_clip writer."""
    torch.manual_seed(0)
    from clipkit.model import build_model

    model = build_model(layouts.recipe_for(tiny_spec(), {}, registry), registry)
    return open_clip.write_dir(tiny_spec(), model.state_dict(), tmp_path / "oc model é")


def edit_weights(directory, key, change):
    """Rewrite ``key`` of the directory's open_clip weights with ``change(tensor)``."""
    path = directory / open_clip.WEIGHTS
    state = load_file(str(path))
    state[key] = change(state[key])
    save_file(state, str(path))


def convert(source, out):
    app = make_app(make_plugin_manager(autoload=False))
    return runner.invoke(app, ["convert", str(source), str(out), "--to", "clipkit"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_file_and_tensor(open_clip_dir, tmp_path, value, registry):
    """A NaN weight used to convert and evaluate silently: every image got the same prediction."""
    edit_weights(open_clip_dir, "ln_final.weight", lambda t: t.clone().fill_(value))
    out = tmp_path / "out"
    result = convert(open_clip_dir, out)
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert str(open_clip_dir / open_clip.WEIGHTS) in line and "ln_final.weight" in line
    assert "NaN or infinite" in line and not out.exists()
    with pytest.raises(ClipkitError, match="ln_final.weight"):
        clipkit.load(open_clip_dir, registry=registry)


def test_integer_weights_in_a_floating_slot_are_refused(open_clip_dir, tmp_path):
    """An int tensor used to be cast into the float parameter without a word."""
    edit_weights(open_clip_dir, "ln_final.weight", lambda t: t.round().to(torch.int32))
    out = tmp_path / "out"
    result = convert(open_clip_dir, out)
    assert result.exit_code == 2, result.output
    # named by its key in the file, clipkit's beside it
    assert (
        "ln_final.weight (clipkit's text_encoder.ln_final.weight): torch.int32 vs torch.float32"
        in result.output
    )
    assert str(open_clip_dir / open_clip.WEIGHTS) in result.output and not out.exists()


def test_sound_weights_still_convert(open_clip_dir, tmp_path):
    result = convert(open_clip_dir, tmp_path / "out")
    assert result.exit_code == 0, result.output


def test_a_directory_with_both_layouts_reads_the_open_clip_weights_and_says_so(
    open_clip_dir, tmp_path, registry
):
    """open_clip's models on the Hugging Face Hub hold both layouts side by side (the same weights
    twice): such a folder is read, as open_clip, with one line saying so; a folder whose open_clip
    weights are missing is read as the Hugging Face model whose weights are there."""
    import clipkit.plugins.interop.layouts as layouts

    (open_clip_dir / "config.json").write_text('{"model_type": "clip"}', encoding="utf-8")
    assert layouts.detect(open_clip_dir) == "open_clip"  # no HF weights yet: nothing to choose
    save_file({"logit_scale": torch.ones(())}, str(open_clip_dir / "model.safetensors"))
    result = convert(open_clip_dir, tmp_path / "out")
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(said) == 1 and str(open_clip_dir) in said[0] and "reading the open_clip one" in said[0]
    (open_clip_dir / "open_clip_model.safetensors").unlink()
    assert layouts.detect(open_clip_dir) == "hf"


#: A command reading the model at the end of its arguments; OUT is the tmp folder's "out".
READERS = {
    "convert": lambda model, out: ["convert", model, out],
    "eval": lambda model, out: ["eval", model, "--task", "retrieval", "--data", "synthetic://shapes?n=8"],
}


@pytest.mark.parametrize("command", sorted(READERS))
def test_a_symlink_loop_is_one_line_naming_the_link(tmp_path, command):
    """A path that is a symbolic link loop was a pathlib RuntimeError traceback."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    app = make_app(make_plugin_manager(autoload=False))
    result = runner.invoke(app, READERS[command](str(loop), str(tmp_path / "out")))
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert str(loop) in line and "symbolic link loop" in line
    assert not (tmp_path / "out").exists()
