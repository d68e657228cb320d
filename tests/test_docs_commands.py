"""Docs a new user copies literally: what tests/test_docs_drift.py's name checks cannot see.

test_docs_drift.py checks that every path, command, option and recipe key the docs name exists.
These check what a copied command or snippet then does (each found wrong by running the docs as
written, in a fresh folder):

- the plugin example's ``pyproject.toml`` depends on this project's distribution — PyPI's
  ``clipkit`` is an unrelated tool that pip would install over this one;
- every ``idx:`` file the docs name without ``?labels=`` is named so the source finds its labels;
- every ``$VARIABLE`` a shell block reads is set in that block (a loop or an assignment), so no
  command runs with a placeholder (``seed=S``) or an empty value;
- every ``clipkit`` import the docs show imports without a DeprecationWarning (no moved path);
- README's recipe table lists every variant ``clipkit recipes`` lists;
- the PMI-fidelity table in docs/evaluation.md has the columns the command writes.
- docs/recipes.md's schema shows every host setting (it lacked `train.tiled`, `data.holdout_by`, ...).
"""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The user-facing docs audited by running them (benchmarks.md and reproductions.md record
#: measurements and are not meant to be re-run as they stand).
DOCS = [
    ROOT / "README.md",
    *(ROOT / "docs" / f"{name}.md" for name in ("recipes", "data", "evaluation", "interop", "distillation")),
    *(ROOT / "docs" / f"{name}.md" for name in ("python", "plugins", "own-data")),
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)

#: Variables a shell block may read without setting them, with where they are set.
SET_ELSEWHERE = {
    "R": "docs/distillation.md sets R=docs/distill-fashion-mnist.yaml in the prose above",
    "HOME": "the shell",
}


def blocks(path: Path, languages: tuple[str, ...]) -> list[tuple[int, str]]:
    """(first line number, text) of each fenced block in one of ``languages``."""
    text = path.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, match.start()) + 2, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1) in languages
    ]


def toml_value(text: str, table: str, key: str) -> str:
    """The raw value of ``key`` in ``[table]`` of a small TOML text (no tomllib on Python 3.10)."""
    body = re.search(rf"^\[{re.escape(table)}\]\n(.*?)(?=^\[|\Z)", text, flags=re.S | re.M)
    assert body, f"no [{table}]"
    value = re.search(rf"^{key}\s*=\s*(.*?)\s*$", body.group(1), flags=re.M)
    assert value, f"no {key} in [{table}]"
    return value.group(1)


def project_name() -> str:
    return toml_value((ROOT / "pyproject.toml").read_text(encoding="utf-8"), "project", "name").strip('"')


def test_the_plugin_example_depends_on_this_distribution():
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"<!-- example: pyproject.toml -->\n```\w*\n(.*?)```", text, flags=re.S)
    dependencies = re.findall(r'"([^"]*)"', toml_value(example, "project", "dependencies").split("#")[0])
    names = {re.split(r"[\s<>=!~;\[]", dependency, maxsplit=1)[0].lower() for dependency in dependencies}
    assert project_name() in names, f"the example depends on {sorted(names)}, not {project_name()}"
    assert "clipkit" not in names, "PyPI's `clipkit` is another tool; pip would install it over this one"


def test_every_idx_file_the_docs_name_finds_its_labels():
    missing = []
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for uri in re.findall(r"idx:([^\s\"'`)\]]+)", line):
                if "labels=" not in uri and "-images-idx3-ubyte" not in uri and uri != "PATH":
                    missing.append(f"{path.name}:{number}: idx:{uri}")
    assert not missing, "idx files named so the labels file cannot be found: " + "; ".join(missing)


def shell_reads_unset_variables(block: str) -> set[str]:
    """The ``$NAME``s a shell block reads that it neither assigns nor loops over."""
    code = "\n".join(line.split(" #")[0] for line in block.splitlines() if not line.lstrip().startswith("#"))
    code = re.sub(r"'[^']*'", "''", code)  # single quotes: no expansion (python -c '...')
    read = set(re.findall(r"\$\{?([A-Za-z_]\w*)", code))
    # an assignment starts a command (a `key=value` later on a command line is an argument)
    assigned = set(re.findall(r"(?:^|[;&|(]\s*|\b(?:do|then)\s+)([A-Za-z_]\w*)=", code, flags=re.M))
    for exported in re.findall(r"^\s*export\s+(.*)$", code, flags=re.M):
        assigned |= set(re.findall(r"([A-Za-z_]\w*)=", exported))
    assigned |= set(re.findall(r"\bfor\s+([A-Za-z_]\w*)\s+in\b", code))
    return read - assigned - set(SET_ELSEWHERE)


def test_shell_blocks_set_every_variable_they_read():
    unset = [
        f"{path.name}:{line}: ${name}"
        for path in DOCS
        for line, block in blocks(path, ("bash", "sh", "shell"))
        for name in sorted(shell_reads_unset_variables(block))
    ]
    assert not unset, "shell blocks read variables they never set: " + "; ".join(unset)


def test_shell_blocks_put_a_tilde_only_where_the_shell_expands_it():
    """`--data wds:~/cb` reaches clipkit as a literal `~` (the shell expands one only at a word's
    start), and the sources do not expand it."""
    literal = [
        f"{path.name}:{line}"
        for path in DOCS
        for line, block in blocks(path, ("bash", "sh", "shell"))
        if re.search(r"[^\s=\"']~/", block)
    ]
    assert not literal, "a ~ the shell leaves as it is: " + "; ".join(literal)


