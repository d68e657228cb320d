"""Recipes: OmegaConf YAML naming plugins by registered name.

``load_recipe("clip@tiny", ["train.steps=20"])`` resolves a registered recipe (or a
YAML file path), applies the variant then the ``key=value`` overrides, and returns a
plain dict. :func:`validate` checks every plugin slot against its factory's signature
without building anything and returns *all* errors with their key paths.

Changing a slot's ``name`` (``loss.name=siglip`` or in a variant) resets that slot's
arguments to the new factory's defaults, so arguments of the old plugin never leak
into the new one; set new arguments after the name (``loss.name=x loss.foo=1``).
"""

from __future__ import annotations

import copy
import inspect
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from clipkit.config.constraints import type_hints
from clipkit.config.dotted import get_path, lookup
from clipkit.config.machine import usable_cpus
from clipkit.config.settings_schema import (  # noqa: F401 — the sections are re-exported: clipkit.config.recipe.DataConfig
    SECTIONS,
    DataConfig,
    DistillConfig,
    DistributedConfig,
    EmaConfig,
    LoraConfig,
    ModelConfig,
    RootConfig,
    TrainConfig,
    parameter_constraints,
)
from clipkit.contract.registry import Registry
from clipkit.errors import ClipkitError, RecipeError, UnknownNameError, close_matches


@dataclass(frozen=True)
class Slot:
    """A place in a recipe that names a plugin: its key path, kind and host-supplied arguments."""

    path: str
    kind: str
    injected: frozenset[str]


#: Plugin slots of a recipe. ``injected`` arguments are passed by the host when the factory names them.
SLOTS = (
    Slot("model.image_encoder", "encoder", frozenset({"embed_dim", "image_size", "input_mean", "input_std"})),
    Slot("model.text_encoder", "encoder", frozenset({"embed_dim", "vocab_size", "context_length"})),
    Slot("model.tokenizer", "tokenizer", frozenset()),
    Slot("similarity", "similarity", frozenset({"embed_dim"})),
    Slot("loss", "loss", frozenset({"num_samples", "total_steps", "batch_size"})),
    Slot("optimizer", "optimizer", frozenset({"named_parameters"})),
    Slot("schedule", "schedule", frozenset({"optimizer", "total_steps"})),
    Slot("data.stream", "stream", frozenset({"batch_size", "seed", "rank", "world_size"})),
)
#: Slots a recipe may leave out (None): the loop then does without them.
OPTIONAL_SLOTS = ("data.stream",)
EVAL_INJECTED = frozenset()


#: Top-level keys of a recipe: its description, plugin slots, sections and top-level settings.
TOP_LEVEL = {"name", "description", "paper", "notes", "eval", "variants", "similarity", "loss"}
TOP_LEVEL |= {"optimizer", "schedule"} | set(SECTIONS) | {f.name for f in fields(RootConfig)}
TEXT_SLOTS = ("model.text_encoder", "model.tokenizer")


# ----------------------------------------------------------------------------- loading


def split_spec(spec: str) -> tuple[str, str | None]:
    """'clip@tiny' -> ('clip', 'tiny'); 'wpse@imq+tiny' -> ('wpse', 'imq+tiny'); 'clip' -> ('clip', None)."""
    name, _, variant = spec.partition("@")
    return name, (variant or None)


def read_base(name: str, registry: Registry) -> dict:
    """A registered recipe by name, or a YAML file when ``name`` is a path."""
    from clipkit.artifacts.files import read_yaml_mapping

    if name.endswith((".yaml", ".yml")) or Path(name).is_file():
        path = Path(name)
        if not path.is_file():
            raise RecipeError(name, [f"recipe file {path} does not exist"])
        return read_yaml_mapping(path, "recipe file", "fix it or name a registered recipe (clipkit recipes)")
    return copy.deepcopy(registry.factory("recipe", registry.get("recipe", name).name)())


def load_recipe(spec: str, overrides: list[str] | tuple[str, ...] = (), *, registry: Registry) -> dict:
    """Resolve ``NAME[@VARIANT]`` plus ``key=value`` overrides into a plain dict (not validated)."""
    from omegaconf import OmegaConf

    base_name, variant = split_spec(spec)
    recipe = read_base(base_name, registry)
    variants = recipe.pop("variants", None) or {}
    if not isinstance(variants, dict):
        raise RecipeError(base_name, ["variants: must be a mapping of variant name -> {key: value}"])
    config = OmegaConf.create(recipe)
    # Variants compose left to right: `wpse@imq+tiny` applies `imq`, then `tiny`.
    interpolating = True  # whether config may hold a `${`: not known yet
    for name in variant.split("+") if variant else []:
        if name not in variants:
            raise UnknownNameError("variant", name, variants, where=f"recipe {base_name!r}")
        if not isinstance(variants[name], dict):
            raise RecipeError(base_name, [f"variants.{name}: must be a mapping of key -> value"])
        for key, value in variants[name].items():
            interpolating = guarded_override(config, key, value, spec, interpolating)
    apply_overrides(config, overrides, spec)
    if names_other_shards(overrides, spec):
        # The recipe's data.source says how to make *its* shards (the quickstart's synthetic
        # shapes); kept, it would fill the user's data.shards with them and train on the wrong data.
        OmegaConf.update(config, "data.source", "", force_add=True)
    resolved = resolve_interpolations(config, spec)
    train = resolved.get("train")
    if isinstance(train, dict) and train.get("precision") is False:
        train["precision"] = "no"  # YAML 1.1 reads an unquoted `no` (train.precision=no) as false
    warn_deprecated(resolved)
    resolved["name"] = spec if Path(base_name).suffix not in (".yaml", ".yml") else Path(base_name).stem
    resolved["overrides"] = list(overrides)
    return resolved


