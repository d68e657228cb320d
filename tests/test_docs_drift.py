"""Docs that cannot drift: every repository path, ``clipkit`` command and option, and recipe key
named in README.md and docs/*.md exists.

What is checked (everything else in the docs is prose):

- **paths**: backticked tokens that start with a top-level folder of this repository
  (``clipkit/``, ``plugins/``, ``recipes/``, ``tests/``, ...) must exist (globs may match);
- **commands**: ``clipkit ...`` in code blocks and backticks: each sub-command and each
  ``--option`` must be one the Typer app (:func:`clipkit.app.cli.make_app`, plugins' commands
  included) accepts at that place, and ``key=value`` overrides must name recipe keys;
- **options**: a backticked ``--option`` on its own must be accepted by some ``clipkit`` command,
  by a script in the repository (benchmarks/, tools/, .ci/) or be one of :data:`OTHER_TOOLS`;
- **recipe keys**: backticked dotted names under a recipe section (``data.num_workers``,
  ``train.distributed.local_loss``, ``loss.temperature``) must be a field of the host settings
  (:data:`clipkit.config.recipe.SECTIONS`) or an argument some registered plugin of that slot accepts.

Each failure names the file, the line and the missing thing.
"""

from __future__ import annotations

import glob
import inspect
import re
import typing
from dataclasses import fields
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_FOLDERS = ("clipkit", "plugins", "recipes", "tests", "docs", "benchmarks", "tools", ".ci")
SECTIONS_RE = r"(?:data|model|train|similarity|loss|optimizer|schedule|eval)"
KEY_RE = re.compile(rf"^({SECTIONS_RE}(?:\.[A-Za-z_]\w*)+)(?:=.*)?$")
FILE_SUFFIXES = {"json", "jsonl", "md", "png", "safetensors", "bin", "pt", "yaml", "txt", "py", "log"}

#: Dotted names in the docs that are not recipe keys: attributes of the object
#: ``clipkit.load`` returns (docs/python.md) and of a similarity (docs/evaluation.md).
NOT_RECIPE_KEYS = {
    "model.encode_image",
    "model.encode_text",
    "model.model",
    "model.metadata",
    "similarity.embed",
}

#: Options of other tools the docs show beside clipkit's: accelerate launch, pip.
OTHER_TOOLS = {"--multi_gpu", "--num_processes", "--use_deepspeed", "--zero_stage", "--cpu", "--no-deps"}

#: Recipe keys the docs name on purpose although no recipe accepts them: the misspelt key of
#: docs/recipes.md's `clipkit validate` example, and the argument of docs/plugins.md's example
#: third-party loss (`i2t_infonce`, not installed here).
EXAMPLE_KEYS = {"train.stpes", "loss.weight"}


# ----------------------------------------------------------------------------- reading the docs


