"""Standard ResNet image encoder (He et al. 2016) with a projection head.

The backbone follows torchvision's layout (module names included, ``fc`` excepted): 7x7 stride-2
stem and 3x3 max pool ("imagenet" stem), or a 3x3 stride-1 conv and no pool ("cifar" stem, as
SimCLR and y-Aware use on 32 px images, seed 002); bottleneck blocks put the stride on the 3x3
conv (torchvision's "ResNet v1.5"); features are globally average-pooled and projected to
``embed_dim`` by a linear layer (NUCLR, seed 004: "ResNet-50 + DistilBERT, linear projection to
256") or by SimCLR's 2-layer MLP (y-Aware, seed 002: d = 128).

NUCLR starts from ImageNet weights. clipkit downloads no weights: a user who wants them loads a
torchvision ``resnet50`` state dict (minus ``fc.*``) into this module with ``strict=False`` from
their own plugin or checkpoint — the backbone's parameter names are torchvision's.

Pure torch. Shapes: B batch, S = image_size, HW = positions of the final feature map
(S / 32 squared with the imagenet stem, S / 8 squared with the cifar stem), F = final feature
width (width * 8 for basic blocks, width * 32 for bottlenecks), d = embed_dim.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from clipkit.contract.types import PointSet
from clipkit.errors import check_choice

from .conv_common import OUTPUTS, check_images, check_layers, run_blocks

BLOCKS = ("bottleneck", "basic")
STEMS = ("imagenet", "cifar")
HEADS = ("linear", "mlp")


def downsample(inplanes: int, outplanes: int, stride: int) -> nn.Sequential | None:
    """Shortcut projection (strided 1x1 conv + BN) when the shape changes, else None (identity)."""
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(
        nn.Conv2d(inplanes, outplanes, 1, stride=stride, bias=False), nn.BatchNorm2d(outplanes)
    )


class BasicBlock(nn.Module):
    """Two 3x3 convs (stride on the first) plus shortcut; [B, inplanes, H, W] -> [B, planes, H/s, W/s]."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample(inplanes, planes, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here) -> 1x1 (x4 channels) plus shortcut;
    [B, inplanes, H, W] -> [B, planes * 4, H/s, W/s]."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        outplanes = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, outplanes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(outplanes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample(inplanes, outplanes, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


def projection_head(kind: str, features: int, embed_dim: int, hidden: int | None) -> nn.Module:
    """F -> d: one linear layer, or SimCLR's MLP Linear(F, hidden) -> ReLU -> Linear(hidden, d)."""
    if kind == "linear":
        if hidden is not None:
            raise ValueError("head_hidden only applies to head='mlp'")
        return nn.Linear(features, embed_dim)
    hidden = features if hidden is None else hidden
    if hidden <= 0:
        raise ValueError(f"head_hidden must be > 0, got {hidden}")
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, embed_dim))