def warn_deprecated(recipe: dict) -> None:
    """One line on stderr for each deprecated spelling the recipe uses (it still works this release),
    and for each setting that does nothing in this recipe (:func:`settings_without_effect`)."""
    from clipkit.tiled.settings import deprecation_warning

    line = deprecation_warning(recipe)
    for warning in ([line] if line else []) + settings_without_effect(recipe):
        print(warning if warning.startswith("warning: ") else f"warning: {warning}", file=sys.stderr)


def settings_without_effect(recipe: dict) -> list[str]:
    """Settings the recipe sets that another of its settings (or this machine) makes do nothing, or
    worse: said, not ignored unseen (each still validates and runs; a recipe may set them for its
    other variants)."""
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    distributed = train.get("distributed") if isinstance(train.get("distributed"), dict) else {}
    lines = []
    if _positive(train.get("eval_every")) and not recipe.get("eval"):
        lines.append(
            f"train.eval_every={train['eval_every']} does nothing: the recipe has no eval: tasks "
            "(add some, or train on your data with --data, which adds retrieval on its held-out split)"
        )
    if train.get("similarity_precision") == "half" and train.get("precision") not in ("bf16", "fp16"):
        lines.append(
            f"train.similarity_precision=half does nothing with train.precision={train.get('precision')}: "
            "the features are half precision only in a bf16 or fp16 run"
        )
    if train.get("compile", "none") == "none":
        changed = changed_from(train, {"compile_scope": "towers", "compile_unit": "tower"})
        if changed:
            lines.append(
                f"train.{', '.join(changed)} does nothing with train.compile=none: "
                "they say what train.compile compiles (e.g. train.compile=default)"
            )
    threads, cpus = train.get("threads"), usable_cpus()
    if _positive(threads) and threads > 2 * cpus:
        lines.append(
            f"train.threads={threads} is more than twice the {cpus} CPU(s) this process may use: "
            "the threads take turns on the cores and the step slows down (train.threads=auto fits them)"
        )
    if distributed.get("strategy", "ddp") != "deepspeed":
        zero_only = {"zero_stage": 2, "offload_optimizer": "none", "offload_params": "none"}
        changed = changed_from(distributed, zero_only)
        if changed:
            lines.append(
                f"train.distributed.{', '.join(changed)} does nothing with strategy="
                f"{distributed.get('strategy', 'ddp')}: these are DeepSpeed ZeRO settings "
                "(strategy=deepspeed)"
            )
    return lines


def changed_from(section: dict, defaults: dict) -> list[str]:
    """``key=value`` for each key of ``defaults`` that ``section`` sets to another value."""
    return [
        f"{key}={section[key]}" for key, default in defaults.items() if section.get(key, default) != default
    ]


def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def amend_resolved(recipe: dict, extra: list[str], *, kept: list[str], where: str) -> dict:
    """A resolved ``recipe`` with ``extra`` overrides applied, as if they had come before ``kept``
    (the overrides it was resolved with): an extra whose key one of ``kept`` sets, or sets a parent
    of, is left out, so the user's word still wins. Resolves nothing again."""
    from omegaconf import OmegaConf

    user_keys = {parse_override(item, where)[0] for item in kept}
    config = OmegaConf.create({key: value for key, value in recipe.items() if key != "overrides"})
    for item in extra:
        key, value = parse_override(item, where)
        if not any(key == user or key.startswith(f"{user}.") for user in user_keys):
            apply_override(config, key, value)
    amended = OmegaConf.to_container(config, resolve=False)
    amended["overrides"] = list(extra) + list(recipe.get("overrides") or [])
    return amended


#: Bounds on ``${...}`` resolution. A recipe is a few kilobytes; interpolations that repeat a value
#: (``a1: ${a0}${a0}``, ``a2: ${a1}${a1}``, ...) double it at every level, and OmegaConf resolves each
#: reference afresh, so 25 levels take tens of gigabytes and 2**25 steps. Both are estimated from the
#: recipe's text before anything is resolved.
MAX_RESOLVED_CHARS = 1_000_000  # characters one value may resolve to
MAX_RESOLUTION_STEPS = 100_000  # references OmegaConf would follow to resolve one value
MAX_INTERPOLATION_DEPTH = 32  # references in a chain (a -> b -> c ...)


