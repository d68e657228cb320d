"""The frozen teacher of distillation (``train.distill``, ``clipkit shard --teacher``; docs/distillation.md).

A teacher is any model clipkit reads (a clipkit export, an open_clip or Hugging Face CLIP directory,
through :func:`clipkit.artifacts.reader.load_model`), held in eval mode with every parameter locked
and run under ``torch.no_grad`` — its embeddings are exactly those ``clipkit eval`` computes for the
same input tensor. Distillation compares one vector per input and the teacher's similarity logits
``scale · image @ text.T + bias``, so a teacher must give one point per input (M = 1) and have a
scaled-dot-product similarity (one with a ``fused_form``: ``dot`` and SigLIP's biased ``dot``); others are
refused when loaded.

Inputs: the student's batch is preprocessed for the student. When the teacher's image size, mean and
std are the student's, its images are the batch's as they are; otherwise :meth:`Teacher.images_from`
undoes the student's normalisation, resamples the same crop to the teacher's size (bicubic,
antialiased) and normalises it the teacher's way. Texts share the student's token ids when both
tokenizers are configured alike; otherwise the loader tokenizes the same caption for the teacher
(``batch["teacher_tokens"]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from clipkit.contract.types import Logits, PointSet, optional_member
from clipkit.data.transforms import ImageTransform
from clipkit.errors import ClipkitError
from clipkit.model import ContrastiveModel


class Embeddings(NamedTuple):
    """A batch's teacher embeddings: image [B, d] and text [B, d], fp32, without gradient."""

    image: Tensor
    text: Tensor


def teacher_logits(image: Tensor, text: Tensor, scale: float, bias: float) -> Tensor:
    """[Na, d] image rows, [Nb, d] text columns -> the teacher's logits [Na, Nb] (fp32)."""
    return scale * image.float() @ text.float().t() + bias


class Teacher:
    """A loaded model, frozen; ``embed`` maps teacher-ready images and token ids to its embeddings.

    scale, bias: the teacher similarity's logit scale and bias (bias 0 for CLIP's ``dot``).
    dim:         its embedding width d.
    """

    def __init__(self, model: ContrastiveModel, where: str, tokenizer_config: dict | None = None) -> None:
        if model.pair != "image_text" or model.tokenizer is None:
            raise ClipkitError(f"{where}: the teacher must be an image-text model (its pair is {model.pair})")
        form = optional_member(model.similarity, "fused_form")
        affine = form() if callable(form) else None
        if affine is None:
            raise ClipkitError(
                f"{where}: the teacher's similarity {type(model.similarity).__name__} is not a scaled dot "
                "product (it declares no fused_form); distillation compares one vector per input "
                "(teachers with the dot similarity: clipkit exports of CLIP/SigLIP recipes, open_clip, "
                "Hugging Face CLIP)"
            )
        self.model = model.eval().requires_grad_(False)
        self.where = where
        self.scale = float(affine.scale.detach())
        self.bias = 0.0 if affine.bias is None else float(affine.bias.detach().reshape(-1)[0])
        self.transform: ImageTransform = model.transform
        self.tokenizer = model.tokenizer
        self.tokenizer_config = tokenizer_config
        self.dim = self.embed_text(self.tokenizer(["a"]).to(self.device)).shape[1]

    @classmethod
    def load(cls, path: str | Path, registry, device: torch.device | str = "cpu") -> Teacher:
        """The model at ``path`` (any layout clipkit reads) as a frozen teacher on ``device``."""
        from clipkit.artifacts.reader import load_model

        model, metadata = load_model(Path(path), registry)
        recipe_model = (metadata.get("recipe") or {}).get("model") or {}
        return cls(model.to(device), str(path), recipe_model.get("tokenizer"))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> Teacher:
        self.model.to(device)
        return self

    @torch.no_grad()
    def embed(self, images: Tensor, tokens: Tensor) -> Embeddings:
        """images [B, 3, S_t, S_t] (preprocessed for the teacher), tokens [B, L] -> :class:`Embeddings`."""
        return Embeddings(self.embed_image(images), self.embed_text(tokens))

    @torch.no_grad()
    def embed_image(self, images: Tensor) -> Tensor:
        return self.vector(self.model.encode_image(images), "image")

    @torch.no_grad()
    def embed_text(self, tokens: Tensor) -> Tensor:
        return self.vector(self.model.encode_text(tokens), "text")

    def vector(self, points: PointSet, tower: str) -> Tensor:
        """A one-point-per-input PointSet [B, 1, d] -> [B, d] fp32."""
        if points.num_points != 1:
            raise ClipkitError(
                f"{self.where}: the teacher's {tower} tower gives {points.num_points} points per input; "
                "distillation compares one vector per input (M = 1)"
            )
        return points.points[:, 0].float()

    def logits(self, image: Tensor, text: Tensor) -> Tensor:
        """[Na, d] image rows, [Nb, d] text columns -> the teacher's logits [Na, Nb]."""
        return teacher_logits(image, text, self.scale, self.bias)

    def shares_preprocessing(self, student: ImageTransform) -> bool:
        """Whether the student's batch images are the teacher's input (same size and normalisation)."""
        mine = self.transform
        return (mine.image_size, tuple(mine.mean), tuple(mine.std)) == (
            student.image_size,
            tuple(student.mean),
            tuple(student.std),
        )

    def shares_tokens(self, student_tokenizer_config) -> bool:
        """Whether the student's token ids are the teacher's (both tokenizers configured alike)."""
        return self.tokenizer_config is not None and self.tokenizer_config == student_tokenizer_config

    def images_from(self, images: Tensor, student: ImageTransform) -> Tensor:
        """The student's preprocessed images [B, 3, S, S] -> the teacher's fp32 input [B, 3, S_t, S_t]:
        the same pixels when both preprocess alike, else the same crop resampled and renormalised."""
        if self.shares_preprocessing(student):
            return images.float()  # fp32 like the teacher (DeepSpeed hands half-precision inputs)
        shape = (1, 3, 1, 1)
        pixels = images.float() * torch.tensor(student.std, device=images.device).view(shape)
        pixels = pixels + torch.tensor(student.mean, device=images.device).view(shape)
        size = self.transform.image_size
        if pixels.shape[-1] != size or pixels.shape[-2] != size:
            pixels = F.interpolate(
                pixels, size=(size, size), mode="bicubic", antialias=True, align_corners=False
            )
        mean = torch.tensor(self.transform.mean, device=images.device).view(shape)
        return (pixels - mean) / torch.tensor(self.transform.std, device=images.device).view(shape)


def symmetric_logits(image: Tensor, text: Tensor, scale: float, bias: float) -> Logits:
    """The teacher's logits over a full batch: i2t [N, N] and its transpose."""
    return Logits.symmetric(teacher_logits(image, text, scale, bias))
