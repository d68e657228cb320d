"""Hugging Face ``CLIPModel`` directories (``config.json`` + ``model.safetensors``, or a sharded
checkpoint: ``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``), read and written
without importing transformers (JSON and safetensors only; ``pytorch_model.bin`` is never loaded).

``config.json`` may leave sub-config values at transformers' defaults out; the defaults below are
``CLIPTextConfig()``'s and ``CLIPVisionConfig()``'s. Hugging Face's CLIPModel has only a ViT image
tower, so ResNet CLIP models cannot be written in this layout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from clipkit.artifacts.io import OutputKind
from clipkit.errors import ClipkitError
from clipkit.plugins.interop.keys import StateDict, clipkit_to_hf, hf_to_clipkit
from clipkit.plugins.interop.spec import (
    CLIP_BOS_ID,
    CLIP_EOS_ID,
    CLIP_MEAN,
    CLIP_STD,
    ClipSpec,
    TextSpec,
    VisionSpec,
)
from clipkit.plugins.interop.spec import mlp_ratio as ratio_of

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
#: A sharded checkpoint's index (``save_pretrained`` above its shard size): ``weight_map`` names the
#: shard file of every tensor.
INDEX = "model.safetensors.index.json"
PREPROCESSOR = "preprocessor_config.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
#: What ``write_dir`` leaves in its folder (clipkit.artifacts.io.OutputKind): a folder holding only
#: these may be converted into again; any other file in it is the user's and refuses the write.
DIRECTORY_OUTPUT = OutputKind(
    "Hugging Face CLIP directory", (CONFIG, WEIGHTS, PREPROCESSOR, *TOKENIZER_FILES), marker=CONFIG
)
TEXT_DEFAULTS = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
                 "num_hidden_layers": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                 "layer_norm_eps": 1e-5}  # fmt: skip
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                   "num_hidden_layers": 12, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                   "layer_norm_eps": 1e-5,
                   "num_channels": 3}  # fmt: skip
ACTIVATIONS = {"quick_gelu": True, "gelu": False}  # hidden_act -> clipkit's quick_gelu switch


def sub_config(config: dict, name: str, defaults: dict, where: str) -> dict:
    """A text/vision sub-config with transformers' defaults filled in; odd values refused by name."""
    values = {**defaults, **{k: v for k, v in (config.get(name) or {}).items() if k in defaults}}
    if values["hidden_act"] not in ACTIVATIONS:
        raise ClipkitError(
            f"{where}: {name}.hidden_act={values['hidden_act']!r} (clipkit has {sorted(ACTIVATIONS)})"
        )
    if abs(values["layer_norm_eps"] - 1e-5) > 1e-12:
        raise ClipkitError(
            f"{where}: {name}.layer_norm_eps={values['layer_norm_eps']} (clipkit's LayerNorms use 1e-5)"
        )
    if values.get("num_channels", 3) != 3:
        raise ClipkitError(
            f"{where}: {name}.num_channels={values['num_channels']} (clipkit reads RGB images)"
        )
    return values


def spec_from_config(config: dict, preprocessor: dict, where: str) -> ClipSpec:
    """``config.json`` (+ ``preprocessor_config.json``) -> :class:`ClipSpec`."""
    if config.get("model_type") != "clip":
        raise ClipkitError(f"{where}: model_type {config.get('model_type')!r} is not a CLIPModel ('clip')")
    text, vision = (
        sub_config(config, "text_config", TEXT_DEFAULTS, where),
        sub_config(config, "vision_config", VISION_DEFAULTS, where),
    )
    if text["hidden_act"] != vision["hidden_act"]:
        raise ClipkitError(f"{where}: the towers use different activations; clipkit converts one for both")
    vision_width = vision["hidden_size"]
    return ClipSpec(
        embed_dim=int(config.get("projection_dim", 512)),
        vision=VisionSpec(
            "vit",
            vision_width,
            vision["num_hidden_layers"],
            vision["num_attention_heads"],
            vision["image_size"],
            patch_size=vision["patch_size"],
            mlp_ratio=ratio_of(vision["intermediate_size"], vision_width, f"{where}: vision_config"),
        ),  # fmt: skip
        text=TextSpec(
            width=text["hidden_size"],
            layers=text["num_hidden_layers"],
            heads=text["num_attention_heads"],
            context_length=text["max_position_embeddings"],
            vocab_size=text["vocab_size"],
            mlp_ratio=ratio_of(text["intermediate_size"], text["hidden_size"], f"{where}: text_config"),
        ),
        quick_gelu=ACTIVATIONS[text["hidden_act"]],
        mean=tuple(preprocessor.get("image_mean", CLIP_MEAN)),
        std=tuple(preprocessor.get("image_std", CLIP_STD)),
    )


