"""Round trips with real open_clip models: tiny random CLIPs built *in open_clip*, saved in its own
format, converted into clipkit, compared output for output, then converted back and loaded by open_clip.

Skipped without the ``interop`` extra (``pip install '.[interop]'``); see tests/interop_support.py.
"""

from __future__ import annotations

import pytest
import torch
from interop_support import import_open_clip
from safetensors.torch import save_file

from clipkit.errors import ClipkitError
from clipkit.plugins.interop.layouts import convert, detect, load_model

TEXTS = ["a photo of a cat", "a red square!", "two dogs, playing", ""]
VIT = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
RN = {
    "embed_dim": 16,
    "vision_cfg": {
        "image_size": 64,
        "layers": [1, 2, 1, 1],
        "width": 8,
        "head_width": 64,
        "patch_size": None,
    },
    "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)  # not CLIP's, so the test sees them carried over
CONFIGS = {"vit": VIT, "vit-quick_gelu": {**VIT, "quick_gelu": True}, "rn": RN}
# A bare state dict has no config: heads are width / 64 there (OpenAI's rule), so 64-wide towers.
OPENAI_TEXT = {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1}
OPENAI = {
    "vit": {"embed_dim": 16, "quick_gelu": True, "text_cfg": OPENAI_TEXT,
            "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8}},
    "rn": {"embed_dim": 16, "quick_gelu": True, "text_cfg": OPENAI_TEXT,
           "vision_cfg": {"image_size": 64, "layers": [1, 1, 2, 1], "width": 8}},
}  # fmt: skip


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (open_clip zero-initialises biases and RN's last BN gains, which would
    hide a swapped or dropped tensor); BN statistics stay valid (variances > 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif name != "logit_scale":
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))


def open_clip_model(config: dict, seed: int = 0):
    open_clip = import_open_clip()
    torch.manual_seed(seed)
    model = open_clip.model.CLIP(**config).eval()
    # What create_model attaches (save_config_for_hf reads it): CLIP's normalisation.
    open_clip.factory.set_model_preprocess_cfg(model, {"mean": MEAN, "std": STD})
    perturb(model, seed)
    return model


def save_open_clip_dir(model, config: dict, directory):
    """open_clip's own writer for the config; the weights as its ``save_for_hf`` writes them."""
    from open_clip.push_to_hf_hub import save_config_for_hf

    directory.mkdir(parents=True)
    save_file(model.state_dict(), str(directory / "open_clip_model.safetensors"))
    save_config_for_hf(model, directory / "open_clip_config.json", config)
    return directory


def inputs(config: dict, seed: int = 1):
    from clipkit.plugins.tokenizers.clip_bpe import ClipBPETokenizer

    size = config["vision_cfg"]["image_size"]
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return images, ClipBPETokenizer(context_length=config["text_cfg"]["context_length"])(TEXTS)


def assert_same_outputs(theirs, ours, config: dict) -> None:
    """encode_image, encode_text (unit vectors) and the logits agree within 1e-5 (fp32)."""
    images, tokens = inputs(config)
    with torch.no_grad():
        image_ref = theirs.encode_image(images, normalize=True)
        text_ref = theirs.encode_text(tokens, normalize=True)
        logits_ref = theirs.logit_scale.exp() * image_ref @ text_ref.t()
        image, text = ours.encode_image(images), ours.encode_text(tokens)
        logits = ours.similarity(image, text).i2t
    torch.testing.assert_close(image.points[:, 0], image_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(text.points[:, 0], text_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, logits_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_open_clip_dir_round_trip(name, tmp_path, registry):
    open_clip = import_open_clip()
    config = CONFIGS[name]
    original = open_clip_model(config)
    source = save_open_clip_dir(original, config, tmp_path / "open_clip")
    assert detect(source) == "open_clip"

    exported = convert(source, tmp_path / "export", "clipkit", registry)
    ours, _ = load_model(exported, registry)
    assert_same_outputs(original, ours, config)

    back = convert(exported, tmp_path / "back", "open_clip", registry)
    reloaded = open_clip.create_model(f"local-dir:{back}").eval()
    assert_same_outputs(reloaded, ours, config)
    for key, value in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


@pytest.mark.parametrize("name", sorted(OPENAI))
def test_openai_state_dict_round_trip(name, tmp_path, registry):
    """A bare OpenAI-layout state dict (no config): the shape is read off the tensors; the activation
    (QuickGELU, as OpenAI's weights use) is told, since the tensors cannot say."""
    config = OPENAI[name]
    original = open_clip_model(config, seed=3)
    save_file(original.state_dict(), str(tmp_path / "weights.safetensors"))
    ours, metadata = load_model(tmp_path / "weights.safetensors", registry, quick_gelu=True)
    assert_same_outputs(original, ours, config)

    source, again_path = tmp_path / "weights.safetensors", tmp_path / "again.safetensors"
    out = convert(source, again_path, "state_dict", registry, quick_gelu=True)
    from safetensors.torch import load_file

    again = load_file(str(out))
    assert sorted(again) == sorted(original.state_dict())
    assert all(torch.equal(again[k], v) for k, v in original.state_dict().items())


def test_state_dict_activation_is_a_choice(tmp_path, registry):
    """The tensors cannot say which activation trained them: an exact-GELU model read as QuickGELU
    differs, and ``quick_gelu=False`` reads it right."""
    config = {**OPENAI["vit"], "quick_gelu": False}
    original = open_clip_model(config, seed=4)
    save_file(original.state_dict(), str(tmp_path / "w.safetensors"))
    out = convert(tmp_path / "w.safetensors", tmp_path / "export", "clipkit", registry, quick_gelu=False)
    ours, _ = load_model(out, registry)
    assert_same_outputs(original, ours, config)
    wrong, _ = load_model(tmp_path / "w.safetensors", registry, quick_gelu=True)
    images, _ = inputs(config)
    with torch.no_grad():
        assert not torch.allclose(
            wrong.encode_image(images).points, ours.encode_image(images).points, atol=1e-5
        )


def test_clip_bpe_ids_match_open_clip():
    open_clip = import_open_clip()
    from clipkit.plugins.tokenizers.clip_bpe import ClipBPETokenizer

    theirs = open_clip.tokenizer.SimpleTokenizer(context_length=20)(TEXTS)
    assert torch.equal(ClipBPETokenizer(context_length=20)(TEXTS), theirs)


def test_non_plain_open_clip_config_is_refused(tmp_path, registry):
    config = {**VIT, "vision_cfg": {**VIT["vision_cfg"], "attentional_pool": True}}
    (tmp_path / "m").mkdir()
    import json

    (tmp_path / "m" / "open_clip_config.json").write_text(json.dumps({"model_cfg": config}))
    save_file({"logit_scale": torch.zeros(())}, str(tmp_path / "m" / "open_clip_model.safetensors"))
    with pytest.raises(ClipkitError, match="vision_cfg.attentional_pool=True"):
        convert(tmp_path / "m", tmp_path / "out", "clipkit", registry)