def test_the_variable_check_catches_a_placeholder():
    assert shell_reads_unset_variables("clipkit train quickstart seed=$seed") == {"seed"}
    assert shell_reads_unset_variables("for seed in 0 1; do clipkit train clip seed=$seed; done") == set()
    assert shell_reads_unset_variables("S=3\nclipkit train quickstart seed=$S  # $NOT_READ") == set()


def clipkit_imports() -> list[str]:
    """Every ``import clipkit...`` / ``from clipkit... import ...`` statement in the docs' Python
    blocks and inline code."""
    statements = []
    statement = r"(?:from clipkit(?:\.\w+)* import [\w, ]+)|(?:import clipkit(?:\.\w+)*)"
    pattern = re.compile(rf"^\s*({statement})\s*(?:#.*)?$")
    for path in DOCS:
        for _, block in blocks(path, ("python",)):
            statements += [m.group(1).strip() for m in map(pattern.match, block.splitlines()) if m]
        statements += re.findall(rf"`({statement})`", path.read_text(encoding="utf-8"))
    return sorted(set(statements))


def test_the_docs_clipkit_imports_are_current_paths():
    statements = [s for s in clipkit_imports() if "clipkit_i2t_loss" not in s]  # the example plugin
    assert "from clipkit.app import api" in statements
    code = "\n".join(statements)
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"{code}\n{result.stderr[-2000:]}"


def readme_recipe_variants() -> dict[str, set[str]]:
    table = {}
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\| `(\w+)` \|.*\| (.*) \|$", line)
        if match:
            variants = re.sub(r"\([^)]*\)", "", match.group(2))  # "(seconds)", "(first m image tokens ...)"
            table[match.group(1)] = set(re.findall(r"`(\w+)`", variants))
    return table


def test_the_readme_recipe_table_lists_every_variant():
    from clipkit.config.recipe import variants_of
    from clipkit.contract.registry import default_registry

    registry = default_registry()
    documented = readme_recipe_variants()
    assert set(documented) == set(registry.names("recipe"))
    for name, variants in documented.items():
        assert variants == set(variants_of(name, registry)), name


def test_the_pmi_table_in_the_docs_has_the_reports_columns():
    from clipkit.plugins.experiments.pmi_report import markdown_table

    report = {
        "config": {"embed_dim": 4, "steps": 300, "batch_size": 128, "seed": 0},
        "distribution": {"num_latent": 8},
        "results": [],
        "reference": {"infonce_true_pmi": 0, "infonce_log_batch": 0, "pmi_std": 0, "mutual_information": 0},
    }
    header = next(line for line in markdown_table(report).splitlines() if line.startswith("| rank |"))
    assert header in (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_the_audited_docs_exist(path):
    assert path.is_file()


def host_settings() -> set[str]:
    """Dotted names of every host setting (the section dataclasses, nested ones included)."""
    import dataclasses

    from clipkit.config.recipe import SECTIONS

    def names(cls, prefix: str) -> set[str]:
        found = set()
        hints = typing.get_type_hints(cls, include_extras=True)
        for field in dataclasses.fields(cls):
            found.add(prefix + field.name)
            hint = hints[field.name]
            base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
            if dataclasses.is_dataclass(base):
                found |= names(base, f"{prefix}{field.name}.")
        return found

    return set().union(*(names(cls, f"{section}.") for section, cls in SECTIONS.items()))


def test_the_recipe_schema_in_the_docs_shows_every_host_setting():
    import yaml

    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    schema = yaml.safe_load(re.search(r"## Schema\n\n```yaml\n(.*?)```", text, flags=re.S).group(1))

    def keys(mapping: dict, prefix: str) -> set[str]:
        found = set()
        for key, value in mapping.items():
            found.add(prefix + key)
            if isinstance(value, dict) and value:
                found |= keys(value, f"{prefix}{key}.")
        return found

    shown = set().union(*(keys(schema[section], f"{section}.") for section in ("data", "model", "train")))
    assert not host_settings() - shown, f"settings the schema leaves out: {sorted(host_settings() - shown)}"


def runs_without_their_command(path: Path) -> list[str]:
    """``runs/NAME`` a Python block of ``path`` loads by a literal ``"runs/NAME/export"`` path
    that no command of the same doc trains with ``--run-dir runs/NAME`` (without it a run goes to
    ``runs/<recipe>-<time>``, so the copied snippet finds nothing there)."""
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(r'"runs/([\w.-]+)/export"')
    loaded = {name for _, block in blocks(path, ("python",)) for name in pattern.findall(block)}
    return sorted(name for name in loaded if f"--run-dir runs/{name}" not in text)


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_a_run_a_python_snippet_loads_is_one_the_doc_trains(path):
    assert not runs_without_their_command(path), "add --run-dir runs/NAME to the command that trains it"


def test_the_run_check_catches_a_run_no_command_makes(tmp_path):
    doc = tmp_path / "doc.md"
    snippet = '```python\nclipkit.load("runs/clip-tiny/export")\n```\n'
    doc.write_text("```bash\nclipkit train clip@tiny\n```\n" + snippet, encoding="utf-8")
    assert runs_without_their_command(doc) == ["clip-tiny"]
    trained = "```bash\nclipkit train clip@tiny --run-dir runs/clip-tiny\n```\n"
    doc.write_text(trained + snippet, encoding="utf-8")
    assert runs_without_their_command(doc) == []
