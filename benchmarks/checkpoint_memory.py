"""Peak memory of one training step, clipkit vs open_clip, gradient checkpointing off and on, at
equal batch, on the CPU (issue 38: checkpointing must hold no more than open_clip's).

Both sides build the same CLIP (a small ViT + causal text Transformer, exact GELU) from the same
seed and train one step: the towers under the precision's autocast, symmetric InfoNCE with a
learnable logit scale, backward (no optimiser: its state is the same on both sides). Sides:

- ``clipkit``: ``clipkit.plugins.encoders`` ``VisionTransformer`` + ``TextTransformer``, the
  ``dot`` similarity and ``infonce``, checkpointing through ``train.grad_checkpointing``'s switch;
- ``clipkit, plain LayerNorm``: the same with ``torch.nn.LayerNorm`` in place of the towers' own
  (which returns its input's dtype): clipkit before this change;
- ``open_clip``: ``open_clip.model.CLIP`` and ``ClipLoss``, ``set_grad_checkpointing()``.

Precisions: fp32; bf16 autocast with the CPU's own policy (which keeps ``layer_norm`` in bf16);
and bf16 autocast with CUDA's policy for ``layer_norm`` emulated (``F.layer_norm`` computing in
fp32 and returning fp32, as ``torch.autocast("cuda")`` does): the GPU's behaviour, where the plain
LayerNorm turned the ViT's residual stream into fp32.

Memory: :func:`measure.heap_peak_bytes` — the C heap in use (glibc ``mallinfo2``) sampled after
every torch operation of the step, forward and backward, above what was in use before it (weights
excluded; activations, gradients and recomputation included); the median of 3 measured steps after
one warm-up step, per side and configuration, rounds interleaved. Usage:

    python benchmarks/checkpoint_memory.py [--batch 32] [--layers 4] [--precision NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from measure import heap_peak_bytes, interleaved, machine_line, markdown_header, markdown_row

sys.path.insert(0, str(Path(__file__).parent / "gpu"))  # part_vit_step's open_clip import and batches
from part_vit_step import import_open_clip, make_batch  # noqa: E402

IMAGE, PATCH, WIDTH, HEADS = 64, 8, 128, 4
CONTEXT, VOCAB, TEXT_WIDTH, EMBED = 32, 1000, 128, 64


class ClipkitSide:
    """clipkit's towers, similarity and loss (a ContrastiveModel's parts) on one batch."""

    def __init__(self, layers: int, plain_layer_norm: bool = False) -> None:
        from clipkit.plugins.encoders import vit as vit_module
        from clipkit.plugins.encoders.text_transformer import TextTransformer
        from clipkit.plugins.losses.infonce import InfoNCE
        from clipkit.plugins.similarities.dot import DotSimilarity

        torch.manual_seed(0)
        image = {"image_size": IMAGE, "patch_size": PATCH, "width": WIDTH}
        self.image = vit_module.VisionTransformer(embed_dim=EMBED, layers=layers, heads=HEADS, **image)
        text = {"vocab_size": VOCAB, "context_length": CONTEXT, "width": TEXT_WIDTH}
        self.text = TextTransformer(embed_dim=EMBED, layers=layers, heads=HEADS, **text)
        if plain_layer_norm:  # clipkit before: torch's LayerNorm, which returns autocast's fp32
            for tower in (self.image, self.text):
                for module in tower.modules():
                    if isinstance(module, vit_module.LayerNorm):
                        module.forward = torch.nn.LayerNorm.forward.__get__(module)
        self.similarity, self.loss = DotSimilarity(), InfoNCE()
        self.parameters = [*self.image.parameters(), *self.text.parameters(), *self.similarity.parameters()]

    def set_grad_checkpointing(self, enabled: bool) -> None:
        self.image.grad_checkpointing = self.text.grad_checkpointing = enabled

    def step(self, batch: dict, autocast) -> None:
        with autocast():
            a, b = self.image(batch["image"]), self.text(batch["text"])
        logits = self.similarity(a.cast(torch.float32), b.cast(torch.float32))
        self.loss(logits, torch.arange(a.batch_size), None).loss.backward()


class OpenClipSide:
    """open_clip's CLIP with the same dimensions, and its ClipLoss (inside autocast, as open_clip)."""

    def __init__(self, layers: int) -> None:
        open_clip = import_open_clip()
        torch.manual_seed(0)
        vision = {"image_size": IMAGE, "layers": layers, "width": WIDTH, "patch_size": PATCH}
        vision["head_width"] = WIDTH // HEADS
        text = {"context_length": CONTEXT, "vocab_size": VOCAB, "width": TEXT_WIDTH, "heads": HEADS}
        text["layers"] = layers
        self.model = open_clip.model.CLIP(EMBED, vision, text, quick_gelu=False, output_dict=True).train()
        self.clip_loss = open_clip.loss.ClipLoss()
        self.parameters = list(self.model.parameters())

    def set_grad_checkpointing(self, enabled: bool) -> None:
        self.model.set_grad_checkpointing(enabled)

    def step(self, batch: dict, autocast) -> None:
        with autocast():
            out = self.model(batch["image"], batch["text"])
            loss = self.clip_loss(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()


@contextlib.contextmanager
def cuda_layer_norm_policy():
    """``F.layer_norm`` as CUDA autocast runs it: inputs upcast to fp32, an fp32 result."""
    plain = F.layer_norm

    def fp32_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
        if not torch.is_autocast_enabled("cpu"):
            return plain(x, shape, weight, bias, eps)
        with torch.autocast("cpu", enabled=False):
            as_fp32 = [None if t is None else t.float() for t in (weight, bias)]
            return plain(x.float(), shape, *as_fp32, eps)

    F.layer_norm = fp32_layer_norm
    try:
        yield
    finally:
        F.layer_norm = plain


PRECISIONS = {
    "fp32": contextlib.nullcontext,
    "bf16 autocast (CPU policy)": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "bf16 autocast, CUDA's fp32 layer_norm": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


def measured_step(side, batch: dict, precision: str):
    """One step of ``side`` whose peak heap bytes are returned; gradients dropped before it."""

    def run() -> int:
        for parameter in side.parameters:
            parameter.grad = None
        policy = cuda_layer_norm_policy() if "CUDA" in precision else contextlib.nullcontext()
        with policy:
            return heap_peak_bytes(lambda: side.step(batch, PRECISIONS[precision]))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4, help="blocks per tower")
    parser.add_argument("--precision", choices=list(PRECISIONS), action="append", help="default: all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = make_batch(args.batch, IMAGE, CONTEXT, VOCAB, 1, torch.device("cpu"))
    sides = {
        "clipkit": ClipkitSide(args.layers),
        "clipkit, plain LayerNorm": ClipkitSide(args.layers, plain_layer_norm=True),
        "open_clip": OpenClipSide(args.layers),
    }
    print(machine_line())
    print(
        f"ViT {IMAGE} px / patch {PATCH}, width {WIDTH}; text width {TEXT_WIDTH}, context {CONTEXT}; "
        f"{args.layers} layers each; batch {args.batch}; peak C-heap MiB above the step's start "
        "(median of 3)\n"
    )
    print(markdown_header("precision", "checkpointing", *sides, "clipkit / open_clip"))
    for precision in args.precision or PRECISIONS:
        for checkpointing in (False, True):
            for side in sides.values():
                side.set_grad_checkpointing(checkpointing)
                measured_step(side, batch, precision)()  # warm-up
            calls = {name: measured_step(side, batch, precision) for name, side in sides.items()}
            peaks = {name: statistics.median(v) / 2**20 for name, v in interleaved(calls, 3).items()}
            cells = [f"{peaks[name]:.1f}" for name in sides]
            ratio = f"{peaks['clipkit'] / peaks['open_clip']:.2f}"
            print(markdown_row(precision, "on" if checkpointing else "off", *cells, ratio), flush=True)


if __name__ == "__main__":
    main()