def config_from_spec(spec: ClipSpec, logit_scale: float) -> dict[str, Any]:
    """:class:`ClipSpec` -> a complete ``config.json`` (every value spelled out)."""
    if spec.vision.kind != "vit":
        raise ClipkitError(
            "Hugging Face CLIPModel has no modified-ResNet image tower: convert ResNet models to "
            "open_clip instead"
        )
    act = "quick_gelu" if spec.quick_gelu else "gelu"
    vision, text = spec.vision, spec.text
    text_config = {"model_type": "clip_text_model", "vocab_size": text.vocab_size, "hidden_size": text.width,
                   "intermediate_size": int(text.width * text.mlp_ratio), "num_attention_heads": text.heads,
                   "num_hidden_layers": text.layers, "max_position_embeddings": text.context_length,
                   "hidden_act": act, "layer_norm_eps": 1e-5, "projection_dim": spec.embed_dim,
                   "bos_token_id": CLIP_BOS_ID, "eos_token_id": CLIP_EOS_ID, "pad_token_id": 1}  # fmt: skip
    vision_config = {"model_type": "clip_vision_model", "hidden_size": vision.width,
                     "intermediate_size": int(vision.width * vision.mlp_ratio),
                     "num_attention_heads": vision.heads, "num_hidden_layers": vision.layers,
                     "image_size": vision.image_size, "patch_size": vision.patch_size, "num_channels": 3,
                     "hidden_act": act, "layer_norm_eps": 1e-5, "projection_dim": spec.embed_dim}  # fmt: skip
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": spec.embed_dim,
            "logit_scale_init_value": logit_scale, "text_config": text_config,
            "vision_config": vision_config}  # fmt: skip


