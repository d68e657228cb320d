"""Key maps between clipkit's state dict and open_clip/OpenAI's and Hugging Face ``CLIPModel``'s.

clipkit keys are those of :class:`clipkit.model.ContrastiveModel` (``image_encoder.*``,
``text_encoder.*``, ``similarity.log_scale``). Every map is a bijection on the keys of a plain CLIP
model; the only value changes are exact ones (transposes, splitting/concatenating q/k/v, 0-d <-> [1]
logit scale), so weights go through unchanged bit for bit.

Transformer blocks (both towers), clipkit -> open_clip -> Hugging Face::

    transformer.blocks.N.ln_1           transformer.resblocks.N.ln_1          encoder.layers.N.layer_norm1
    transformer.blocks.N.attn.in_proj   ...attn.in_proj_weight / _bias        self_attn.{q,k,v}_proj (split)
    transformer.blocks.N.attn.out_proj  ...attn.out_proj                      self_attn.out_proj
    transformer.blocks.N.ln_2           ...ln_2                               layer_norm2
    transformer.blocks.N.mlp.0 / mlp.2  ...mlp.c_fc / mlp.c_proj              mlp.fc1 / mlp.fc2

Projections: clipkit's ``proj`` is an ``nn.Linear`` (weight [d, D]); open_clip/OpenAI store the
matrix applied as ``x @ proj`` ([D, d], the transpose); Hugging Face's ``*_projection`` are
``nn.Linear`` like clipkit's. The modified ResNet already uses CLIP's module names in clipkit.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from clipkit.errors import ClipkitError

StateDict = dict[str, Tensor]

BLOCK_OPEN_CLIP = (
    ("transformer.blocks.", "transformer.resblocks."),
    ("attn.in_proj.weight", "attn.in_proj_weight"),
    ("attn.in_proj.bias", "attn.in_proj_bias"),
    ("mlp.0.", "mlp.c_fc."),
    ("mlp.2.", "mlp.c_proj."),
)


def rename(key: str, pairs: tuple[tuple[str, str], ...], reverse: bool = False) -> str:
    for old, new in pairs:
        if reverse:
            old, new = new, old
        key = key.replace(old, new)
    return key


# ----------------------------------------------------------------------------- open_clip / OpenAI


def clipkit_to_open_clip(state: StateDict, vision_kind: str) -> StateDict:
    """clipkit keys -> open_clip/OpenAI keys (``visual.*``, ``transformer.*``, ``logit_scale``, ...)."""
    out: StateDict = {}
    for key, value in state.items():
        if key == "similarity.log_scale":
            out["logit_scale"] = value.reshape(())
        elif key == "image_encoder.proj.weight" and vision_kind == "vit":
            out["visual.proj"] = value.t().contiguous()
        elif key.startswith("image_encoder."):
            rest = key.removeprefix("image_encoder.")
            out["visual." + (rest if vision_kind == "resnet" else rename(rest, BLOCK_OPEN_CLIP))] = value
        elif key == "text_encoder.proj.weight":
            out["text_projection"] = value.t().contiguous()
        elif key.startswith("text_encoder."):
            out[rename(key.removeprefix("text_encoder."), BLOCK_OPEN_CLIP)] = value
        else:
            raise ClipkitError(f"clipkit weight {key!r} has no open_clip counterpart")
    return out


#: open_clip/OpenAI keys that carry no weights clipkit needs (OpenAI's TorchScript-era extras).
OPEN_CLIP_IGNORED = ("input_resolution", "context_length", "vocab_size", "attn_mask")


def open_clip_to_clipkit(state: StateDict, vision_kind: str) -> StateDict:
    """open_clip/OpenAI keys -> clipkit keys (inverse of :func:`clipkit_to_open_clip`)."""
    out: StateDict = {}
    for key, value in state.items():
        if key in OPEN_CLIP_IGNORED:
            continue
        if key == "logit_scale":
            out["similarity.log_scale"] = value.reshape(1)
        elif key == "visual.proj":
            out["image_encoder.proj.weight"] = value.t().contiguous()
        elif key.startswith("visual."):
            rest = key.removeprefix("visual.")
            out[
                "image_encoder." + (rest if vision_kind == "resnet" else rename(rest, BLOCK_OPEN_CLIP, True))
            ] = value
        elif key == "text_projection":
            out["text_encoder.proj.weight"] = value.t().contiguous()
        else:
            out["text_encoder." + rename(key, BLOCK_OPEN_CLIP, True)] = value
    return out


# ----------------------------------------------------------------------------- Hugging Face

HF_TOWER = {"image_encoder": "vision_model", "text_encoder": "text_model"}
HF_NAMES = (  # clipkit name inside a tower -> HF name inside vision_model / text_model
    ("conv1.weight", "embeddings.patch_embedding.weight"),
    ("class_embedding", "embeddings.class_embedding"),
    ("positional_embedding", "embeddings.position_embedding.weight"),
    ("token_embedding.weight", "embeddings.token_embedding.weight"),
    ("ln_pre.", "pre_layrnorm."),  # sic: Hugging Face's spelling
    ("ln_post.", "post_layernorm."),
    ("ln_final.", "final_layer_norm."),
)
HF_BLOCK = (
    ("transformer.blocks.", "encoder.layers."),
    ("ln_1.", "layer_norm1."),
    ("ln_2.", "layer_norm2."),
    ("attn.out_proj.", "self_attn.out_proj."),
    ("mlp.0.", "mlp.fc1."),
    ("mlp.2.", "mlp.fc2."),
)
IN_PROJ = re.compile(r"(.*)attn\.in_proj\.(weight|bias)$")
HF_QKV = re.compile(r"(.*)self_attn\.([qkv])_proj\.(weight|bias)$")


def clipkit_to_hf(state: StateDict) -> StateDict:
    """clipkit keys -> Hugging Face ``CLIPModel`` keys (ViT image tower only)."""
    out: StateDict = {}
    for key, value in state.items():
        if key == "similarity.log_scale":
            out["logit_scale"] = value.reshape(())
            continue
        tower, _, rest = key.partition(".")
        if tower not in HF_TOWER:
            raise ClipkitError(f"clipkit weight {key!r} has no Hugging Face CLIPModel counterpart")
        if rest == "proj.weight":
            out["visual_projection.weight" if tower == "image_encoder" else "text_projection.weight"] = value
            continue
        prefix = HF_TOWER[tower] + "."
        match = IN_PROJ.match(rest)
        if match:  # one [3D, ...] in_proj -> q, k, v
            head = rename(match.group(1), HF_BLOCK)
            for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"{prefix}{head}self_attn.{name}_proj.{match.group(2)}"] = part.contiguous()
            continue
        out[prefix + rename(rename(rest, HF_NAMES), HF_BLOCK)] = value
    return out


def hf_to_clipkit(state: StateDict) -> StateDict:
    """Hugging Face ``CLIPModel`` keys -> clipkit keys (inverse of :func:`clipkit_to_hf`)."""
    out: StateDict = {}
    qkv: dict[str, dict[str, Tensor]] = {}
    towers = {hf: ck for ck, hf in HF_TOWER.items()}
    for key, value in state.items():
        if key.endswith("position_ids"):  # a buffer older transformers versions saved
            continue
        if key == "logit_scale":
            out["similarity.log_scale"] = value.reshape(1)
            continue
        if key in ("visual_projection.weight", "text_projection.weight"):
            out[("image_encoder" if key.startswith("visual") else "text_encoder") + ".proj.weight"] = value
            continue
        tower, _, rest = key.partition(".")
        if tower not in towers:
            raise ClipkitError(f"Hugging Face weight {key!r} is not part of a plain CLIPModel")
        match = HF_QKV.match(rest)
        if match:
            head = towers[tower] + "." + rename(match.group(1), HF_BLOCK, True)
            qkv.setdefault(f"{head}attn.in_proj.{match.group(3)}", {})[match.group(2)] = value
            continue
        out[towers[tower] + "." + rename(rename(rest, HF_BLOCK, True), HF_NAMES, True)] = value
    for key, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ClipkitError(
                f"Hugging Face weights: {key} needs q, k and v projections, found {sorted(parts)}"
            )
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out
