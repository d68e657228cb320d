"""3-D DenseNet-BC image encoder for volumes (y-Aware's brain-MRI recipe, seed 002, METHODS §9).

DenseNet-BC (Huang et al. 2017) with every 2-D operation made 3-D (a k×k convolution becomes
k×k×k): stem conv 7³ stride 2 -> BN -> ReLU -> max-pool 3³ stride 2, then dense blocks joined by
transitions (BN -> ReLU -> 1³ conv halving the channels -> average-pool 2³), a final BN, ReLU,
global average pooling, a projection head to ``embed_dim`` and L2 normalisation. DenseNet-121 is
growth 32, blocks (6, 12, 24, 16), bottleneck 4·growth, 64 stem channels.

The head follows the y-Aware / SimCLR recipe: "mlp" = Linear(F, 512) -> ReLU -> Linear(512, d)
(the official y-Aware code's ``hidden_representation`` and ``head_projection``, d = 128),
"linear" = Linear(F, d). The official y-Aware code's "encoder" mode drops the final BatchNorm
(norm5) of torchvision's DenseNet; here it is kept by default (``final_norm=True``, the standard
DenseNet-BC backbone) and ``final_norm=False`` gives the code's variant.

Shapes: B batch, C = in_channels, S = image_size (cubic volumes), F = backbone channels
(1024 for DenseNet-121), d = embed_dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from clipkit.contract.registry import preset
from clipkit.contract.types import PointSet
from clipkit.errors import check_choice

from .conv_common import recompute_contexts
from .vit import check_positive

HEADS = ("mlp", "linear")

#: Width of the "mlp" head's hidden layer (y-Aware code: Linear(F, 512) -> ReLU -> Linear(512, 128)).
MLP_HIDDEN = 512


class DenseLayer(nn.Module):
    """BN -> ReLU -> 1³ conv (bn_size·growth) -> BN -> ReLU -> 3³ conv (growth).

    forward(features: list of [B, C_i, s, s, s]) -> [B, growth, s, s, s]; the concatenation of all
    earlier outputs happens inside, so a checkpointed layer stores only its inputs (the
    "memory-efficient DenseNet" of Pleiss et al. 2017: the concatenations, the bulk of the memory,
    are recomputed in backward).
    """

    def __init__(self, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        bottleneck = bn_size * growth
        self.norm1 = nn.BatchNorm3d(in_channels)
        self.conv1 = nn.Conv3d(in_channels, bottleneck, kernel_size=1, bias=False)
        self.norm2 = nn.BatchNorm3d(bottleneck)
        self.conv2 = nn.Conv3d(bottleneck, growth, kernel_size=3, padding=1, bias=False)

    def forward(self, *features: Tensor) -> Tensor:
        x = self.conv1(F.relu(self.norm1(torch.cat(features, dim=1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    """``layers`` dense layers, each fed the block input and every earlier layer's output.

    [B, C, s, s, s] -> [B, C + layers·growth, s, s, s]. With ``grad_checkpointing`` (only while
    training with grad enabled) each layer is recomputed in backward, its BatchNorm running
    statistics updated once (see :func:`.conv_common.batchnorm_stats_preserved`).
    """

    def __init__(self, layers: int, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth, growth, bn_size) for i in range(layers)
        )

    def forward(self, x: Tensor) -> Tensor:
        use_checkpoint = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        features = [x]
        for layer in self.layers:
            if use_checkpoint:
                contexts = partial(recompute_contexts, layer)
                out = checkpoint(layer, *features, use_reentrant=False, context_fn=contexts)
            else:
                out = layer(*features)
            features.append(out)
        return torch.cat(features, dim=1)


def transition(in_channels: int, out_channels: int) -> nn.Sequential:
    """BN -> ReLU -> 1³ conv -> 2³ average pool: [B, C, s, s, s] -> [B, C', s/2, s/2, s/2]."""
    return nn.Sequential(
        nn.BatchNorm3d(in_channels),
        nn.ReLU(),
        nn.Conv3d(in_channels, out_channels, kernel_size=1, bias=False),
        nn.AvgPool3d(kernel_size=2, stride=2),
    )


class DenseNet3d(nn.Module):
    """3-D DenseNet-BC backbone + projection head (see the module docstring).

    forward(volumes [B, C, S, S, S] float) -> PointSet(points [B, 1, d] L2-normalised).
    ``backbone`` (stem, blocks, transitions, final BN) is the part whose size matches the
    published DenseNet counts; ``head`` maps the pooled [B, F] features to [B, d].
    """

    #: The final projection; its input is the linear probe's "pre_projection" feature.
    projection_module_name = "head"

    def __init__(
        self,
        *,
        embed_dim: int,
        image_size: int,
        in_channels: int = 1,
        growth: int = 32,
        blocks: Sequence[int] = (6, 12, 24, 16),
        init_features: int = 64,
        bn_size: int = 4,
        head: str = "mlp",
        final_norm: bool = True,
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        blocks = check_blocks(blocks)
        check_positive(
            embed_dim=embed_dim,
            image_size=image_size,
            in_channels=in_channels,
            growth=growth,
            init_features=init_features,
            bn_size=bn_size,
        )
        check_choice("head", head, HEADS)
        # Stem /4, each transition /2: below this the last average pool would get an empty volume.
        stride = 4 * 2 ** (len(blocks) - 1)
        if image_size < stride:
            raise ValueError(
                f"image_size must be >= {stride} for {len(blocks)} dense blocks, got {image_size}"
            )
        self.image_size = image_size
        self.in_channels = in_channels

        self.backbone = nn.Sequential()
        self.backbone.add_module(
            "conv0", nn.Conv3d(in_channels, init_features, 7, stride=2, padding=3, bias=False)
        )
        self.backbone.add_module("norm0", nn.BatchNorm3d(init_features))
        self.backbone.add_module("relu0", nn.ReLU())
        self.backbone.add_module("pool0", nn.MaxPool3d(kernel_size=3, stride=2, padding=1))
        channels = init_features
        for i, layers in enumerate(blocks):
            self.backbone.add_module(f"denseblock{i + 1}", DenseBlock(layers, channels, growth, bn_size))
            channels += layers * growth
            if i != len(blocks) - 1:
                # DenseNet-BC compression 0.5: a transition halves the channels.
                self.backbone.add_module(f"transition{i + 1}", transition(channels, channels // 2))
                channels //= 2
        self.backbone.add_module("norm5", nn.BatchNorm3d(channels) if final_norm else nn.Identity())
        self.num_features = channels
        if head == "mlp":
            self.head = nn.Sequential(
                nn.Linear(channels, MLP_HIDDEN), nn.ReLU(), nn.Linear(MLP_HIDDEN, embed_dim)
            )
        else:
            self.head = nn.Linear(channels, embed_dim)
        self.grad_checkpointing = grad_checkpointing
        self.reset_parameters()

    @property
    def grad_checkpointing(self) -> bool:
        return self._grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, enabled: bool) -> None:
        self._grad_checkpointing = bool(enabled)
        for block in self.dense_blocks():
            block.grad_checkpointing = self._grad_checkpointing

    def dense_blocks(self) -> list[DenseBlock]:
        return [m for m in self.backbone if isinstance(m, DenseBlock)]

    def reset_parameters(self) -> None:
        """torchvision's / the y-Aware code's init: He-normal convolutions, BN (1, 0), zero
        linear biases (linear weights keep PyTorch's default)."""
        for module in self.modules():
            if isinstance(module, nn.Conv3d):
                nn.init.kaiming_normal_(module.weight)
            elif isinstance(module, nn.BatchNorm3d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, volumes: Tensor) -> PointSet:
        """volumes: [B, C, S, S, S] float -> PointSet [B, 1, d]."""
        size, channels = self.image_size, self.in_channels
        if volumes.dim() != 5 or tuple(volumes.shape[1:]) != (channels, size, size, size):
            raise ValueError(
                f"expected volumes [B, {channels}, {size}, {size}, {size}], got {tuple(volumes.shape)}"
            )
        if not volumes.is_floating_point():
            raise ValueError(f"expected floating-point volumes, got dtype {volumes.dtype}")
        features = F.relu(self.backbone(volumes))  # [B, F, s, s, s]
        pooled = features.mean(dim=(2, 3, 4))  # [B, F] global average pool
        return PointSet(F.normalize(self.head(pooled), dim=-1).unsqueeze(1))


def check_blocks(blocks: Sequence[int]) -> tuple[int, ...]:
    """Dense layers per block: one or more integers >= 1."""
    blocks = tuple(blocks)
    if not blocks or any(isinstance(n, bool) or int(n) != n or n < 1 for n in blocks):
        raise ValueError(f"blocks must be one or more integers >= 1 (layers per dense block), got {blocks}")
    return tuple(int(n) for n in blocks)


densenet3d = preset(
    DenseNet3d,
    "Build a :class:`DenseNet3d` (defaults: 3-D DenseNet-121, one input channel, MLP head).",
    image_size=64,
)
densenet3d_121 = preset(
    densenet3d,
    "3-D DenseNet-121 (growth 32, blocks (6, 12, 24, 16), 64 stem channels): y-Aware's MRI "
    "encoder (seed 002, METHODS §9; d = 128).",
    fixed={"growth": 32, "blocks": (6, 12, 24, 16), "init_features": 64, "bn_size": 4},
)
densenet3d_tiny = preset(
    densenet3d,
    "A tiny 3-D DenseNet for tests and CPU smoke runs (growth 4, blocks (1, 1), 8 stem channels, "
    "16³ volumes).",
    fixed={"growth": 4, "blocks": (1, 1), "init_features": 8, "bn_size": 4},
    image_size=16,
)
