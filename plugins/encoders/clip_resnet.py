"""CLIP's modified ResNet image encoder (Radford et al. 2021, §2.4), as used by CLOOB (METHODS §4, §9).

Differences from He et al.'s ResNet, all as in CLIP:
  * a 3-conv stem (3x3 convs of width/2, width/2, width; stride 2 on the first) and a 2x2 average
    pool instead of one 7x7 conv and a max pool;
  * anti-aliased downsampling: every convolution in the residual stages has stride 1, and a block
    that downsamples average-pools (kernel = stride) after its 3x3 conv and before the 1x1 conv of
    its shortcut (Zhang 2019, "Making convolutional networks shift-invariant again");
  * attention pooling instead of global average pooling: the spatial mean, prepended to the
    positions, queries them through one multi-head attention layer.

Module and parameter names follow CLIP's ``visual`` tower, so a user's own loader can map CLIP
checkpoints onto it; clipkit downloads no weights.

Pure torch. Shapes: B batch, S = image_size, G = S / 32 (final grid side), HW = G * G,
E = width * 32 (final feature width), d = embed_dim.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clipkit.contract.registry import preset
from clipkit.contract.types import PointSet
from clipkit.errors import check_choice

from .conv_common import OUTPUTS, check_images, check_layers, run_blocks

#: The network reduces the resolution by 32 (stem: 4, then three stride-2 stages).
REDUCTION = 32


class Bottleneck(nn.Module):
    """Anti-aliased bottleneck (CLIP): 1x1 -> 3x3 -> avgpool(stride) -> 1x1 (x4 channels), residual.

    [B, inplanes, H, W] -> [B, planes * 4, H / stride, W / stride]. All convs have stride 1; the
    shortcut is AvgPool2d(stride) -> 1x1 conv -> BN when the shape changes, else the identity.
    """

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        outplanes = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.avgpool = nn.AvgPool2d(stride) if stride > 1 else nn.Identity()
        self.conv3 = nn.Conv2d(planes, outplanes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(outplanes)
        self.relu3 = nn.ReLU(inplace=True)
        self.downsample = None
        if stride > 1 or inplanes != outplanes:
            # CLIP's key names: "-1" (the pool, no parameters), "0" (conv), "1" (BN).
            self.downsample = nn.Sequential(
                OrderedDict(
                    [
                        ("-1", nn.AvgPool2d(stride) if stride > 1 else nn.Identity()),
                        ("0", nn.Conv2d(inplanes, outplanes, 1, bias=False)),
                        ("1", nn.BatchNorm2d(outplanes)),
                    ]
                )
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(self.avgpool(out)))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu3(out + identity)


class AttentionPool2d(nn.Module):
    """CLIP's attention pooling over a [B, E, G, G] feature map.

    Tokens = [spatial mean, position 1, ..., position HW] + a learned positional embedding
    [1 + HW, E]; one multi-head attention layer (separate q/k/v projections with bias, scale
    (E/heads)**-0.5) followed by the output projection ``c_proj`` E -> d.

    forward(x, all_queries=False) -> [B, 1, d] (the mean token queries all tokens), or with
    ``all_queries`` [B, 1 + HW, d] (every token queries all tokens; row 0 is the same pooled vector).
    """

    def __init__(self, grid: int, width: int, heads: int, output_dim: int) -> None:
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"the feature width ({width}) must be divisible by heads ({heads})")
        self.heads = heads
        self.positional_embedding = nn.Parameter(torch.empty(grid * grid + 1, width))
        self.k_proj = nn.Linear(width, width)
        self.q_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.c_proj = nn.Linear(width, output_dim)

    def tokens(self, x: Tensor) -> Tensor:
        """[B, E, G, G] -> [B, 1 + HW, E]: mean token first, raster order, positions added."""
        x = x.flatten(2).transpose(1, 2)  # [B, HW, E]
        x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1)
        return x + self.positional_embedding.to(x.dtype)

    def split_heads(self, x: Tensor) -> Tensor:
        """[B, N, E] -> [B, heads, N, E / heads]."""
        batch, length, width = x.shape
        return x.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

    def forward(self, x: Tensor, *, all_queries: bool = False) -> Tensor:
        tokens = self.tokens(x)
        queries = tokens if all_queries else tokens[:, :1]
        q, k, v = (
            self.split_heads(proj(t))
            for proj, t in ((self.q_proj, queries), (self.k_proj, tokens), (self.v_proj, tokens))
        )
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, Nq, E / heads]
        return self.c_proj(out.transpose(1, 2).flatten(2))  # [B, Nq, d]


class ModifiedResNet(nn.Module):
    """CLIP's modified ResNet (stem -> 4 anti-aliased bottleneck stages -> attention pooling).

    forward(images [B, 3, S, S] float) -> PointSet with L2-normalised points
      output="cls":    [B, 1, d]       the attention-pooled vector (CLIP's image embedding);
      output="tokens": [B, 1 + HW, d]  the pooled vector, then every grid position (raster order),
                                       each the attention output with that token as the query.
    ``weights`` and ``mask`` are None.
    """

    #: The final projection; its input is the linear probe's "pre_projection" feature.
    projection_module_name = "attnpool.c_proj"

    def __init__(
        self,
        *,
        embed_dim: int,
        image_size: int,
        layers: tuple[int, ...],
        width: int,
        heads: int,
        output: str = "cls",
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        layers = check_layers(layers)
        check_choice("output", output, OUTPUTS)
        for name, value in (("embed_dim", embed_dim), ("width", width), ("heads", heads)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if width % 2:
            raise ValueError(f"width must be even (the stem starts at width / 2), got {width}")
        if image_size <= 0 or image_size % REDUCTION:
            raise ValueError(f"image_size must be a positive multiple of {REDUCTION}, got {image_size}")
        self.image_size = image_size
        self.output = output
        self.grad_checkpointing = grad_checkpointing

        self.conv1 = nn.Conv2d(3, width // 2, kernel_size=3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width // 2)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width // 2, width // 2, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width // 2)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(width // 2, width, kernel_size=3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.relu3 = nn.ReLU(inplace=True)
        self.avgpool = nn.AvgPool2d(2)

        inplanes = width
        for index, blocks in enumerate(layers):
            planes = width * 2**index
            stage = [Bottleneck(inplanes, planes, stride=1 if index == 0 else 2)]
            inplanes = planes * Bottleneck.expansion
            stage += [Bottleneck(inplanes, planes) for _ in range(blocks - 1)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*stage))

        self.attnpool = AttentionPool2d(image_size // REDUCTION, inplanes, heads, embed_dim)
        self.reset_parameters()

    def stages(self) -> list[nn.Sequential]:
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def reset_parameters(self) -> None:
        """CLIP's init: attention projections and positions N(0, E**-0.5); each bottleneck's last BN
        gain zero, so every residual branch starts as the identity. Convs/BN keep torch defaults."""
        pool = self.attnpool
        std = pool.c_proj.in_features**-0.5
        nn.init.normal_(pool.positional_embedding, std=std)
        for linear in (pool.q_proj, pool.k_proj, pool.v_proj, pool.c_proj):
            nn.init.normal_(linear.weight, std=std)
        for stage in self.stages():
            for block in stage:
                nn.init.zeros_(block.bn3.weight)

    def stem(self, x: Tensor) -> Tensor:
        """[B, 3, S, S] -> [B, width, S / 4, S / 4]."""
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.relu3(self.bn3(self.conv3(x)))
        return self.avgpool(x)

    def features(self, images: Tensor) -> Tensor:
        """[B, 3, S, S] -> [B, E, G, G] (before pooling)."""
        x = self.stem(images.to(self.conv1.weight.dtype))
        blocks = [block for stage in self.stages() for block in stage]
        return run_blocks(blocks, x, grad_checkpointing=self.grad_checkpointing)

    def forward(self, images: Tensor) -> PointSet:
        check_images(images, self.image_size)
        points = self.attnpool(self.features(images), all_queries=self.output == "tokens")
        return PointSet(F.normalize(points, dim=-1))


def clip_resnet(
    *,
    embed_dim: int,
    image_size: int = 224,
    layers: tuple[int, ...] = (3, 4, 6, 3),
    width: int = 64,
    heads: int | None = None,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> ModifiedResNet:
    """Build a :class:`ModifiedResNet` (defaults: CLIP RN50). ``heads`` defaults to width * 32 // 64,
    CLIP's choice (one head per 64 channels of the final feature map)."""
    return ModifiedResNet(
        embed_dim=embed_dim,
        image_size=image_size,
        layers=tuple(layers),
        width=width,
        heads=width * 32 // 64 if heads is None else heads,
        output=output,
        grad_checkpointing=grad_checkpointing,
    )


rn50 = preset(
    clip_resnet,
    "CLIP RN50: layers (3, 4, 6, 3), width 64 (CLIP used embed_dim 1024).",
    fixed={"layers": (3, 4, 6, 3), "width": 64, "heads": None},
)
rn101 = preset(
    clip_resnet,
    "CLIP RN101: layers (3, 4, 23, 3), width 64 (CLIP used embed_dim 512).",
    fixed={"layers": (3, 4, 23, 3), "width": 64, "heads": None},
)
rn50x4 = preset(
    clip_resnet,
    "CLIP RN50x4: layers (4, 6, 10, 6), width 80, 288 px (CLIP used embed_dim 640).",
    fixed={"layers": (4, 6, 10, 6), "width": 80, "heads": None},
    image_size=288,
)
rn_tiny = preset(
    clip_resnet,
    "A tiny modified ResNet for tests and CPU smoke runs: layers (1, 1, 1, 1), width 8, 4 heads, "
    "64 px (a 2x2 final grid, so attention pooling has several positions to attend to).",
    fixed={"layers": (1, 1, 1, 1), "width": 8, "heads": None},
    image_size=64,
)
