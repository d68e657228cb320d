"""``clipkit.load``: any model on disk -> (model, preprocess, tokenizer) for notebooks and scripts.

    model, preprocess, tokenizer = clipkit.load("runs/my-run/export")
    images = torch.stack([preprocess(Image.open(p)) for p in paths])     # [B, 3, S, S]
    logits = model.similarity(model.encode_image(images), model.encode_text(["a dog", "a cat"]))

Reads a clipkit export, an open_clip or Hugging Face CLIP directory, or an OpenAI-layout
``.safetensors`` state dict (:mod:`clipkit.plugins.interop`); never a pickle. Imports no training machinery
(accelerate, deepspeed), so it is cheap in a notebook.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from clipkit.contract.types import PointSet

if TYPE_CHECKING:
    from clipkit.contract.registry import Registry
    from clipkit.data.transforms import ImageTransform
    from clipkit.model import ContrastiveModel


class Preprocess:
    """PIL image (any mode) -> [3, S, S] float32: resize the short side (bicubic), centre-crop,
    normalise — the model's evaluation preprocessing, pixel-identical to torchvision's / open_clip's
    ``Resize(S, BICUBIC) + CenterCrop(S) + ToTensor() + Normalize`` on the image converted to RGB
    (clipkit's mode rule: :mod:`clipkit.data.image_modes`). Deterministic: no random generator needed."""

    def __init__(self, transform: ImageTransform) -> None:
        self.transform = transform
        self.image_size = transform.image_size

    def __call__(self, image) -> Tensor:
        # The eval transform draws nothing; a fixed Random only satisfies the shared signature.
        return self.transform(image, random.Random(0))

    def __repr__(self) -> str:
        return (
            f"Preprocess(image_size={self.image_size}, mean={self.transform.mean}, std={self.transform.std})"
        )


class Model(nn.Module):
    """A loaded model for inference (eval mode, no gradients).

    encode_image(images [B, 3, S, S] tensor, or PIL images) -> PointSet [B, M, d] of unit vectors;
    encode_text(texts (strings) or ids [B, L]) -> PointSet [B, M, d];
    similarity(a, b) -> logits [Na, Nb] through the model's own similarity (CLIP: exp(t)·<x, y>).
    A plain CLIP model has M == 1: ``.points[:, 0]`` is the familiar [B, d] embedding.
    ``model.model`` is the underlying :class:`~clipkit.model.ContrastiveModel`; ``metadata`` its
    export metadata (plugins, preprocessing, recipe).
    """

    def __init__(self, model: ContrastiveModel, metadata: dict[str, Any], preprocess: Preprocess) -> None:
        super().__init__()
        self.model = model.eval()
        self.metadata = metadata
        self.preprocess = preprocess

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode_image(self, images: Tensor | Sequence[Any] | Any) -> PointSet:
        """[B, 3, S, S] float tensor (already preprocessed), or PIL image(s) -> PointSet [B, M, d]."""
        if not isinstance(images, Tensor):
            images = [images] if not isinstance(images, list | tuple) else images
            images = torch.stack([self.preprocess(image) for image in images])
        return self.model.encode_image(images.to(self.device))

    @torch.no_grad()
    def encode_text(self, texts: str | Sequence[str] | Tensor) -> PointSet:
        """Strings (tokenized with the model's tokenizer) or ids [B, L] long -> PointSet [B, M, d]."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Tensor):
            if self.model.tokenizer is None:
                raise ValueError("this model has no tokenizer (model.pair = two_view): pass images twice")
            texts = self.model.tokenizer(list(texts))
        return self.model.encode_text(texts.to(self.device))

    @torch.no_grad()
    def similarity(self, a: PointSet, b: PointSet) -> Tensor:
        """Logits [Na, Nb] of ``a`` (images) against ``b`` (texts), random features (if any) drawn
        with the export's ``eval_seed`` as ``clipkit eval`` does."""
        from clipkit.eval.evaluate import eval_generator

        return self.model.similarity(a, b, generator=eval_generator(self.model)).i2t

    def forward(self, images, texts) -> Tensor:
        """images, texts -> logits [N_images, N_texts]."""
        return self.similarity(self.encode_image(images), self.encode_text(texts))


def load(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    registry: Registry | None = None,
    quick_gelu: bool | None = None,
) -> tuple[Model, Preprocess, Any]:
    """Load any model clipkit reads: ``(model, preprocess, tokenizer)``.

    ``path``: a clipkit export directory, an open_clip directory, a Hugging Face CLIPModel
    directory, or an OpenAI/open_clip-layout ``.safetensors`` state dict. The tokenizer maps a list
    of B strings to ids [B, L] (None for a two-view image-only model). ``quick_gelu``: the
    activation a bare state dict was trained with, which its tensors cannot say (None: from a
    config beside it or the header clipkit writes, else refused).
    """
    from clipkit.artifacts.reader import load_model
    from clipkit.contract.registry import default_registry

    options = {"quick_gelu": quick_gelu}
    contrastive, metadata = load_model(Path(path), registry or default_registry(), options=options)
    preprocess = Preprocess(contrastive.transform)
    model = Model(contrastive.to(device), metadata, preprocess).eval()
    return model, preprocess, contrastive.tokenizer
