"""open_clip's checkpoint directory and OpenAI/open_clip-layout state dicts, read and written
without importing open_clip (nothing here executes code from a file: JSON and safetensors only).

A directory as open_clip's ``save_for_hf`` writes it: ``open_clip_config.json``
(``{"model_cfg": {...}, "preprocess_cfg": {"mean", "std", ...}}``) + ``open_clip_model.safetensors``.
A bare state dict (``*.safetensors`` with ``visual.*``, ``transformer.*``, ``token_embedding.weight``,
``positional_embedding``, ``ln_final.*``, ``text_projection``, ``logit_scale``) carries no config:
the shape is read off the tensors as OpenAI's ``build_model`` does. The activation the tensors
cannot tell (OpenAI's weights use QuickGELU, open_clip's own exact GELU; reading one as the other
moves features by ~1e-3) comes from evidence: the caller's ``quick_gelu``, the ``quick_gelu`` entry
clipkit writes in the safetensors header, or ``open_clip_config.json`` beside the file; with none,
the file is refused naming ``--quick-gelu`` / ``--no-quick-gelu`` — never guessed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from clipkit.artifacts.io import OutputKind
from clipkit.errors import ClipkitError
from clipkit.plugins.interop.keys import StateDict, clipkit_to_open_clip, open_clip_to_clipkit
from clipkit.plugins.interop.spec import CLIP_MEAN, CLIP_STD, ClipSpec, TextSpec, VisionSpec, mlp_ratio

CONFIG = "open_clip_config.json"
WEIGHTS = "open_clip_model.safetensors"
#: What ``write_dir`` leaves in its folder (clipkit.artifacts.io.OutputKind): a folder holding only
#: these may be converted into again; any other file in it is the user's and refuses the write.
DIRECTORY_OUTPUT = OutputKind("open_clip checkpoint", (CONFIG, WEIGHTS), marker=CONFIG)
HEAD_WIDTH = 64  # open_clip's default head_width (and OpenAI's): one head per 64 channels

#: open_clip config options whose non-default values change the architecture away from plain CLIP,
#: with the value plain CLIP has. Anything set to another value is refused by name.
PLAIN_VISION = {
    "ls_init_value": None, "patch_dropout": 0.0, "attentional_pool": False, "no_ln_pre": False,
    "pos_embed_type": "learnable", "final_ln_after_pool": False, "pool_type": "tok",
    "act_kwargs": None, "norm_kwargs": None, "block_type": None, "qk_norm": False,
    "scaled_cosine_attn": False, "scale_heads": False, "scale_attn_inner": False, "scale_attn": False,
    "scale_fc": False, "timm_model_name": None,
}  # fmt: skip
PLAIN_TEXT = {
    "ls_init_value": None, "embed_cls": False, "no_causal_mask": False, "final_ln_after_pool": False,
    "pool_type": "argmax", "proj_bias": False, "proj_type": "linear", "act_kwargs": None,
    "norm_kwargs": None, "block_type": None, "qk_norm": False, "scaled_cosine_attn": False,
    "scale_heads": False, "scale_attn_inner": False, "scale_attn": False, "scale_fc": False,
    "hf_model_name": None, "hf_tokenizer_name": None, "tokenizer_mode": None,
}  # fmt: skip
PLAIN_MODEL = {"custom_text": False, "init_logit_bias": None, "multimodal_cfg": None, "timm_model_name": None}


def check_plain(config: dict, plain: dict, where: str) -> None:
    """Refuse options that make the model something other than plain CLIP, naming them."""
    odd = [f"{where}.{key}={config[key]!r}" for key in plain if config.get(key, plain[key]) != plain[key]]
    if odd:
        raise ClipkitError(
            f"not a plain CLIP model ({', '.join(odd)}): clipkit converts only plain ViT/ResNet + text "
            "Transformer CLIP models"
        )


def spec_from_config(config: dict, where: str) -> ClipSpec:
    """open_clip's ``model_cfg`` (+ the file's ``preprocess_cfg``) -> :class:`ClipSpec`."""
    model = config.get("model_cfg", config)
    if not all(key in model for key in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ClipkitError(f"{where}: model_cfg needs embed_dim, vision_cfg and text_cfg")
    vision_cfg, text_cfg = model["vision_cfg"], model["text_cfg"]
    check_plain(model, PLAIN_MODEL, "model_cfg")
    check_plain(vision_cfg, PLAIN_VISION, "vision_cfg")
    check_plain(text_cfg, PLAIN_TEXT, "text_cfg")
    head_width = int(vision_cfg.get("head_width", HEAD_WIDTH))
    width, layers = int(vision_cfg.get("width", 768)), vision_cfg.get("layers", 12)
    image_size = vision_cfg.get("image_size", 224)
    if isinstance(image_size, list | tuple):
        if len(set(image_size)) != 1:
            raise ClipkitError(f"{where}: non-square image_size {image_size} is not supported")
        image_size = image_size[0]
    if isinstance(layers, list | tuple):
        vision = VisionSpec(
            "resnet", width, tuple(int(n) for n in layers), width * 32 // head_width, int(image_size)
        )
    else:
        vision = VisionSpec(
            "vit", width, int(layers), width // head_width, int(image_size),
            patch_size=int(vision_cfg.get("patch_size", 16)),
            mlp_ratio=float(vision_cfg.get("mlp_ratio", 4.0)),
        )  # fmt: skip
    text = TextSpec(
        width=int(text_cfg.get("width", 512)),
        layers=int(text_cfg.get("layers", 12)),
        heads=int(text_cfg.get("heads", 8)),
        context_length=int(text_cfg.get("context_length", 77)),
        vocab_size=int(text_cfg.get("vocab_size", 49408)),
        mlp_ratio=float(text_cfg.get("mlp_ratio", 4.0)),
    )
    preprocess = config.get("preprocess_cfg", {})
    return ClipSpec(
        embed_dim=int(model["embed_dim"]),
        vision=vision,
        text=text,
        quick_gelu=bool(model.get("quick_gelu", False)),
        mean=tuple(preprocess.get("mean", CLIP_MEAN)),
        std=tuple(preprocess.get("std", CLIP_STD)),
    )


def config_from_spec(spec: ClipSpec) -> dict[str, Any]:
    """:class:`ClipSpec` -> the JSON open_clip's ``save_config_for_hf`` writes."""
    vision, text = spec.vision, spec.text
    if vision.kind == "resnet":
        vision_cfg = {"image_size": vision.image_size, "layers": list(vision.layers), "width": vision.width,
                      "head_width": vision.width * 32 // vision.heads, "patch_size": None}  # fmt: skip
    else:
        vision_cfg = {"image_size": vision.image_size, "layers": vision.layers, "width": vision.width,
                      "head_width": vision.width // vision.heads, "patch_size": vision.patch_size,
                      "mlp_ratio": vision.mlp_ratio}  # fmt: skip
    text_cfg = {"context_length": text.context_length, "vocab_size": text.vocab_size, "width": text.width,
                "heads": text.heads, "layers": text.layers, "mlp_ratio": text.mlp_ratio}  # fmt: skip
    model_cfg = {"embed_dim": spec.embed_dim, "quick_gelu": spec.quick_gelu, "vision_cfg": vision_cfg,
                 "text_cfg": text_cfg}  # fmt: skip
    return {"model_cfg": model_cfg, "preprocess_cfg": {"mean": list(spec.mean), "std": list(spec.std)}}


def count(state: StateDict, pattern: str) -> int:
    """How many distinct first groups of ``pattern`` occur among the keys (e.g. block indices)."""
    regex = re.compile(pattern)
    return len({m.group(1) for key in state if (m := regex.match(key))})


def spec_from_state_dict(state: StateDict, quick_gelu: bool, where: str) -> ClipSpec:
    """Read a plain CLIP's shape off an OpenAI/open_clip-layout state dict (no config needed)."""
    required = ("text_projection", "token_embedding.weight", "positional_embedding", "ln_final.weight")
    missing = [key for key in required if key not in state]
    if missing or not any(key.startswith("visual.") for key in state):
        raise ClipkitError(
            f"{where}: not an OpenAI/open_clip CLIP state dict (missing {missing or ['visual.*']})"
        )
    embed_dim = state["text_projection"].shape[1]
    if "visual.proj" in state:  # ViT
        conv = state["visual.conv1.weight"]  # [D, 3, p, p]
        width, patch = conv.shape[0], conv.shape[-1]
        grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        hidden = state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
        vision = VisionSpec(
            "vit", width, count(state, r"visual\.transformer\.resblocks\.(\d+)\."), width // HEAD_WIDTH,
            patch * grid, patch_size=patch, mlp_ratio=mlp_ratio(hidden, width, f"{where}: visual"),
        )  # fmt: skip
    else:  # modified ResNet
        layers = tuple(count(state, rf"visual\.layer{i}\.(\d+)\.") for i in (1, 2, 3, 4))
        width = state["visual.layer1.0.conv1.weight"].shape[0]
        grid = round((state["visual.attnpool.positional_embedding"].shape[0] - 1) ** 0.5)
        vision = VisionSpec("resnet", width, layers, width * 32 // HEAD_WIDTH, grid * 32)
    text_width = state["ln_final.weight"].shape[0]
    hidden = state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    text = TextSpec(
        width=text_width,
        layers=count(state, r"transformer\.resblocks\.(\d+)\."),
        heads=text_width // HEAD_WIDTH,
        context_length=state["positional_embedding"].shape[0],
        vocab_size=state["token_embedding.weight"].shape[0],
        mlp_ratio=mlp_ratio(hidden, text_width, f"{where}: text"),
    )
    return ClipSpec(embed_dim=embed_dim, vision=vision, text=text, quick_gelu=quick_gelu)


QUICK_GELU_KEY = "quick_gelu"  # safetensors header entry clipkit writes on a bare state dict


def read_state_dict(path: Path, quick_gelu: bool | None = None) -> tuple[ClipSpec, StateDict]:
    """An OpenAI/open_clip-layout ``.safetensors`` state dict -> (spec, clipkit-layout state dict).
    ``quick_gelu``: the activation it was trained with; None: from the evidence (:func:`activation`)."""
    from clipkit.plugins.interop.tensors import read_weights

    state = read_weights(Path(path), "state dict")
    spec_from_state_dict(state, False, str(path))  # not a CLIP state dict: said before the activation
    chosen = quick_gelu if quick_gelu is not None else activation(Path(path))
    spec = spec_from_state_dict(state, chosen, str(path))
    spec.extra["weights"] = str(path)  # the file a mismatch names (layouts.build)
    return spec, open_clip_to_clipkit(state, spec.vision.kind)


def activation(path: Path) -> bool:
    """Which activation trained the bare state dict at ``path``, from evidence only: the
    ``quick_gelu`` entry of its safetensors header (clipkit writes it), else ``model_cfg.quick_gelu``
    of an ``open_clip_config.json`` beside it. No evidence: a :class:`ClipkitError` naming the flags."""
    from clipkit.artifacts.files import safetensors_metadata

    recorded = safetensors_metadata(Path(path), "state dict").get(QUICK_GELU_KEY)
    if recorded in ("true", "false"):
        return recorded == "true"
    config = path.parent / CONFIG
    if config.is_file():
        try:
            model_cfg = json.loads(config.read_text(encoding="utf-8"))["model_cfg"]
            return bool(model_cfg.get("quick_gelu", False))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ClipkitError(f"{config}: cannot read model_cfg.quick_gelu ({error})") from None
    raise ClipkitError(
        f"{path}: a bare state dict does not say which activation trained it (OpenAI's weights use "
        f"QuickGELU, open_clip's own models exact GELU) and no {CONFIG} is beside it: pass --quick-gelu "
        "or --no-quick-gelu (quick_gelu=True/False in Python)"
    )


def read_dir(directory: Path) -> tuple[ClipSpec, StateDict]:
    """An open_clip checkpoint directory -> (spec, clipkit-layout state dict)."""
    from clipkit.artifacts.files import read_json
    from clipkit.plugins.interop.tensors import read_weights

    config_path, weights = Path(directory) / CONFIG, Path(directory) / WEIGHTS
    if not weights.is_file():
        raise ClipkitError(
            f"{directory}: {WEIGHTS} is missing (clipkit reads safetensors only; it never loads pickled "
            "open_clip_pytorch_model.bin / .pt files)"
        )
    config = read_json(config_path, "open_clip config", expect=dict)
    spec = spec_from_config(config, str(config_path))
    spec.extra["weights"] = str(weights)  # the file a mismatch names (layouts.build)
    return spec, open_clip_to_clipkit(read_weights(weights, "open_clip weights"), spec.vision.kind)


def write_state_dict(spec: ClipSpec, state: StateDict, path: Path) -> Path:
    """Write the OpenAI/open_clip-layout state dict to ``path`` (.safetensors), atomically."""
    from safetensors.torch import save_file

    from clipkit.artifacts.io import atomic_path, tensor_bytes

    metadata = {"format": "pt", QUICK_GELU_KEY: "true" if spec.quick_gelu else "false"}
    with atomic_path(Path(path), needed=tensor_bytes(state)) as tmp:
        save_file(clipkit_to_open_clip(state, spec.vision.kind), str(tmp), metadata=metadata)
    return Path(path)


def write_dir(spec: ClipSpec, state: StateDict, out: Path) -> Path:
    """Write an open_clip checkpoint directory (config + safetensors weights), atomically (``out``
    checked first by ``layouts.claim_output``: :data:`DIRECTORY_OUTPUT`)."""
    from safetensors.torch import save_file

    from clipkit.artifacts.io import atomic_directory, tensor_bytes

    with atomic_directory(Path(out), needed=tensor_bytes(state)) as building:
        save_file(
            clipkit_to_open_clip(state, spec.vision.kind), str(building / WEIGHTS), metadata={"format": "pt"}
        )
        text = json.dumps(config_from_spec(spec), indent=2) + "\n"
        (building / CONFIG).write_text(text, encoding="utf-8")
    return Path(out)
