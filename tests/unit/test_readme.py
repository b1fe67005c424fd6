"""The README's reference tables against the code, so they cannot drift from it: the CLI table lists every
subcommand, the configuration table every option of every group, the layout every module of `empo2/`, the
paper → code table only names the code defines, its `make demo` command is the Makefile's; and every relative link
in README.md, docs/ and reports/ points at a file that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from empo2.config import GROUPS, group_options
from tests.unit.test_docs_commands import PAGES, ROOT, fenced_blocks


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no section {title!r}"
    return m.group(1)


def table_rows(section: str) -> list[list[str]]:
    rows = [re.split(r"(?<!\\)\|", line.strip().strip("|")) for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    return [[c.strip() for c in row] for row in rows[1:]]


def test_the_cli_table_lists_every_subcommand():
    from empo2.cli import SUBCOMMANDS

    shown = {re.match(r"`empo2 (?:--verbose )?(\w+)", row[0]).group(1) for row in table_rows(readme_section("CLI"))}
    assert set(SUBCOMMANDS) <= shown, f"not in README's CLI table: {sorted(set(SUBCOMMANDS) - shown)}"


def test_the_configuration_table_lists_every_option_of_every_group():
    rows = {row[0].strip("`"): set(re.findall(r"`([^`]+)`", row[1]))
            for row in table_rows(readme_section("Configuration"))}
    assert set(rows) == set(GROUPS)
    for group in GROUPS:
        assert rows[group] == set(group_options(group)), f"README's {group} options differ from conf/{group}/"


def test_the_layout_names_every_module():
    tree = next(body for lang, _, body in fenced_blocks(ROOT / "README.md") if body.startswith("empo2/"))
    names = set(re.findall(r"[\w]+\.py|[\w]+/", tree))
    missing = [str(p.relative_to(ROOT / "empo2")) for p in sorted((ROOT / "empo2").rglob("*.py"))
               if p.name != "__init__.py" and not ({p.name} <= names and {f"{d}/" for d in p.relative_to(
                   ROOT / "empo2").parts[:-1]} <= names)]
    assert not missing, f"README's layout does not name {missing}"


def test_make_demo_runs_the_command_the_readme_describes():
    recipe = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    command = " ".join(recipe.replace("$(VENV)/bin/", "").split())
    assert command in " ".join(readme_section("Two commands").split())


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in [*PAGES, *sorted((ROOT / "reports").glob("*/README.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:|^#", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken



def module_file(parts: list[str]) -> Path | None:
    base = ROOT / Path(*parts)
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def test_the_paper_to_code_table_names_code_that_exists():
    missing = []
    for row in table_rows(readme_section("Paper component → code")):
        for ref in re.findall(r"`((?:empo2|core_algos)\.[\w.]+)", row[1]):
            parts = ("empo2.algo." + ref if ref.startswith("core_algos") else ref).split(".")
            k = max(i for i in range(1, len(parts) + 1) if module_file(parts[:i]))
            tree = ast.parse(module_file(parts[:k]).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            defined |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            if not set(parts[k:]) <= defined:
                missing.append(ref)
    assert not missing, f"README's paper → code table names what the code does not define: {missing}"