def _spans(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(backticked spans outside code blocks, logical lines inside code blocks), each with its line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    prose: list[str] = []
    code: list[tuple[int, str]] = []
    in_code, pending, pending_line = False, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            prose.append("")
            continue
        if in_code:
            prose.append("")
            text = line.split(" #")[0] if not line.lstrip().startswith("#") else ""
            if not pending:
                pending_line = number
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            code.append((pending_line, pending + text))
            pending = ""
        else:
            prose.append(line)
    text = "\n".join(prose)
    spans = []
    for match in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", text):
        spans.append((text.count("\n", 0, match.start()) + 1, match.group(1).replace("\n", " ")))
    return spans, code


def _mentions():
    for path in DOCS:
        spans, code = _spans(path)
        yield path, spans, code


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# ----------------------------------------------------------------------------- what exists


@cache
def _cli():
    """The ``clipkit`` command as Typer builds it (Typer may bundle its own click: duck-typed here)."""
    import typer

    from clipkit.app.cli import make_app

    return typer.main.get_command(make_app())


def _options(command) -> dict[str, int]:
    """Every option of ``command`` -> how many values follow it (0: a flag)."""
    names = {"--help": 0}
    for param in command.params:
        if param.param_type_name != "option":
            continue
        takes = 0 if param.is_flag or param.count else param.nargs
        names |= dict.fromkeys(param.opts, takes) | dict.fromkeys(param.secondary_opts, 0)
    return names


@cache
def _all_clipkit_options() -> frozenset[str]:
    found: set[str] = set()

    def walk(command) -> None:
        found.update(_options(command))
        if hasattr(command, "commands"):
            for sub in command.commands.values():
                walk(sub)

    walk(_cli())
    return frozenset(found)


@cache
def _script_options() -> frozenset[str]:
    """``--options`` the repository's own scripts declare (benchmarks, tools, CI)."""
    found: set[str] = set()
    for folder in ("benchmarks", "tools", ".ci"):
        for file in (ROOT / folder).rglob("*"):
            if file.is_file() and file.suffix in {".py", ".sh", ""}:
                found.update(re.findall(r"""["'\s](--[a-z][\w-]*)""", file.read_text(errors="replace")))
    return frozenset(found)


@cache
def _registry():
    from clipkit.contract.registry import default_registry

    return default_registry()


def _plugin_accepts(kind: str, argument: str) -> bool:
    """Some registered plugin of ``kind`` takes ``argument`` (or any keyword)."""
    for entry in _registry().entries(kind):
        parameters = inspect.signature(entry.factory).parameters
        if argument in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            return True
    return False


def recipe_key_problem(key: str) -> str | None:
    """Why ``key`` (``data.num_workers``) is not a recipe key; None when it is one."""
    from clipkit.config.recipe import SECTIONS, SLOTS, DistributedConfig
    from clipkit.tiled.settings import DEPRECATED_LOSS_KEYS as TILING_KEYS

    slots = {slot.path: slot.kind for slot in SLOTS} | {"eval": "eval"}
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):  # the longest slot the key lies in
        slot = ".".join(parts[:depth])
        if slot in slots:
            rest = parts[depth:]
            if not rest or rest == ["name"]:
                return None
            if slot == "eval" and rest[0].isdigit():
                rest = rest[1:]
            if slot == "loss" and rest[0] in TILING_KEYS:  # deprecated spelling of train.tiled
                return None
            if len(rest) == 1 and _plugin_accepts(slots[slot], rest[0]):
                return None
            return f"no {slots[slot]} plugin takes `{'.'.join(rest)}`"
    section, *rest = parts
    schema = SECTIONS.get(section)
    if schema is None:
        return f"`{section}` is not a host section"
    known = {f.name: f for f in fields(schema)}
    if rest[0] not in known:
        return f"`{rest[0]}` is not a setting of `{section}:` ({schema.__name__})"
    if rest[:1] == ["distributed"] and len(rest) > 1:
        if rest[1] not in {f.name for f in fields(DistributedConfig)} or len(rest) > 2:
            return f"`{'.'.join(rest[1:])}` is not a setting of `train.distributed:`"
        return None
    if len(rest) > 1:  # a mapping's own keys (data.meta_keys.NAME, model.init.path): free-form
        hint = typing.get_type_hints(schema)[rest[0]]
        if hint not in (dict, typing.Any) and typing.get_origin(hint) is not dict:
            return f"`{section}.{rest[0]}` is not a mapping"
    return None


# ----------------------------------------------------------------------------- the checks


def _path_problems(where: str, span: str) -> list[str]:
    token = span.split()[0] if span.split() else ""
    if not token.startswith(tuple(f"{top}/" for top in TOP_FOLDERS)) or "<" in token:
        return []
    if "*" in token or "?" in token:
        return [] if glob.glob(str(ROOT / token)) else [f"{where}: no path matches `{token}`"]
    return [] if (ROOT / token).exists() else [f"{where}: path `{token}` does not exist"]


