"""The plain CLIP model every layout converts through: its shape (:class:`ClipSpec`) plus a state
dict in clipkit's key layout (the keys of :class:`clipkit.model.ContrastiveModel`).

"Plain CLIP" is what OpenAI released and open_clip / Hugging Face ``CLIPModel`` share: a ViT or
modified-ResNet image tower whose output is one vector (ViT: the class token after ``ln_post``;
ResNet: attention pooling), a causal text Transformer read at the end token, linear projections
without bias, and ``logits = exp(logit_scale) · <x̂, ŷ>`` with unit vectors. LayerNorm eps is 1e-5
everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: OpenAI CLIP's image normalisation (also clipkit's and open_clip's defaults).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: CLIP BPE: the only text vocabulary a plain CLIP model is converted with (clipkit's ``clip_bpe``).
CLIP_VOCAB_SIZE = 49408
CLIP_EOS_ID, CLIP_BOS_ID = 49407, 49406


@dataclass
class VisionSpec:
    """kind "vit": patch_size, width, layers (int), heads, mlp_ratio; kind "resnet": layers (4 ints),
    width (stem width, 64 for RN50), heads (attention-pool heads)."""

    kind: str
    width: int
    layers: int | tuple[int, ...]
    heads: int
    image_size: int
    patch_size: int | None = None
    mlp_ratio: float = 4.0


@dataclass
class TextSpec:
    width: int
    layers: int
    heads: int
    context_length: int
    vocab_size: int = CLIP_VOCAB_SIZE
    mlp_ratio: float = 4.0


@dataclass
class ClipSpec:
    """The shape of a plain CLIP model. ``quick_gelu``: the towers' MLPs use x·σ(1.702x) (OpenAI's
    weights, HF's default) instead of the exact GELU (open_clip's default for its own configs)."""

    embed_dim: int
    vision: VisionSpec
    text: TextSpec
    quick_gelu: bool = False
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    extra: dict = field(default_factory=dict)  # provenance, e.g. {"converted_from": "..."}


def mlp_ratio(hidden: int, width: int, where: str) -> float:
    """The MLP ratio clipkit's blocks rebuild ``hidden`` from (``int(width * ratio) == hidden``)."""
    ratio = hidden / width
    if int(width * ratio) != hidden:
        raise ValueError(f"{where}: MLP width {hidden} is not a ratio of the model width {width}")
    return ratio
