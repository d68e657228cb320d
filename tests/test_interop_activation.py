"""A bare OpenAI/open_clip-layout state dict does not say which activation trained it (QuickGELU
or exact GELU; reading one as the other moves features by ~1e-3 with no error): clipkit takes it
from evidence (an open_clip_config.json beside the file, the header clipkit writes) or refuses the
file naming the flag to pass. Built without open_clip: clipkit writes the state dict itself."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import clipkit
from clipkit.app.cli import make_app
from clipkit.errors import ClipkitError
from clipkit.plugins.interop import layouts, open_clip
from clipkit.plugins.interop.spec import ClipSpec, TextSpec, VisionSpec

runner = CliRunner()


def spec(quick_gelu: bool) -> ClipSpec:
    vision = VisionSpec("vit", 64, 1, 1, 32, patch_size=16)
    text = TextSpec(width=64, layers=1, heads=1, context_length=16)
    return ClipSpec(embed_dim=16, vision=vision, text=text, quick_gelu=quick_gelu)


@pytest.fixture
def exact_gelu_state_dict(tmp_path, registry):
    """A bare state dict of an exact-GELU ViT (open_clip's own default), as open_clip saves it: no
    config beside it, nothing in its header."""
    torch.manual_seed(0)
    recipe = layouts.recipe_for(spec(False), {}, registry)
    from clipkit.model import build_model

    model = build_model(recipe, registry)
    written = open_clip.write_state_dict(spec(False), model.state_dict(), tmp_path / "w.safetensors")
    path = tmp_path / "bare" / "ViT-tiny.safetensors"
    path.parent.mkdir()
    save_file(load_file(str(written)), str(path))  # no metadata: what open_clip / OpenAI files hold
    return path


def test_convert_of_a_bare_state_dict_refuses_to_guess_the_activation(exact_gelu_state_dict, tmp_path):
    """`clipkit convert W.safetensors OUT` used to assume QuickGELU silently."""
    out = tmp_path / "export"
    result = runner.invoke(make_app(), ["convert", str(exact_gelu_state_dict), str(out)])
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert str(exact_gelu_state_dict) in line and "--quick-gelu" in line and "--no-quick-gelu" in line
    assert "Traceback" not in result.output and not out.exists()
    assert exact_gelu_state_dict.is_file()  # the source is untouched


def test_load_and_eval_of_a_bare_state_dict_refuse_without_evidence(exact_gelu_state_dict, registry):
    with pytest.raises(ClipkitError, match="pass --quick-gelu or --no-quick-gelu"):
        clipkit.load(exact_gelu_state_dict, registry=registry)
    model, _, _ = clipkit.load(exact_gelu_state_dict, registry=registry, quick_gelu=False)
    activations = {type(m).__name__ for m in model.modules() if "GELU" in type(m).__name__}
    assert activations == {"GELU"}
    data = "synthetic://shapes?n=8&image_size=32"  # valid task arguments: the model is what is refused
    result = runner.invoke(
        make_app(), ["eval", str(exact_gelu_state_dict), "--task", "retrieval", "--data", data]
    )
    assert result.exit_code == 2 and "--no-quick-gelu" in result.output, result.output


def test_the_flag_a_config_beside_it_or_clipkits_header_decide(exact_gelu_state_dict, tmp_path, registry):
    out = tmp_path / "export"
    result = runner.invoke(make_app(), ["convert", str(exact_gelu_state_dict), str(out), "--no-quick-gelu"])
    assert result.exit_code == 0, result.output
    assert (
        json.loads((out / "clipkit.json").read_text())["recipe"]["model"]["image_encoder"]["quick_gelu"]
        is False
    )
    # open_clip_config.json beside the file (as open_clip's hub folders hold it) is evidence.
    config = {"model_cfg": {"embed_dim": 16, "quick_gelu": True}}
    (exact_gelu_state_dict.parent / open_clip.CONFIG).write_text(json.dumps(config))
    spec_read, _ = layouts.read(exact_gelu_state_dict, registry)
    assert spec_read.quick_gelu is True
    # A state dict clipkit writes records its activation in the header: a round trip needs no flag.
    again = runner.invoke(
        make_app(), ["convert", str(out), str(tmp_path / "again.safetensors"), "--to", "state_dict"]
    )
    assert again.exit_code == 0, again.output
    assert layouts.read(tmp_path / "again.safetensors", registry)[0].quick_gelu is False