def _command_problems(where: str, text: str) -> list[str]:
    """Every ``clipkit ...`` command in ``text``: sub-commands, options and override keys."""
    problems = []
    for match in re.finditer(r"(?<![\w./-])(?<!from )(?<!import )clipkit (?=[-a-z])", text):
        rest = re.split(r"\s(?:#|\||&&|;)|[\"'`)]", text[match.end() :])[0]
        command = _cli()
        name = "clipkit"
        values = 0  # tokens still to skip: the values of the last option
        for token in rest.split():
            if values:
                values -= 1
                continue
            if token in ("...", "…") or token.startswith("<"):
                continue
            if token.startswith("-"):
                for option in token.split("=")[0].split("/"):  # `--task/--tasks`: both spellings
                    if option.startswith("--") or re.fullmatch(r"-[A-Za-z]", option):
                        if option not in _options(command):
                            problems.append(f"{where}: `{name}` has no option `{option}`")
                        elif "=" not in token:
                            values = _options(command)[option]
                continue
            key = KEY_RE.match(token)
            if key and "=" in token and name != "clipkit":
                if key.group(1) in EXAMPLE_KEYS:
                    continue
                problem = recipe_key_problem(key.group(1))
                if problem:
                    problems.append(f"{where}: recipe key `{key.group(1)}` in `{name}`: {problem}")
                continue
            if hasattr(command, "commands"):  # a group: the token names a sub-command
                if not re.fullmatch(r"[a-z][\w-]*", token):
                    break  # a placeholder (COMMAND): nothing more to check
                sub = command.commands.get(token)
                if sub is None:
                    problems.append(f"{where}: `{name}` has no command `{token}`")
                    break
                command, name = sub, f"{name} {token}"
    return problems


def _option_problems(where: str, span: str) -> list[str]:
    token = span.split()[0].split("=")[0] if span.split() else ""
    if not re.fullmatch(r"--[a-z][\w-]*", token):
        return []
    if token in _all_clipkit_options() | _script_options() | OTHER_TOOLS:
        return []
    return [f"{where}: no clipkit command or repository script takes `{token}`"]


def _key_problems(where: str, span: str) -> list[str]:
    if span.startswith("clipkit ") or "(" in span:
        return []
    problems = []
    for token in span.split():
        match = KEY_RE.match(token.rstrip(":,;."))
        if not match:
            continue
        key = match.group(1)
        if key in NOT_RECIPE_KEYS | EXAMPLE_KEYS or key.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            continue
        problem = recipe_key_problem(key)
        if problem:
            problems.append(f"{where}: recipe key `{key}`: {problem}")
    return problems


def _all_problems() -> list[str]:
    problems = []
    for path, spans, code in _mentions():
        for line, span in spans:
            where = _where(path, line)
            problems += _path_problems(where, span)
            problems += _command_problems(where, span)
            problems += _option_problems(where, span)
            problems += _key_problems(where, span)
        for line, text in code:
            problems += _command_problems(_where(path, line), text)
    return problems


def test_every_path_command_option_and_recipe_key_the_docs_name_exists():
    problems = _all_problems()
    assert not problems, "the docs name what does not exist:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(
    "key", ["data.num_workers", "train.memory_check", "model.tokenizer", "train.distributed.local_loss"]
)
def test_host_settings_are_recipe_keys(key):
    assert recipe_key_problem(key) is None


@pytest.mark.parametrize("key", ["loss.temperature", "optimizer.lr", "loss.name", "data.meta_keys.age"])
def test_plugin_arguments_and_mappings_are_recipe_keys(key):
    assert recipe_key_problem(key) is None


@pytest.mark.parametrize(
    "key", ["data.num_worker", "train.distributed.stage", "loss.no_such_argument", "model.steps.x"]
)
def test_misspelt_keys_are_caught(key):
    assert recipe_key_problem(key)