def preprocessor_from_spec(spec: ClipSpec) -> dict[str, Any]:
    """``preprocessor_config.json`` for ``CLIPImageProcessor``: resize the short side (bicubic),
    centre-crop, normalise — the same eval preprocessing as clipkit's."""
    size = spec.vision.image_size
    return {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": size},
            "resample": 3, "do_center_crop": True, "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(spec.mean), "image_std": list(spec.std), "do_convert_rgb": True}  # fmt: skip


def tokenizer_files(context_length: int) -> dict[str, str]:
    """CLIPTokenizer's files (``vocab.json``, ``merges.txt``, configs) from clipkit's CLIP BPE
    vocabulary, so ``CLIPTokenizer.from_pretrained(DIR)`` gives ``clip_bpe``'s ids (rows unpadded:
    Hugging Face pads with <|endoftext|>, clipkit with 0)."""
    from clipkit.plugins.tokenizers.clip_bpe import END_TOKEN, START_TOKEN, bpe_tables

    tables = bpe_tables()
    merges = sorted(tables.ranks, key=tables.ranks.__getitem__)
    special = {"bos_token": START_TOKEN, "eos_token": END_TOKEN}
    special |= {"unk_token": END_TOKEN, "pad_token": END_TOKEN}
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": context_length, **special}
    return {
        "vocab.json": json.dumps(tables.encoder, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }


def read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ClipkitError(f"{path} is missing")
        return {}
    from clipkit.artifacts.files import read_json as read_artifact

    return read_artifact(path, "Hugging Face config", expect=dict)


def is_hf_clip(directory: Path) -> bool:
    """True for a directory holding a Hugging Face CLIPModel config."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_bytes().decode("utf-8")).get("model_type") == "clip"
    except (OSError, ValueError, AttributeError):  # not UTF-8, not JSON, not an object
        return False


def has_weights(directory: Path) -> bool:
    """True when ``directory`` holds weights :func:`read_weights_of` reads (one file or an index)."""
    return (Path(directory) / WEIGHTS).is_file() or (Path(directory) / INDEX).is_file()


def weights_path(directory: Path) -> Path:
    """The file that names the weights :func:`read_weights_of` reads: ``model.safetensors``, or the
    index of a sharded checkpoint (for messages about the weights)."""
    directory = Path(directory)
    if (directory / WEIGHTS).is_file() or not (directory / INDEX).is_file():
        return directory / WEIGHTS
    return directory / INDEX


def read_dir(directory: Path) -> tuple[ClipSpec, StateDict]:
    """A Hugging Face CLIPModel directory -> (spec, clipkit-layout state dict)."""
    directory = Path(directory)
    if not has_weights(directory):
        raise ClipkitError(
            f"{directory}: {WEIGHTS} is missing, and {INDEX} too (clipkit reads safetensors only; it never "
            "loads pickled pytorch_model.bin files)"
        )
    config = read_json(directory / CONFIG, required=True)
    spec = spec_from_config(
        config, read_json(directory / PREPROCESSOR, required=False), str(directory / CONFIG)
    )
    spec.extra["weights"] = str(weights_path(directory))  # the file a mismatch names (layouts.build)
    return spec, hf_to_clipkit(read_weights_of(directory))


def read_weights_of(directory: Path) -> StateDict:
    """The Hugging Face-keyed tensors of ``directory``: ``model.safetensors``, else the shards its
    index names, merged. A folder holding both is read from the single file, with one note."""
    from clipkit.plugins.interop.tensors import read_weights

    single, index = directory / WEIGHTS, directory / INDEX
    if single.is_file():
        if index.is_file():
            print(
                f"note: {directory} holds {WEIGHTS} and a sharded checkpoint ({INDEX}); reading {WEIGHTS}",
                file=sys.stderr,
            )
        return read_weights(single, "Hugging Face weights")
    return read_shards(index)


def read_shards(index: Path) -> StateDict:
    """The tensors of a sharded checkpoint, merged by its index's ``weight_map`` (tensor -> shard
    file). Refused in one line naming the file: a shard the index names that is missing, a tensor
    the index places in a shard that does not hold it, or one a shard holds that the index does not
    list (an index and shards of two saves)."""
    from clipkit.plugins.interop.tensors import read_weights

    weight_map = shard_map(index)
    state: StateDict = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        listed = {key for key, name in weight_map.items() if name == shard}
        if not path.is_file():
            raise ClipkitError(
                f"{index}: shard {shard} is missing (the index places {len(listed)} tensors in it)"
            )
        tensors = read_weights(path, "Hugging Face weights")
        absent, unlisted = sorted(listed - set(tensors)), sorted(set(tensors) - listed)
        if absent:
            raise ClipkitError(f"{path}: {INDEX} places {absent[0]!r} in this shard, which does not hold it")
        if unlisted:
            raise ClipkitError(f"{path}: holds {unlisted[0]!r}, which {INDEX} does not list")
        state.update(tensors)
    return state


def shard_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``, checked: tensor names to ``.safetensors`` file names beside the
    index (a path would read a file outside the checkpoint's folder; a ``.bin`` shard is a pickle)."""
    from clipkit.artifacts.files import read_json as read_artifact

    weight_map = read_artifact(index, "sharded checkpoint index", expect=dict).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ClipkitError(f"{index}: weight_map must map each tensor name to its shard file")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise ClipkitError(
                f"{index}: weight_map[{key!r}] = {shard!r} is not a file name beside the index"
            )
        if not shard.endswith(".safetensors"):
            raise ClipkitError(
                f"{index}: shard {shard} is not a .safetensors file (clipkit never loads pickled shards)"
            )
    return weight_map


def write_dir(spec: ClipSpec, state: StateDict, out: Path) -> Path:
    """Write a Hugging Face CLIPModel directory (config, preprocessor and tokenizer files, weights),
    atomically (``out`` checked first by ``layouts.claim_output``: :data:`DIRECTORY_OUTPUT`)."""
    from safetensors.torch import save_file

    from clipkit.artifacts.io import atomic_directory, tensor_bytes

    config = config_from_spec(spec, float(state["similarity.log_scale"].reshape(())))
    with atomic_directory(Path(out), needed=tensor_bytes(state)) as building:
        save_file(clipkit_to_hf(state), str(building / WEIGHTS), metadata={"format": "pt"})
        (building / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (building / PREPROCESSOR).write_text(
            json.dumps(preprocessor_from_spec(spec), indent=2) + "\n", "utf-8"
        )
        for name, text in tokenizer_files(spec.text.context_length).items():
            (building / name).write_text(text, encoding="utf-8")
    return Path(out)