def resolve_interpolations(config, where: str) -> dict:
    """The plain dict of ``config`` with ``${...}`` resolved; a bad interpolation is a RecipeError.

    Only references to other keys of the recipe (``${train.steps}``, ``${..embed_dim}``) are
    resolved. Resolvers (``${oc.env:VAR}``, ``${oc.decode:...}``, any registered ``${name:...}``)
    are refused before anything is resolved, naming the key: a resolver brings in something the
    recipe does not hold (an environment variable, a secret), and the resolved recipe is written to
    ``RUN/recipe.yaml``, ``state.pt`` and every export's ``clipkit.json`` and echoed in error
    messages — so its value would land in artifacts and logs. Refusing is the simpler safe design:
    keeping the reference unresolved in everything written would need a second, unresolved copy of
    the recipe carried beside the resolved one through training, checkpoints and exports, and a
    recipe whose meaning depends on the environment would not reproduce from its own
    ``recipe.yaml`` anyway. Resolution is also bounded (:data:`MAX_RESOLVED_CHARS`,
    :data:`MAX_RESOLUTION_STEPS`, :data:`MAX_INTERPOLATION_DEPTH`) by :func:`check_interpolations`.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    check_interpolations(config, where)
    try:
        return OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(where, [f"{key}: cannot resolve interpolation ({message})"]) from error


def check_interpolations(config, where: str) -> bool:
    """Refuse resolvers and interpolations too large or deep to resolve, naming the key; resolves
    nothing. Returns whether ``config`` holds any ``${`` at all (most recipes hold none: then
    nothing more is walked).

    Each ``${key}`` of every value is followed once (memoised), adding up the characters and the
    references OmegaConf would produce and follow, so the check costs the size of the recipe.
    """
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(config, resolve=False)
    if not mentions_interpolation(raw):
        return False
    estimate = _Estimate(raw, where)
    for path in _leaf_paths(raw):
        estimate.origin = path
        estimate.cost(path, 0)
    return True


def _leaf_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in _leaf_paths(value, (*prefix, key))]
    if isinstance(node, list):
        return [p for i, value in enumerate(node) for p in _leaf_paths(value, (*prefix, i))]
    return [prefix]


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path)) or "<root>"


class _Estimate:
    """Characters and reference steps each node of a raw (unresolved) recipe resolves to."""

    def __init__(self, raw: Any, where: str) -> None:
        self.raw, self.where = raw, where
        self.memo: dict[tuple, tuple[int, int]] = {}
        self.active: set[tuple] = set()
        self.origin: tuple = ()  # the value being checked (named when its chain is too deep)

    def fail(self, path: tuple, problem: str) -> None:
        raise RecipeError(self.where, [f"{_dotted(path)}: {problem}"])

    def cost(self, path: tuple, depth: int) -> tuple[int, int, int]:
        """(characters, reference steps, chain height) of the value at ``path``."""
        found, node, path = lookup(self.raw, path)
        if not found or path in self.active:
            return (0, 1, 0)  # a missing key or a cycle: OmegaConf reports it when it resolves
        if path in self.memo:
            return self.memo[path]
        if depth > MAX_INTERPOLATION_DEPTH:
            self.fail(
                self.origin, f"interpolations nested more than {MAX_INTERPOLATION_DEPTH} references deep"
            )
        self.active.add(path)
        chars = steps = height = 0
        try:
            if isinstance(node, dict | list):
                for key in node.keys() if isinstance(node, dict) else range(len(node)):
                    c, s, h = self.cost((*path, key), depth)
                    chars, steps, height = chars + c + len(str(key)) + 4, steps + s, max(height, h)
            elif isinstance(node, str) and "${" in node:
                chars, steps = len(node), 1
                for target, written in self.references(path, node):
                    c, s, h = self.cost(target, depth + 1)  # `${...}` (`written` characters) -> c
                    chars, steps, height = chars - written + c, steps + s, max(height, h + 1)
            else:
                chars = len(str(node))
        finally:
            self.active.discard(path)
        if height > MAX_INTERPOLATION_DEPTH:
            self.fail(path, f"interpolations nested more than {MAX_INTERPOLATION_DEPTH} references deep")
        if chars > MAX_RESOLVED_CHARS:
            self.fail(
                path,
                f"interpolations resolve to more than {MAX_RESOLVED_CHARS:,} characters "
                "(values repeated by nested ${...}); recipe values are bounded",
            )
        if steps > MAX_RESOLUTION_STEPS:
            self.fail(
                path,
                f"interpolations need more than {MAX_RESOLUTION_STEPS:,} references to resolve "
                "(values repeated by nested ${...}); recipe values are bounded",
            )
        self.memo[path] = (chars, steps, height)
        return self.memo[path]

    def references(self, path: tuple, text: str) -> list[tuple[tuple, int]]:
        """(absolute path, length of its ``${...}``) of each reference in ``text`` (the value at
        ``path``); a resolver is an error."""
        from omegaconf import grammar_parser
        from omegaconf._utils import split_key
        from omegaconf.errors import GrammarParseError

        try:
            tree = grammar_parser.parse(text)
        except GrammarParseError:
            return []  # OmegaConf reports the syntax error when it resolves
        targets = []
        stack = [tree]
        while stack:
            node = stack.pop()
            kind = type(node).__name__
            if kind == "InterpolationResolverContext":
                name = node.getChild(1).getText()
                self.fail(
                    path,
                    f"the resolver ${{{name}:...}} is not allowed in recipes (resolvers read the environment "
                    "or files, and a recipe is written to recipe.yaml, checkpoints and exports); "
                    "write the value itself",
                )
            if kind == "InterpolationNodeContext":
                keys = [c for c in node.getChildren() if type(c).__name__ == "ConfigKeyContext"]
                if any(
                    c.getChildCount() and type(c.getChild(0)).__name__ != "TerminalNodeImpl" for c in keys
                ):
                    self.fail(
                        path, "a key built from an interpolation (${a.${b}}) is not supported in recipes"
                    )
                written = node.getText()
                targets.append((_absolute(path, split_key(written[2:-1])), len(written)))
            stack.extend(node.getChildren() if hasattr(node, "getChildren") else [])
        return [(self.redirect(target, 0), written) for target, written in targets]

    def redirect(self, target: tuple, hops: int) -> tuple:
        """``target`` with any prefix that is itself a bare ``${key}`` replaced by where it points."""
        for cut in range(len(target) - 1, 0, -1):
            found, node, _ = lookup(self.raw, target[:cut])
            if found and isinstance(node, str) and hops < MAX_INTERPOLATION_DEPTH:
                refs = self.references(target[:cut], node) if node.startswith("${") else []
                if len(refs) == 1 and refs[0][1] == len(node):
                    return self.redirect((*refs[0][0], *target[cut:]), hops + 1)
        return target


def _absolute(path: tuple, parts: list[str]) -> tuple:
    """The absolute key of ``${...}`` (split by OmegaConf) written in the value at ``path``."""
    dots = 0
    while dots < len(parts) and parts[dots] == "":
        dots += 1
    base = path[:-1] if dots else ()
    if dots > 1:
        base = base[: max(len(base) - (dots - 1), 0)]
    return (*base, *parts[dots:])


def parse_override(item: str, where: str) -> tuple[str, Any]:
    """'optimizer.betas=[0.9,0.95]' -> ('optimizer.betas', [0.9, 0.95]) (values parsed as YAML)."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    from clipkit.artifacts.files import one_line, yaml_problem

    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(where, [f"override {item!r} is not of the form key=value"])
    try:
        return key.strip(), parse_value(text)
    except yaml.MarkedYAMLError as error:  # the column counts in the whole override, key= included
        problem = yaml_problem(error, column_offset=len(key) + 1)
        raise RecipeError(where, [f"override {item!r}: value is not valid YAML ({problem})"]) from error
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        problem = f"override {item!r}: value cannot be parsed ({one_line(error)})"
        raise RecipeError(where, [problem]) from error


def parse_value(text: str) -> Any:
    """A command-line value parsed as YAML, as OmegaConf's dotlist does ('3' -> 3, '[1,2]' -> [1, 2])."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.from_dotlist([f"x={text}"]))["x"]


def apply_overrides(config, overrides, where: str) -> None:
    """Apply ``key=value`` strings in order (see :func:`apply_override`)."""
    interpolating = True  # not known yet
    for item in overrides:
        key, value = parse_override(item, where)
        interpolating = guarded_override(config, key, value, where, interpolating)


def guarded_override(config, key: str, value: Any, where: str, interpolating: bool) -> bool:
    """:func:`apply_override` after :func:`check_interpolations` (it looks current values up,
    resolving them); returns whether ``config`` may now hold an interpolation. A config known to
    hold none (``interpolating`` False) is not checked again: a value without ``${`` adds none."""
    if interpolating:
        interpolating = check_interpolations(config, where)
    apply_override(config, key, value)
    return interpolating or mentions_interpolation(value)


def mentions_interpolation(value: Any) -> bool:
    """Whether any text inside ``value`` (a scalar, or mappings and lists of them) holds ``${``."""
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(mentions_interpolation(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(mentions_interpolation(v) for v in value)
    return False


def names_other_shards(overrides, where: str) -> bool:
    """Whether the overrides point ``data.shards`` (or ``data.mixture``) elsewhere without naming the
    ``data.source`` to make them from: then they name data to read, never a place to write to."""
    keys: set[str] = set()
    for item in overrides:
        key, value = parse_override(item, where)
        keys.add(key)
        if key == "data" and isinstance(value, dict):
            keys.update(f"data.{name}" for name in value)
    return bool(keys & {"data.shards", "data.mixture"}) and "data.source" not in keys


def apply_override(config, key: str, value: Any) -> None:
    """Set ``key`` (dotted) to ``value``, merging mappings (``{}`` empties one); a new slot ``name``
    resets the slot.

    A bare name for a slot is short for its ``name``: ``loss=simclr`` = ``loss.name=simclr``.
    """
    from omegaconf import OmegaConf

    slot_paths = {slot.path for slot in SLOTS}
    if isinstance(value, str) and key in slot_paths | _eval_paths(config):
        key = f"{key}.name"
    parent, _, leaf = key.rpartition(".")
    if leaf == "name" and parent in slot_paths | _eval_paths(config):
        current = OmegaConf.select(config, parent)
        if current is None or current.get("name") != value:
            OmegaConf.update(config, parent, {"name": value}, merge=False)
        return
    if isinstance(value, dict) and key in slot_paths and "name" in value:
        current = OmegaConf.select(config, key)
        if current is None or current.get("name") != value["name"]:
            OmegaConf.update(config, key, value, merge=False)
            return
    in_slot = any(key.startswith(f"{path}.") for path in slot_paths)
    if value is None and isinstance(OmegaConf.select(config, key, default=None), str) and not in_slot:
        # `data.source=` clears a text setting (YAML would read it as null). A plugin's argument
        # keeps null: its factory's "unset" (`model.image_encoder.weights=null`: no weight head).
        value = ""
    if isinstance(value, dict) and not value:
        # `train.ema={}` empties the mapping (switches the feature off); merged, it changed nothing.
        OmegaConf.update(config, key, value, merge=False, force_add=True)
        return
    OmegaConf.update(config, key, value, merge=True, force_add=True)


def _eval_paths(config) -> set[str]:
    tasks = config.get("eval") or []
    return {f"eval.{i}" for i in range(len(tasks))}


def save_recipe(recipe: dict, path: Path) -> None:
    """Write the resolved recipe as YAML, atomically."""
    from omegaconf import OmegaConf

    from clipkit.artifacts.io import atomic_write_text

    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(recipe)))


def variants_of(name: str, registry: Registry) -> list[str]:
    return sorted((read_base(name, registry).get("variants") or {}).keys())


# ----------------------------------------------------------------------------- validation


def validate(recipe: dict, registry: Registry) -> list[str]:
    """Every problem in ``recipe`` as 'key.path: message'; empty when it is valid."""
    errors: list[str] = []
    for key in recipe:
        if key not in TOP_LEVEL | {"overrides"}:
            errors.append(_unknown_key(key, key, TOP_LEVEL))
    for section, schema in SECTIONS.items():
        errors += _check_section(recipe.get(section), section, schema)
    pair = get_path(recipe, "model.pair")
    for slot in SLOTS:
        if slot.path in TEXT_SLOTS and pair == "two_view":
            continue  # one shared image encoder: no text tower, no tokenizer
        if slot.path == "model.tokenizer" and pair == "vectors":
            continue  # vector inputs: nothing to tokenize
        if slot.path in OPTIONAL_SLOTS and get_path(recipe, slot.path) is None:
            continue
        errors += check_slot(get_path(recipe, slot.path), slot.path, slot.kind, slot.injected, registry)
    if pair in (None, "image_text"):
        errors += _check_required_tokenizer(recipe, registry)
    tasks = recipe.get("eval") or []
    if not isinstance(tasks, list):
        errors.append("eval: must be a list of tasks ({name: ..., ...})")
        tasks = []
    for i, task in enumerate(tasks):
        errors += check_slot(task, f"eval.{i}", "eval", EVAL_INJECTED, registry)
    errors += _check_values(recipe, errors)
    from clipkit.tiled import settings as tiling

    typed = {error.partition(":")[0] for error in errors}
    errors += [e for e in tiling.validation_errors(recipe, registry) if e.partition(":")[0] not in typed]
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    if train.get("distill"):
        errors += _check_distill(recipe, train["distill"], registry)
    errors += _check_similarity_precision(recipe, registry)
    return errors + _check_compile_strategy(train) + _check_trackers(train)


def half_features_refusal(similarity: Any) -> str | None:
    """Why ``train.similarity_precision: half`` (with bf16/fp16 towers) cannot run with
    ``similarity`` — its class, or the built module — or None when it declares ``half_features``.
    Validation asks the factory's class, the objective the built module: one message for both."""
    from clipkit.contract.types import optional_member

    if optional_member(similarity, "half_features"):
        return None
    name = similarity.__name__ if isinstance(similarity, type) else type(similarity).__name__
    return (
        f"half: the similarity {name} does not declare half_features (it computes in fp32 only); "
        "use train.similarity_precision=fp32"
    )


def declared_class(factory: Any) -> type | None:
    """The class a registered factory builds, when it says so without being called: the class
    itself, or a preset's (or function's) return annotation naming a class; else None."""
    if inspect.isclass(factory):
        return factory
    try:  # type hints resolve a string annotation (`from __future__ import annotations`)
        returns = typing.get_type_hints(factory).get("return")
    except Exception:  # an annotation naming what its module cannot import: nothing declared
        returns = None
    return returns if inspect.isclass(returns) else None


def _check_similarity_precision(recipe: dict, registry: Registry) -> list[str]:
    """``train.similarity_precision: half`` with half towers and a similarity whose class does not
    declare ``half_features``: the run refused it once the model was built (after sharding the
    data). A factory that does not name its class is left to that run-time check."""
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    if train.get("similarity_precision") != "half" or train.get("precision") not in ("bf16", "fp16"):
        return []  # fp32 features, or half ones that do nothing (settings_without_effect says so)
    try:
        similarity = declared_class(registry.factory("similarity", get_path(recipe, "similarity.name")))
    except (UnknownNameError, TypeError):  # an unknown or missing name: the slot checks say it
        return []
    why = None if similarity is None else half_features_refusal(similarity)
    return [f"train.similarity_precision: {why}"] if why else []


def _check_compile_strategy(train: dict) -> list[str]:
    """``train.compile`` under a strategy that refuses it: the run asks the same
    :func:`compile_refusal` (``Runtime.compile_refusal``) once its runtime is built."""
    distributed = train.get("distributed") if isinstance(train.get("distributed"), dict) else {}
    if train.get("compile", "none") == "none":
        return []
    why = compile_refusal(distributed.get("strategy", "ddp"), distributed.get("zero_stage", 2))
    return [f"train.compile: {why}"] if why else []


def compile_refusal(strategy: Any, zero_stage: Any) -> str | None:
    """Why ``train.compile`` cannot run under ``strategy`` (None when it can): under DeepSpeed
    ZeRO-3, measured on the CPU (2 processes, ``compile_scope: step``), the weights were right
    (1.1e-6 of eager DDP's after 4 steps) but TorchDynamo traced DeepSpeed's per-module parameter
    hooks and recompiled them per module type up to its recompile limit (8), three hooks over,
    leaving them eager after a wasted compile. Asked by validation and by
    ``DeepSpeedStrategy.compile_refusal`` (clipkit.train.runtime.zero)."""
    if strategy == "deepspeed" and zero_stage == 3:
        return (
            "under ZeRO-3 TorchDynamo traces DeepSpeed's per-module parameter-gathering hooks and "
            "recompiles them for every module type up to its recompile limit; use zero_stage 1 or 2, "
            "FSDP2 or DDP (compiled towers run there), or train.compile=none"
        )
    return None


def _check_trackers(train: dict) -> list[str]:
    """Each ``train.report_to`` name a tracker's: clipkit's own, or Accelerate's. The run would
    refuse another at its start. Accelerate's own list is imported (~0.7 s) only for a name in
    neither static list: an Accelerate newer than the pinned one may know more trackers."""
    from clipkit.config.settings_schema import ACCELERATE_TRACKERS, BUILT_IN_TRACKERS

    value = train.get("report_to") or []
    names = value.split(",") if isinstance(value, str) else [str(item) for item in value]
    others = [name.strip().removeprefix("accelerate:") for name in names if name.strip()]
    others = [name for name in others if name not in {*BUILT_IN_TRACKERS, *ACCELERATE_TRACKERS}]
    if not others:
        return []
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    known = ", ".join(sorted({*BUILT_IN_TRACKERS, *LOGGER_TYPE_TO_CLASS}))
    return [
        f"train.report_to: unknown tracker {name!r}; known: {known}"
        for name in others
        if name not in LOGGER_TYPE_TO_CLASS
    ]


def validate_or_raise(recipe: dict, registry: Registry, where: str | None = None) -> dict:
    """``recipe`` when it is valid, else a RecipeError naming ``where`` (what the user named: a
    recipe or a file path; default the recipe's name) with every problem."""
    errors = validate(recipe, registry)
    if errors:
        raise RecipeError(where or recipe.get("name", "?"), errors)
    return recipe


def check_slot(config: Any, path: str, kind: str, injected: frozenset[str], registry: Registry) -> list[str]:
    """Bind a slot's arguments to its factory's signature without calling it."""
    if config is None:
        return [f"{path}: missing (a mapping with the {kind}'s registered `name`)"]
    if not isinstance(config, dict) or not isinstance(config.get("name"), str):
        return [f"{path}: must be a mapping with a `name` naming a registered {kind}"]
    try:
        entry = registry.get(kind, config["name"])
    except UnknownNameError as error:
        return [f"{path}.name: {error}"]
    kwargs = {k: v for k, v in config.items() if k != "name"}
    if kind == "loss":  # the deprecated loss.tiled / loss.tile_size are the host's (clipkit.tiled.settings)
        from clipkit.tiled.settings import loss_factory_config

        kwargs = loss_factory_config(kwargs)
    return check_arguments(entry.factory, kwargs, path, f"{kind} {entry.name!r}", injected)


def _check_required_tokenizer(recipe: dict, registry: Registry) -> list[str]:
    """The text tower's declared ``required_tokenizer`` (clipkit.contract.types.OPTIONAL_MEMBERS) against
    ``model.tokenizer`` (the tokenizer factory's defaults filled in); a mismatch names the override."""
    from clipkit.contract.types import optional_member

    encoder, tokenizer = get_path(recipe, "model.text_encoder"), get_path(recipe, "model.tokenizer")
    if not all(isinstance(slot, dict) and isinstance(slot.get("name"), str) for slot in (encoder, tokenizer)):
        return []  # reported by check_slot
    try:
        required = optional_member(registry.factory("encoder", encoder["name"]), "required_tokenizer")
        factory = registry.factory("tokenizer", tokenizer["name"])
    except UnknownNameError:
        return []  # reported by check_slot
    if not required:
        return []
    if tokenizer["name"] == required.get("name"):
        defaults = {
            name: parameter.default
            for name, parameter in inspect.signature(factory).parameters.items()
            if parameter.default is not inspect.Parameter.empty
        }
        tokenizer = {**defaults, **tokenizer}
    if all(tokenizer.get(key) == value for key, value in required.items()):
        return []

    def flow(mapping: dict) -> str:  # as an override writes it
        return "{" + ", ".join(f"{key}: {value}" for key, value in mapping.items()) + "}"

    wanted, given = flow(required), flow(get_path(recipe, "model.tokenizer"))
    return [
        f"model.tokenizer: text encoder {encoder['name']!r} (model.text_encoder) needs tokenizer {wanted}, "
        f"the vocabulary its weights index, not {given}; add the override model.tokenizer={wanted}"
    ]


def check_arguments(factory, kwargs: dict, path: str, what: str, injected: frozenset[str]) -> list[str]:
    parameters = inspect.signature(factory).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = {n: p for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    hints = _type_hints(factory)
    constraints = parameter_constraints(factory)  # Annotated[float, Range(gt=0)] and the like
    errors = []
    for key, value in kwargs.items():
        if key in injected and key in named:
            errors.append(f"{path}.{key}: set by clipkit for {what}; remove it from the recipe")
        elif key not in named and not accepts_any:
            accepted = sorted(set(named) - injected)
            errors.append(_unknown_key(f"{path}.{key}", key, accepted, f"for {what}"))
        else:
            problem = _type_problem(value, hints[key]) if key in hints else None
            if problem is None and key in constraints:
                problem = constraints[key].problem(value)
            if problem:
                errors.append(f"{path}.{key}: {problem}")
    for name, parameter in named.items():
        if parameter.default is inspect.Parameter.empty and name not in kwargs and name not in injected:
            errors.append(f"{path}.{name}: missing required argument of {what}")
    return errors


def _type_hints(factory) -> dict[str, Any]:
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        return type_hints(target)
    except Exception:  # unresolvable annotations: skip type checks rather than fail validation
        return {}


def _type_problem(value: Any, hint: Any) -> str | None:
    """A message when ``value`` clearly cannot be ``hint`` (simple types only), else None."""
    allowed = _simple_types(hint)
    if allowed is None or value is None and type(None) in allowed:
        return None
    if isinstance(value, bool) and bool not in allowed:
        return f"expected {_type_names(allowed)}, got bool {value!r}"
    if any(isinstance(value, t) for t in allowed) or (isinstance(value, int) and float in allowed):
        return None
    return f"expected {_type_names(allowed)}, got {type(value).__name__} {value!r}"


def _simple_types(hint: Any) -> tuple[type, ...] | None:
    origin = typing.get_origin(hint)
    if hint in (int, float, str, bool):
        return (hint,)
    if origin in (list, tuple) or hint in (list, tuple):
        return (list, tuple)
    if origin is dict or hint is dict:
        return (dict,)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [
            _simple_types(arg) if arg is not type(None) else (type(None),) for arg in typing.get_args(hint)
        ]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)
    return None


def _type_names(types_: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types_)


def _check_section(config: Any, section: str, schema) -> list[str]:
    if config is None:
        return [] if section == "train" else [f"{section}: missing section"]
    if not isinstance(config, dict):
        return [f"{section}: must be a mapping"]
    known = {f.name: f for f in fields(schema)}
    hints = type_hints(schema)
    errors = []
    for key, value in config.items():
        if key not in known:
            errors.append(_unknown_key(f"{section}.{key}", key, known))
        elif known[key].default is not None:  # slots (default None) are checked by check_slot
            problem = _type_problem(value, hints[key])
            if problem:
                errors.append(f"{section}.{key}: {problem}")
    return errors


def _check_values(recipe: dict, reported: list[str]) -> list[str]:
    """Ranges and choices of host settings (:data:`clipkit.config.settings_schema.HOST`), plus the rules
    that tie settings together; a key whose type is already reported is not reported again."""
    from clipkit.config.settings_schema import check_host

    typed = {error.partition(":")[0] for error in reported}
    errors = [e for e in check_host(recipe) if e.partition(":")[0] not in typed]
    reported_keys = typed | {error.partition(":")[0] for error in errors}
    errors += [e for e in _unusable_numbers(recipe) if e.partition(":")[0] not in reported_keys]
    errors += _check_locations(recipe.get("data"))
    data, train = (recipe.get(k) or {} for k in ("data", "train"))
    if isinstance(data, dict) and not (data.get("shards") or data.get("source") or data.get("stream")):
        errors.append(
            "data: set `shards` (a shard directory) and/or `source` (a URI to shard from), "
            "or `stream` (a registered batch stream)"
        )
    if isinstance(data, dict):
        errors += _check_augment(data)
        errors += _check_background(data)
    errors += _check_machine(data, train)
    errors += _check_micro_batch(data, train)
    model = recipe.get("model")
    if isinstance(model, dict):
        errors += _check_lora(model.get("lora") or {}, model.get("frozen") or ())
    if isinstance(train, dict):
        errors += _check_train(train)
    return errors


#: Why FSDP2 refuses fp16 (clipkit.train.runtime.fsdp2 says it too, for a recipe not validated).
FSDP2_FP16_REFUSAL = (
    "train.precision=fp16 is not supported with train.distributed.strategy=fsdp2: fp16 needs loss "
    "scaling, and torch's GradScaler cannot unscale FSDP2's sharded gradients together with the "
    "similarity's replicated ones; use train.precision=bf16 (no loss scaling needed), or fp16 with "
    "strategy ddp or deepspeed"
)


def _unusable_numbers(node: Any, path: str = "") -> list[str]:
    """'key.path: ...' for every number anywhere in the recipe (plugin arguments and eval tasks
    too) that no setting can hold: inf, nan, integers beyond 64 bits."""
    from clipkit.config.constraints import number_problem

    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        problem = number_problem(node)
        return [f"{path}: {problem}"] if problem else []
    return [
        e for key, value in items for e in _unusable_numbers(value, f"{path}.{key}" if path else str(key))
    ]


def _check_locations(data: Any) -> list[str]:
    """``data.shards`` / ``data.mixture``: every URL parses and every mixture entry is usable (its
    weight finite and positive, its shards named), before anything is read."""
    from clipkit.data.remote import url_problem
    from clipkit.data.shard_sets import expand, is_streamed, parse_mixture

    if not isinstance(data, dict):
        return []
    errors, locations = [], []
    if isinstance(data.get("shards"), str) and data["shards"]:
        locations.append(("data.shards", data["shards"]))
    if data.get("mixture") is not None:
        try:
            entries = parse_mixture(data["mixture"])
        except ClipkitError as error:
            return [str(error)]
        locations += [(f"data.mixture[{i}].shards", entry.shards) for i, entry in enumerate(entries)]
    for key, spec in locations:
        if not is_streamed(spec):
            continue
        try:
            urls = expand(spec)
        except ClipkitError as error:
            errors.append(f"{key}: {error}")
            continue
        problems = [problem for problem in map(url_problem, urls) if problem]
        if problems:
            errors.append(f"{key}: {problems[0]}")
    return errors


def _check_train(train: dict) -> list[str]:
    distributed = train.get("distributed") or {}
    if not isinstance(distributed, dict):
        return ["train.distributed: must be a mapping"]
    errors = _check_section(distributed, "train.distributed", DistributedConfig)
    if distributed.get("offload_params", "none") != "none" and distributed.get("zero_stage", 2) != 3:
        errors.append("train.distributed.offload_params: parameter offload needs zero_stage: 3")
    if distributed.get("strategy") == "fsdp2" and train.get("precision") == "fp16":
        errors.append(f"train.precision: {FSDP2_FP16_REFUSAL}")
    return errors + _check_ema(train.get("ema") or {}, distributed)


def _check_ema(ema: Any, distributed: dict) -> list[str]:
    """``train.ema``'s keys, and the strategies whose sharded parameters it cannot average."""
    if not isinstance(ema, dict):
        return ["train.ema: must be a mapping"]
    errors = _check_section(ema, "train.ema", EmaConfig)
    if ema:
        refusal = ema_refusal(distributed.get("strategy", "ddp"), distributed.get("zero_stage", 2))
        if refusal:
            errors.append(f"train.ema: {refusal}")
    return errors


def _check_lora(lora: Any, frozen: Any) -> list[str]:
    """``model.lora``'s keys, its towers, and no adapter on a locked tower."""
    from clipkit.config.settings_schema import TOWER_NAMES

    if not isinstance(lora, dict):
        return ["model.lora: must be a mapping"]
    errors = _check_section(lora, "model.lora", LoraConfig)
    towers = lora.get("towers", TOWER_NAMES)
    if not isinstance(towers, (list, tuple)) or not towers:
        return errors + ["model.lora.towers: must be a non-empty list of image_encoder, text_encoder"]
    for tower in towers:
        if tower not in TOWER_NAMES:
            errors.append(f"model.lora.towers: {tower!r} is not a tower (image_encoder, text_encoder)")
    if lora and isinstance(frozen, (list, tuple)):
        locked = [t for t in towers if t in frozen and "towers" in lora]
        if locked:
            errors.append(
                f"model.lora.towers: {', '.join(locked)} is locked (model.frozen), so its outputs are "
                "cached and an adapter in it would never train; drop it from model.lora.towers"
            )
    return errors


def ema_refusal(strategy: str, zero_stage: int) -> str | None:
    """Why weight EMA cannot run under this strategy (None when it can)."""
    sharded = {"fsdp2": "FSDP2"} if strategy == "fsdp2" else {}
    if strategy == "deepspeed" and zero_stage == 3:
        sharded = {"deepspeed": "ZeRO-3"}
    if not sharded:
        return None
    name = next(iter(sharded.values()))
    return (
        f"weight EMA is not supported with {name}: each process holds only a shard of the weights, "
        "so a whole-model average would gather every parameter after each step (and a sharded one "
        "needs its own checkpoint layout, not implemented); use strategy ddp or deepspeed with "
        "zero_stage 1 or 2"
    )


def _check_distill(recipe: dict, distill: Any, registry: Registry) -> list[str]:
    """``train.distill``: its keys, one teacher source, each listed loss bound to its factory, and
    the settings it cannot run with (each refusal says why)."""
    if not isinstance(distill, dict):
        return ["train.distill: must be a mapping (teacher, stored, losses)"]
    errors = _check_section(distill, "train.distill", DistillConfig)
    teacher, stored = distill.get("teacher"), distill.get("stored", False)
    if stored is True and teacher:
        errors.append(
            "train.distill.teacher: stored: true reads the teacher's embeddings from the shards; "
            "drop teacher (or set stored: false to run it)"
        )
    elif stored is not True and not (isinstance(teacher, str) and teacher):
        errors.append(
            "train.distill: name the teacher (train.distill.teacher=MODEL_DIR, run in the same "
            "step) or read stored embeddings (train.distill.stored=true, shards from "
            "`clipkit shard --teacher`)"
        )
    losses = distill.get("losses", DistillConfig().losses)
    if not isinstance(losses, list) or not losses:
        return errors + ["train.distill.losses: must be a non-empty list of {name, weight, ...}"]
    for i, entry in enumerate(losses):
        path = f"train.distill.losses.{i}"
        if isinstance(entry, dict) and "weight" in entry:
            weight = entry["weight"]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                errors.append(f"{path}.weight: must be a number >= 0, got {weight!r}")
            entry = {k: v for k, v in entry.items() if k != "weight"}
        errors += check_slot(entry, path, "distill_loss", frozenset(), registry)
    return errors + [f"train.distill: {why}" for why in distill_refusals(recipe, bool(stored is True))]


def distill_refusals(recipe: dict, stored: bool) -> list[str]:
    """Why distillation cannot run with the recipe's other settings (empty when it can)."""
    model, data, train = (
        recipe.get(k) if isinstance(recipe.get(k), dict) else {} for k in ("model", "data", "train")
    )
    distributed = train.get("distributed") if isinstance(train.get("distributed"), dict) else {}
    refusals = []
    if model.get("pair", "image_text") != "image_text":
        refusals.append(
            "needs an image-text model (model.pair: image_text); the teacher compares images with captions"
        )
    if train.get("micro_batch_size", 0):
        refusals.append(
            "not combined with train.micro_batch_size: exact accumulation scores cached "
            "features in a second pass the teacher's terms are not part of; use a batch "
            "that fits, or more processes"
        )
    if train.get("tiled") is True:
        refusals.append("needs the full logits (the KL compares whole rows); set train.tiled=false")
    sharded = distributed.get("strategy") == "fsdp2" or (
        distributed.get("strategy") == "deepspeed" and distributed.get("zero_stage", 2) == 3
    )
    if sharded and not stored:
        refusals.append(
            "a live teacher is not supported with ZeRO-3 or FSDP2: the teacher is held whole "
            "and unsharded on every process, which defeats sharding the student; store its "
            "embeddings (`clipkit shard --teacher`, train.distill.stored=true), or use "
            "ZeRO-1/2 or DDP"
        )
    if stored and data.get("augment") == "batched":
        refusals.append(
            "stored embeddings need data.augment: sample (the loader replays each stored "
            "view's crop from its seed; batched crops are drawn on the device per step)"
        )
    if stored and data.get("stream") is not None:
        refusals.append("stored embeddings are read from shards, not from a registered data.stream")
    return refusals


def distill_config(recipe: dict) -> DistillConfig | None:
    """The typed ``train.distill`` section, or None when the recipe distils nothing."""
    distill = section(recipe, "train").distill or {}
    return DistillConfig(**distill) if distill else None


def ema_config(recipe: dict) -> EmaConfig | None:
    """The typed ``train.ema`` section, or None when the recipe asks for no weight EMA."""
    ema = section(recipe, "train").ema or {}
    return EmaConfig(**ema) if ema else None


def distributed_config(recipe: dict) -> DistributedConfig:
    """The typed ``train.distributed`` section (defaults filled in)."""
    return DistributedConfig(**(section(recipe, "train").distributed or {}))


def _check_augment(data: dict) -> list[str]:
    mode = data.get("augment", "sample")
    if mode == "batched" and (data.get("color_jitter") or data.get("grayscale")):
        return [
            "data.augment: batched augmentation does crop, flip and normalise only; "
            "color_jitter/grayscale need augment: sample"
        ]
    return []


def _check_micro_batch(data: Any, train: Any) -> list[str]:
    """``train.micro_batch_size`` must divide ``data.batch_size``: each process's share divides the
    batch, so a micro-batch that does not divide the batch divides no share (the launch's process
    count, which the runtime checks, is not known here)."""
    batch = data.get("batch_size") if isinstance(data, dict) else None
    micro = train.get("micro_batch_size") if isinstance(train, dict) else None
    numbers = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (batch, micro))
    if not numbers or batch % micro == 0:
        return []
    return [
        f"train.micro_batch_size: {micro} does not divide data.batch_size {batch} (micro-batches split "
        "each process's share of the batch); pick a divisor"
    ]


def _check_machine(data: Any, train: Any) -> list[str]:
    from clipkit.config.machine import check, peak_problem

    problems = []
    if isinstance(data, dict):
        workers = data.get("num_workers", "auto")
        # A negative count is the schema's range error (settings_schema: NON_NEGATIVE) already.
        if not (isinstance(workers, int) and not isinstance(workers, bool) and workers < 0):
            problems.append(check(workers, "data.num_workers", 0))
        holdout = data.get("holdout", 0.0)
        if isinstance(holdout, (int, float)) and not 0 <= holdout < 1:
            problems.append(f"data.holdout: must be in [0, 1), got {holdout}")
    if isinstance(train, dict):
        problems.append(check(train.get("threads", "auto"), "train.threads", 1))
        problems.append(peak_problem(train.get("peak_tflops", "auto")))
    return [problem for problem in problems if problem]


def _check_background(data: dict) -> list[str]:
    from clipkit.data.image_modes import parse_background

    try:
        parse_background(data.get("background", "white"), "data.background")
    except ClipkitError as error:
        return [str(error)]
    return []


def _unknown_key(path: str, key: str, known, context: str = "") -> str:
    matches = close_matches(key, known)
    hint = f"; did you mean {', '.join(matches)}?" if matches else ""
    context = f" {context}" if context else ""
    return f"{path}: unknown key{context}{hint} (known: {', '.join(sorted(known))})"


def section(recipe: dict, name: str):
    """A typed view of ``data``/``model``/``train`` with defaults filled in (after validation)."""
    schema = SECTIONS[name]
    return schema(**(recipe.get(name) or {}))