def test_the_checker_catches_a_missing_path_command_option_and_key(tmp_path):
    where = "doc.md:1"
    assert _path_problems(where, "clipkit/train/runtime.py") == [
        "doc.md:1: path `clipkit/train/runtime.py` does not exist"
    ]
    assert _path_problems(where, "clipkit/train/runtime/__init__.py") == []
    assert _command_problems(where, "clipkit train clip --resume --run-dir RUN") == []
    assert _command_problems(where, "clipkit --install-completion") == []
    assert _command_problems(where, "clipkit --log-level info train clip --task/--tasks") == [
        "doc.md:1: `clipkit train` has no option `--task`",
        "doc.md:1: `clipkit train` has no option `--tasks`",
    ]
    assert _command_problems(where, "clipkit trian clip") == ["doc.md:1: `clipkit` has no command `trian`"]
    assert _command_problems(where, "clipkit eval RUN/export --tsk retrieval") == [
        "doc.md:1: `clipkit eval` has no option `--tsk`"
    ]
    assert _command_problems(where, "clipkit train clip data.num_worker=2") == [
        "doc.md:1: recipe key `data.num_worker` in `clipkit train`: "
        "`num_worker` is not a setting of `data:` (DataConfig)"
    ]
    assert _option_problems(where, "--overwrite") == []
    assert _option_problems(where, "--overwrit") == [
        "doc.md:1: no clipkit command or repository script takes `--overwrit`"
    ]


# ----------------------------------------------------------------------------- METHODS citations
# Code, recipes and docs cite the methods page as "METHODS §N" (or "METHODS.md §N", lists such as
# "METHODS §2, §3, §11" or "§7 and §11", ranges "§1–3", subsections "§11.1"); docs/methods.md keeps
# the numbering, and every cited section must be one of its headings.

METHODS_DOC = ROOT / "docs" / "methods.md"
CITING = ("clipkit", "plugins", "recipes", "docs", "benchmarks", "tests", "tools", "README.md")
CITING_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt"}
_SECTION = r"\d+(?:\.\d+)?(?:\s*[–-]\s*\d+)?"
CITATION_RE = re.compile(rf"METHODS(?:\.md)?\s+§\s*({_SECTION}(?:\s*(?:,|and|&)\s*§\s*{_SECTION})*)")
HEADING_RE = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def methods_sections(doc: Path) -> set[str]:
    """The section numbers of the methods page's headings ("## 11. ..." -> "11", "### 11.1 ..." -> "11.1")."""
    return set(HEADING_RE.findall(doc.read_text(encoding="utf-8")))


def cited_sections(text: str) -> list[tuple[int, str]]:
    """(line, section) for every METHODS section ``text`` cites; a range §a–b cites a … b."""
    cited = []
    for match in CITATION_RE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        for first, last in re.findall(r"(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+))?", match.group(1)):
            if last and "." not in first:
                cited += [(line, str(n)) for n in range(int(first), int(last) + 1)]
            else:
                cited.append((line, first))
    return cited


def citing_files(root: Path) -> list[Path]:
    files = []
    for name in CITING:
        top = root / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        files += [path for path in candidates if path.is_file() and path.suffix in CITING_SUFFIXES]
    return files


def dangling_citations(root: Path, doc: Path) -> list[str]:
    """'file:line: METHODS §N' for every citation under ``root`` that no heading of ``doc`` resolves."""
    sections = methods_sections(doc)
    problems = []
    for path in citing_files(root):
        for line, section in cited_sections(path.read_text(encoding="utf-8", errors="replace")):
            if section not in sections:
                where = f"{path.relative_to(root)}:{line}"
                problems.append(f"{where}: METHODS §{section} has no section in {doc.name}")
    return problems


