"""The one dotted-path lookup (clipkit/config/dotted.py) that recipe loading, validation and the settings
constraints share."""

from __future__ import annotations

import pytest

from clipkit.config.dotted import get_path, lookup, split_path

TREE = {
    "train": {"steps": 10, "distributed": {"local_loss": False}, "report_to": None},
    "eval": [{"name": "zero_shot"}, {"name": "retrieval", "ks": [1, 5]}],
    "variants": {1: "int key", "2": "string key"},
    "model": None,
}


@pytest.mark.parametrize(
    ("path", "value", "stored"),
    [
        ("train.steps", 10, ("train", "steps")),
        ("train.distributed.local_loss", False, ("train", "distributed", "local_loss")),
        ("train.report_to", None, ("train", "report_to")),  # a stored None is found
        ("eval.1.name", "retrieval", ("eval", 1, "name")),  # numeric parts index lists, as ints
        ("eval.1.ks.0", 1, ("eval", 1, "ks", 0)),
        ("variants.1", "int key", ("variants", 1)),  # YAML int keys
        ("variants.2", "string key", ("variants", "2")),  # a string key of that name wins
        (("eval", "0", "name"), "zero_shot", ("eval", 0, "name")),  # a tuple of keys
        ("train", TREE["train"], ("train",)),
    ],
)
def test_lookup_finds_the_value_and_the_stored_keys(path, value, stored):
    assert lookup(TREE, path) == (True, value, stored)
    assert get_path(TREE, path, default="absent") == value


@pytest.mark.parametrize(
    "path",
    [
        "train.stpes",  # a missing key
        "train.steps.more",  # inside a number
        "model.image_encoder",  # inside a stored None
        "eval.2",  # past the end of a list
        "eval.-1",  # negative indices are not positions
        "eval.name",  # a name on a list
        "variants.3",
        "",
    ],
)
def test_a_missing_path_is_not_found(path):
    found, value, keys = lookup(TREE, path)
    assert (found, value, keys) == (False, None, split_path(path))
    assert get_path(TREE, path) is None
    assert get_path(TREE, path, default="absent") == "absent"


def test_split_path():
    assert split_path("a.b.0") == ("a", "b", "0")
    assert split_path(["a", 0]) == ("a", 0)


def test_recipe_and_settings_schema_use_the_shared_lookup():
    """The copies the lookup replaced are gone: both modules call clipkit.config.dotted."""
    import clipkit.artifacts.export
    import clipkit.config.recipe
    import clipkit.config.settings_schema

    assert clipkit.config.recipe.get_path is get_path and clipkit.config.recipe.lookup is lookup
    assert clipkit.config.settings_schema.lookup is lookup
    assert clipkit.artifacts.export.get_path is get_path
    assert not hasattr(clipkit.config.recipe, "_lookup") and not hasattr(
        clipkit.config.settings_schema, "_lookup"
    )


def test_host_constraints_skip_unset_keys_and_check_set_ones():
    from clipkit.config.settings_schema import check_host

    assert check_host({"train": {"distributed": None}}) == []
    errors = check_host({"train": {"distributed": {"zero_stage": 7}}})
    assert len(errors) == 1 and errors[0].startswith("train.distributed.zero_stage: ")