class ResNet(nn.Module):
    """Standard ResNet backbone -> projection head.

    forward(images [B, 3, S, S] float) -> PointSet with L2-normalised points
      output="cls":    [B, 1, d]   globally average-pooled features, projected;
      output="tokens": [B, HW, d]  every position of the final feature map (raster order), each
                                   projected by the same head.
    ``weights`` and ``mask`` are None.
    """

    #: The final projection; its input is the linear probe's "pre_projection" feature.
    projection_module_name = "proj"

    def __init__(
        self,
        *,
        embed_dim: int,
        image_size: int,
        layers: tuple[int, ...],
        width: int,
        block: str,
        stem: str,
        head: str,
        head_hidden: int | None = None,
        output: str = "cls",
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        layers = check_layers(layers)
        for name, value, choices in (("block", block, BLOCKS), ("stem", stem, STEMS), ("head", head, HEADS)):
            check_choice(name, value, choices)
        check_choice("output", output, OUTPUTS)
        for name, value in (("embed_dim", embed_dim), ("image_size", image_size), ("width", width)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.image_size = image_size
        self.output = output
        self.grad_checkpointing = grad_checkpointing
        block_class = Bottleneck if block == "bottleneck" else BasicBlock

        if stem == "imagenet":
            self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:  # 32 px images: keep the resolution (SimCLR's CIFAR variant)
            self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

        inplanes = width
        for index, blocks in enumerate(layers):
            planes = width * 2**index
            stage = [block_class(inplanes, planes, stride=1 if index == 0 else 2)]
            inplanes = planes * block_class.expansion
            stage += [block_class(inplanes, planes) for _ in range(blocks - 1)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*stage))
        self.num_features = inplanes

        self.proj = projection_head(head, inplanes, embed_dim, head_hidden)
        self.reset_parameters()

    def stages(self) -> list[nn.Sequential]:
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def sharding_blocks(self) -> list[nn.Module]:
        """The units FSDP2 shards one by one (``train.distributed.strategy=fsdp2``): every residual
        block. The stages are ``nn.Sequential``s, which the default policy (``nn.ModuleList``
        members) does not look into."""
        return [block for stage in self.stages() for block in stage]

    def reset_parameters(self) -> None:
        """torchvision's init: convs Kaiming-normal (fan_out, ReLU), BN gain 1 / bias 0.
        The head keeps torch's default Linear init."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def features(self, images: Tensor) -> Tensor:
        """[B, 3, S, S] -> [B, F, H', W'] (before pooling)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(images.to(self.conv1.weight.dtype)))))
        blocks = [block for stage in self.stages() for block in stage]
        return run_blocks(blocks, x, grad_checkpointing=self.grad_checkpointing)

    def forward(self, images: Tensor) -> PointSet:
        check_images(images, self.image_size)
        x = self.features(images).flatten(2).transpose(1, 2)  # [B, HW, F]
        if self.output == "cls":
            x = x.mean(dim=1, keepdim=True)  # [B, 1, F]: global average pooling
        return PointSet(F.normalize(self.proj(x), dim=-1))


def resnet(
    *,
    embed_dim: int,
    image_size: int = 224,
    layers: tuple[int, ...] = (3, 4, 6, 3),
    width: int = 64,
    block: str = "bottleneck",
    stem: str = "imagenet",
    head: str = "linear",
    head_hidden: int | None = None,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> ResNet:
    """Build a :class:`ResNet` (defaults: ResNet-50 with a linear projection). ``head_hidden``
    (head="mlp" only) defaults to the backbone's feature width, as in SimCLR."""
    return ResNet(
        embed_dim=embed_dim,
        image_size=image_size,
        layers=tuple(layers),
        width=width,
        block=block,
        stem=stem,
        head=head,
        head_hidden=head_hidden,
        output=output,
        grad_checkpointing=grad_checkpointing,
    )


def resnet50(
    *,
    embed_dim: int,
    image_size: int = 224,
    head: str = "linear",
    head_hidden: int | None = None,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> ResNet:
    """ResNet-50 (torchvision layout) + projection; NUCLR's image tower (seed 004, d = 256, 256 px
    in its code, ImageNet-initialised there: load weights yourself, see the module docstring)."""
    return resnet(
        embed_dim=embed_dim, image_size=image_size, layers=(3, 4, 6, 3), width=64, block="bottleneck",
        stem="imagenet", head=head, head_hidden=head_hidden, output=output,
        grad_checkpointing=grad_checkpointing,
    )  # fmt: skip


def resnet18_cifar(
    *,
    embed_dim: int,
    image_size: int = 32,
    head: str = "mlp",
    head_hidden: int | None = None,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> ResNet:
    """ResNet-18 with the CIFAR stem (3x3 stride-1 conv, no max pool) and SimCLR's 2-layer MLP head,
    as y-Aware uses on CIFAR-10/100 (seed 002, d = 128)."""
    return resnet(
        embed_dim=embed_dim, image_size=image_size, layers=(2, 2, 2, 2), width=64, block="basic",
        stem="cifar", head=head, head_hidden=head_hidden, output=output,
        grad_checkpointing=grad_checkpointing,
    )  # fmt: skip


def resnet_tiny(
    *,
    embed_dim: int,
    image_size: int = 32,
    head: str = "linear",
    head_hidden: int | None = None,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> ResNet:
    """A tiny ResNet for tests and CPU smoke runs: basic blocks (1, 1, 1, 1), width 8, CIFAR stem,
    32 px (a 4x4 final grid)."""
    return resnet(
        embed_dim=embed_dim, image_size=image_size, layers=(1, 1, 1, 1), width=8, block="basic",
        stem="cifar", head=head, head_hidden=head_hidden, output=output,
        grad_checkpointing=grad_checkpointing,
    )  # fmt: skip