def test_every_methods_citation_resolves_to_a_section_of_docs_methods():
    assert METHODS_DOC.is_file(), "docs/methods.md is missing: every METHODS §N citation points into it"
    # Guard: the scan reads the repository (an empty scan would pass).
    assert sum(len(cited_sections(p.read_text(encoding="utf-8"))) for p in citing_files(ROOT)) > 100
    problems = dangling_citations(ROOT, METHODS_DOC)
    assert not problems, "METHODS citations without a section:\n" + "\n".join(problems)


def test_methods_doc_covers_every_built_in_loss_and_similarity():
    text = METHODS_DOC.read_text(encoding="utf-8")
    missing = [
        f"{kind} `{entry.name}`"
        for kind in ("loss", "similarity")
        for entry in _registry().entries(kind)
        if entry.factory.__module__.startswith("clipkit.plugins.") and f"`{entry.name}`" not in text
    ]
    assert not missing, "docs/methods.md does not describe: " + ", ".join(missing)


def test_the_citation_resolver_catches_a_dangling_citation(tmp_path):
    cite = "METHODS"  # split from "§" so that this file cites nothing itself
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "methods.md"
    doc.write_text("# Methods\n\n## 1. CLIP\n\n## 2. WPSE\n\n### 2.1 Kernels\n\n## 3. KME\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "loss.py").write_text(
        f'"""A loss ({cite}.md §2, §3 and §2.1).\n\nSee {cite} §1–3; and {cite} §4.\n"""\n'
        f"# {cite} §2.2, then {cite}.md §9 and §1\n",
        encoding="utf-8",
    )
    (tmp_path / "README.md").write_text(f"| recipe | paper ({cite} §) |\nseed 004 §2.3: a paper's section\n")
    assert methods_sections(doc) == {"1", "2", "2.1", "3"}
    expected = [(1, "1"), (1, "2"), (1, "3"), (1, "2.1"), (1, "11")]
    assert cited_sections(f"{cite} §1–3, §2.1 and §11") == expected
    assert dangling_citations(tmp_path, doc) == [
        f"plugins/loss.py:3: {cite} §4 has no section in methods.md",
        f"plugins/loss.py:5: {cite} §2.2 has no section in methods.md",
        f"plugins/loss.py:5: {cite} §9 has no section in methods.md",
    ]


# ----------------------------------------------------------------------------- the layout tree


def layout_block(text: str) -> str:
    """README's "## Layout" code block."""
    section = text.split("\n## Layout", 1)[1]
    return section.split("```", 2)[1]


def layout_problems(block: str, package: Path) -> list[str]:
    """What the layout tree leaves out: each sub-package of ``package`` (as ``name/``) and each
    module at its root (as its name, ``name.py`` or ``name/``)."""
    problems = []
    for child in sorted(package.iterdir()):
        if child.name.startswith(("_", ".")):
            continue
        if child.is_dir() and (child / "__init__.py").exists() and f"{child.name}/" not in block:
            problems.append(f"README Layout: the room {package.name}/{child.name}/ is missing")
        if child.suffix == ".py" and not re.search(rf"\b{re.escape(child.stem)}\b", block):
            problems.append(f"README Layout: the module {package.name}/{child.name} is missing")
    return problems


def test_the_readme_layout_tree_names_every_room_and_root_module():
    block = layout_block((ROOT / "README.md").read_text(encoding="utf-8"))
    problems = layout_problems(block, ROOT / "clipkit")
    for room in ("train", "data", "eval", "tiled", "app", "artifacts", "config", "contract", "model"):
        if (ROOT / "clipkit" / room).is_dir():
            problems += layout_problems(block, ROOT / "clipkit" / room)
    assert not problems, "\n".join(problems)


def test_the_layout_check_can_fail(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "room").mkdir()
    (tmp_path / "pkg" / "room" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "lonely.py").write_text("")
    assert len(layout_problems("pkg/ nothing here", tmp_path / "pkg")) == 2
    assert layout_problems("room/ lonely", tmp_path / "pkg") == []
