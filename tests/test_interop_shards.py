"""Hugging Face checkpoints sharded by ``save_pretrained`` (``model.safetensors.index.json`` +
``model-0000k-of-0000n.safetensors``) read as the single file does, every fault of the index or
its shards one line naming the file; and weights that do not fit the model are named by the keys in
the user's file, not only clipkit's (docs/interop.md). Built without transformers: clipkit writes
the Hugging Face directory itself and shards it as ``save_pretrained`` does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import clipkit
from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.plugins.interop import hf, layouts, open_clip
from clipkit.plugins.interop.spec import ClipSpec, TextSpec, VisionSpec

runner = CliRunner()
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def tiny_spec() -> ClipSpec:
    vision = VisionSpec("vit", 64, 1, 1, 32, patch_size=16)
    text = TextSpec(width=64, layers=1, heads=1, context_length=16)
    return ClipSpec(embed_dim=16, vision=vision, text=text, quick_gelu=True)


@pytest.fixture
def tiny_state(registry):
    torch.manual_seed(0)
    from clipkit.model import build_model

    return build_model(layouts.recipe_for(tiny_spec(), {}, registry), registry).state_dict()


@pytest.fixture
def hf_dir(tmp_path, tiny_state):
    """A tiny Hugging Face CLIPModel directory, one weights file."""
    return hf.write_dir(tiny_spec(), tiny_state, tmp_path / "hf single")


def shard(single, out):
    """``out``: ``single``'s folder with its weights split in two shards and an index."""
    shutil.copytree(single, out)
    state = load_file(str(out / hf.WEIGHTS))
    keys = sorted(state)
    weight_map = {}
    for name, part in zip(SHARDS, (keys[: len(keys) // 2], keys[len(keys) // 2 :]), strict=True):
        save_file({k: state[k] for k in part}, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    (out / hf.WEIGHTS).unlink()
    write_index(out, weight_map)
    return out


def write_index(directory, weight_map):
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / hf.INDEX).write_text(json.dumps(index), encoding="utf-8")


@pytest.fixture
def sharded(hf_dir, tmp_path):
    return shard(hf_dir, tmp_path / "hf sharded")


def run(*args):
    app = make_app(make_plugin_manager(autoload=False))
    return runner.invoke(app, [str(arg) for arg in args])


def one_error(result) -> str:
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert line.startswith("error: ")
    return line


def test_a_sharded_checkpoint_reads_as_its_single_file_does(hf_dir, sharded, tmp_path, registry):
    """Was ``model.safetensors is missing`` for a folder holding only the shards."""
    result = run("convert", sharded, tmp_path / "out")
    assert result.exit_code == 0, result.output
    single, merged = (clipkit.load(path, registry=registry)[0] for path in (hf_dir, sharded))
    ours, theirs = single.state_dict(), merged.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_folder_holding_both_reads_the_single_file_with_one_note(hf_dir, sharded, tmp_path):
    for name in (*SHARDS, hf.INDEX):
        shutil.copy(sharded / name, hf_dir / name)
    (hf_dir / SHARDS[1]).unlink()  # a broken sharded copy is not read: the single file is
    result = run("convert", hf_dir, tmp_path / "out")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and str(hf_dir) in notes[0] and f"reading {hf.WEIGHTS}" in notes[0]


def test_a_missing_shard_is_one_line_naming_it(sharded, tmp_path):
    (sharded / SHARDS[1]).unlink()
    line = one_error(run("convert", sharded, tmp_path / "out"))
    assert str(sharded / hf.INDEX) in line and f"shard {SHARDS[1]} is missing" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "shard_name, expected",
    [
        ("../elsewhere.safetensors", "is not a file name beside the index"),
        ("pytorch_model-00001-of-00002.bin", "is not a .safetensors file"),
    ],
)
def test_an_index_naming_a_path_or_a_pickle_is_refused(sharded, tmp_path, shard_name, expected):
    weight_map = json.loads((sharded / hf.INDEX).read_text())["weight_map"]
    write_index(sharded, dict.fromkeys(weight_map, shard_name))
    line = one_error(run("eval", sharded, "--task", "retrieval", "--data", "synthetic://shapes?n=8"))
    assert str(sharded / hf.INDEX) in line and expected in line


def test_an_index_that_misplaces_a_tensor_is_refused(sharded, tmp_path):
    weight_map = json.loads((sharded / hf.INDEX).read_text())["weight_map"]
    moved = next(key for key, name in weight_map.items() if name == SHARDS[1])
    write_index(sharded, {**weight_map, moved: SHARDS[0]})
    line = one_error(run("convert", sharded, tmp_path / "out"))
    assert str(sharded / SHARDS[0]) in line and repr(moved) in line and "does not hold it" in line


def test_a_folder_without_weights_names_both_files(hf_dir, tmp_path):
    (hf_dir / hf.WEIGHTS).unlink()
    line = one_error(run("convert", hf_dir, tmp_path / "out"))
    assert hf.WEIGHTS in line and hf.INDEX in line and str(hf_dir) in line


def test_a_key_mismatch_names_the_file_and_its_keys(hf_dir, tmp_path):
    """Named only by clipkit's keys (``text_encoder.ln_final.weight``), which the file does not hold."""
    path = hf_dir / hf.WEIGHTS
    state = load_file(str(path))
    state["text_model.final_layer_norm.wieght"] = state.pop("text_model.final_layer_norm.weight")
    save_file(state, str(path))
    line = one_error(run("convert", hf_dir, tmp_path / "out"))
    assert f"the tensors of {path} do not fit the model" in line
    assert "missing text_model.final_layer_norm.weight (clipkit's text_encoder.ln_final.weight)" in line
    assert "unexpected text_model.final_layer_norm.wieght" in line


def test_a_sharded_mismatch_names_the_index(sharded, tmp_path):
    shard_path = sharded / SHARDS[1]
    state = load_file(str(shard_path))
    state.pop(next(iter(state)))
    save_file(state, str(shard_path))
    weight_map = json.loads((sharded / hf.INDEX).read_text())["weight_map"]
    write_index(sharded, {k: v for k, v in weight_map.items() if v != SHARDS[1] or k in state})
    line = one_error(run("convert", sharded, tmp_path / "out"))
    assert f"the tensors of {sharded / hf.INDEX} do not fit the model: missing " in line


def test_a_shape_mismatch_is_named_as_the_file_holds_it(tmp_path, tiny_state):
    """open_clip stores the projection transposed: the shapes are the file's, under its key."""
    directory = open_clip.write_dir(tiny_spec(), tiny_state, tmp_path / "oc")
    path = directory / open_clip.WEIGHTS
    state = load_file(str(path))
    assert tuple(state["visual.proj"].shape) == (64, 16)
    state["visual.proj"] = torch.zeros(64, 8)
    save_file(state, str(path))
    line = one_error(run("convert", directory, tmp_path / "out"))
    assert str(path) in line
    assert "visual.proj (clipkit's image_encoder.proj.weight): (64, 8) vs (64, 16)" in line


def test_a_checkpoint_sharded_by_transformers_reads_as_its_single_file(tmp_path, registry):
    """The real thing: ``CLIPModel.save_pretrained(max_shard_size=...)``'s index and shards."""
    from interop_support import import_transformers

    transformers = import_transformers()
    text = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
            "max_position_embeddings": 20}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).eval()
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert not (tmp_path / "sharded" / hf.WEIGHTS).exists() and (tmp_path / "sharded" / hf.INDEX).is_file()
    single, merged = (clipkit.load(tmp_path / name, registry=registry)[0] for name in ("single", "sharded"))
    ours, theirs = single.state_dict(), merged.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
