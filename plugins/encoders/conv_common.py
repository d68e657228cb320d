"""Pieces shared by the convolutional image encoders (:mod:`.clip_resnet`, :mod:`.resnet`).

* :func:`check_images` — one clear error for a wrongly shaped batch.
* :func:`run_blocks` — runs residual blocks, optionally under gradient checkpointing that does
  not double-count BatchNorm statistics (see :func:`batchnorm_stats_preserved`).

Shapes: B batch, C channels, S = image_size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

OUTPUTS = ("cls", "tokens")


def check_layers(layers: Iterable[int], stages: int = 4) -> tuple[int, ...]:
    """``layers`` = blocks per residual stage: ``stages`` integers >= 1."""
    layers = tuple(layers)
    if len(layers) != stages or any(int(n) != n or n < 1 for n in layers):
        raise ValueError(f"layers must be {stages} integers >= 1 (blocks per stage), got {layers}")
    return tuple(int(n) for n in layers)


def check_images(images: Tensor, image_size: int) -> None:
    """Images must be a float batch ``[B, 3, S, S]`` with S = ``image_size``."""
    expected = (3, image_size, image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(f"expected images [B, 3, {image_size}, {image_size}], got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"expected floating-point images, got dtype {images.dtype}")


@contextlib.contextmanager
def batchnorm_stats_preserved(module: nn.Module) -> Iterator[None]:
    """Restore every BatchNorm running statistic in ``module`` on exit.

    Checkpointing re-runs a block's forward during backward; in training mode BatchNorm would
    then update its running mean/var (and counter) a second time, so a checkpointed model would
    end up with different statistics than an uncheckpointed one. The recomputation sees the same
    batch and produces the same activations, so undoing its buffer updates is exact.
    """
    saved = [
        (buffer, buffer.clone())
        for norm in module.modules()
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and norm.track_running_stats
        for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
        if buffer is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def recompute_contexts(block: nn.Module) -> tuple[contextlib.AbstractContextManager, ...]:
    """(forward context, recompute context) for ``checkpoint(context_fn=...)``."""
    return contextlib.nullcontext(), batchnorm_stats_preserved(block)


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, *, grad_checkpointing: bool) -> Tensor:
    """Apply ``blocks`` in order; [B, C, H, W] -> [B, C', H', W'].

    With ``grad_checkpointing`` (only while training with grad enabled: evaluation has no backward
    to save memory for) each block's activations are recomputed in backward instead of stored.
    """
    use_checkpoint = grad_checkpointing and torch.is_grad_enabled()
    for block in blocks:
        if use_checkpoint and block.training:
            x = checkpoint(block, x, use_reentrant=False, context_fn=partial(recompute_contexts, block))
        else:
            x = block(x)
    return x
