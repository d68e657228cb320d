"""Round trips with real Hugging Face ``transformers.CLIPModel``s: tiny random models built in
transformers, saved with ``save_pretrained``, converted into clipkit and compared output for output,
then converted back and loaded with ``from_pretrained``. Plus the refusals (ResNet to HF, non-CLIP
towers). Skipped without the ``interop`` extra.
"""

from __future__ import annotations

import pytest
import torch
from interop_support import import_transformers

from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.errors import ClipkitError
from clipkit.model import build_model
from clipkit.plugins.interop.layouts import convert, detect, load_model

TEXTS = ["a photo of a cat", "a red square!", "two dogs, playing", ""]
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def hf_model(hidden_act: str = "quick_gelu", seed: int = 0):
    transformers = import_transformers()
    text = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
            "max_position_embeddings": 20, "hidden_act": hidden_act}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
              "image_size": 32, "patch_size": 8, "hidden_act": hidden_act}  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(seed)
    model = transformers.CLIPModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random biases and LayerNorms too: zeros would hide a dropped tensor
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and name != "logit_scale":
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    return model


def save_hf(model, directory):
    import json

    model.save_pretrained(directory)
    # CLIPImageProcessor's file, as a Hub repository ships it (only mean/std are read).
    (directory / "preprocessor_config.json").write_text(json.dumps({"image_mean": MEAN, "image_std": STD}))
    return directory


def inputs(seed: int = 1):
    from clipkit.plugins.tokenizers.clip_bpe import ClipBPETokenizer

    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return images, ClipBPETokenizer(context_length=20)(TEXTS)


def assert_same_outputs(theirs, ours) -> None:
    """Unit image/text embeddings and logits of HF's forward equal clipkit's within 1e-5 (fp32)."""
    images, tokens = inputs()
    with torch.no_grad():
        reference = theirs(input_ids=tokens, pixel_values=images)
        image, text = ours.encode_image(images), ours.encode_text(tokens)
        logits = ours.similarity(image, text).i2t
    torch.testing.assert_close(image.points[:, 0], reference.image_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(text.points[:, 0], reference.text_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, reference.logits_per_image, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_hf_round_trip(hidden_act, tmp_path, registry):
    transformers = import_transformers()
    original = hf_model(hidden_act)
    source = save_hf(original, tmp_path / "hf")
    assert detect(source) == "hf"

    exported = convert(source, tmp_path / "export", "clipkit", registry)
    ours, metadata = load_model(exported, registry)
    assert metadata["preprocessing"]["mean"] == MEAN and metadata["preprocessing"]["std"] == STD
    # recipe.yaml beside the export builds the same architecture (for `clipkit train DIR/recipe.yaml`)
    recipe = validate_or_raise(load_recipe(str(exported / "recipe.yaml"), [], registry=registry), registry)
    build_model(recipe, registry).load_state_dict(ours.state_dict(), strict=True)
    assert_same_outputs(original, ours)

    back = convert(exported, tmp_path / "back", "hf", registry)
    reloaded = transformers.CLIPModel.from_pretrained(back).eval()
    assert_same_outputs(reloaded, ours)
    theirs = reloaded.state_dict()
    for key, value in original.state_dict().items():
        assert torch.equal(theirs[key], value), key
    # The tokenizer files written beside it give clip_bpe's ids (HF pads differently: compare unpadded)
    _, tokens = inputs()
    hf_ids = transformers.CLIPTokenizer.from_pretrained(back)(TEXTS)["input_ids"]
    assert hf_ids == [row[: int(row.nonzero().max()) + 1].tolist() for row in tokens]


def test_hf_to_open_clip_and_back(tmp_path, registry):
    """HF -> open_clip directory -> HF without a clipkit export in between: weights bit-identical."""
    transformers = import_transformers()
    original = hf_model(seed=2)
    source = save_hf(original, tmp_path / "hf")
    convert(source, tmp_path / "oc", "open_clip", registry)
    convert(tmp_path / "oc", tmp_path / "hf2", "hf", registry)
    again = transformers.CLIPModel.from_pretrained(tmp_path / "hf2").state_dict()
    assert all(torch.equal(again[k], v) for k, v in original.state_dict().items())


def export_of(spec: str, tmp_path, registry, overrides=()):
    recipe = validate_or_raise(load_recipe(spec, list(overrides), registry=registry), registry)
    torch.manual_seed(0)
    return write_export(build_model(recipe, registry), recipe, tmp_path / spec.replace("@", "-"), registry)


def test_resnet_to_hf_is_refused(tmp_path, registry):
    export = export_of(
        "clip@tiny", tmp_path, registry,
        ["model.image_encoder.name=rn_tiny", "model.image_size=64", "model.tokenizer.name=clip_bpe",
         "model.tokenizer.context_length=16"],
    )  # fmt: skip
    convert(export, tmp_path / "oc", "open_clip", registry)  # ResNet towers do go to open_clip
    with pytest.raises(ClipkitError, match="no modified-ResNet image tower"):
        convert(export, tmp_path / "hf", "hf", registry)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("spec", "overrides", "named"),
    [
        ("clip@tiny", [], "model.tokenizer 'hashed_words'"),
        ("wpse@tiny", ["model.tokenizer.name=clip_bpe"], "model.image_encoder 'vit_tiny'"),
        ("siglip@tiny", ["model.tokenizer.name=clip_bpe"], "similarity 'dot'"),
    ],
)
def test_towers_without_a_clip_counterpart_are_named(spec, overrides, named, tmp_path, registry):
    export = export_of(spec, tmp_path, registry, overrides)
    with pytest.raises(ClipkitError, match=f"{named} has no plain-CLIP counterpart"):
        convert(export, tmp_path / "out", "open_clip", registry)
    assert not (tmp_path / "out").exists()
