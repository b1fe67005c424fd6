"""Every command README.md, docs/*.md and reports/README.md show is checked here, so none can rot unnoticed.

What a page shows, and how it is checked:

- fenced blocks must say what they hold: `bash` (commands, each checked), `console` (`$ command` lines, each
  followed by the output it must give), `text` (diagrams and trees, not run);
- `empo2 ...` (also under `srun`, or `python -m empo2.cli` under `torchrun`): parsed by the real argument parser,
  then `train` overrides composed and validated with `load_config` (what `empo2 train ... --cfg` does), `eval` /
  `adapt` options split and the rest composed, grid files planned with `plan_grid`, sweep files read with
  `load_sweep` (which composes every end point of the space), `config` sections described;
- `python benchmarks/X.py ...` (or `python -m recipes.R.X`, a recipe's script, or under `torchrun`): the script
  exists, builds an argparse parser, and defines every `--option` used (read from its source, nothing imported or
  run); `python -m recipes.minisci_priors.prior_rounds ...`: a round parsed and validated by its real parser, a
  shipped prior's rebuild planned and every one of its rounds parsed, a stage-1 build named;
  `python -c CODE`: it parses, and every name it imports from
  `empo2` or `recipes` and every field it passes to `dataclasses.replace` exists;
- `make TARGET`: the target is in the Makefile; `pip install .[EXTRA]`: the extra is in pyproject.toml;
- every repository path a command names exists, except outputs (`--out`, `out=`, `--save`) and what commands
  create (`outputs/`, `benchmarks/results/`, the recipe's `results/`);
- inline `empo2 ...` spans in the prose: a synopsis (`[...]`, `FILE`, `a|b`) or a bare `empo2 SUBCOMMAND` names a
  real subcommand and real options; a complete command is checked as above.

A failure names the page, the line and the command. The README's tables are checked in test_readme.py.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from empo2.config import ConfigError
from recipes.minisci_priors.prior_rounds import STAGE_ONE, parse_round, planned_rounds

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "reports" / "README.md"]
REPO_DIRS = ("empo2", "experiments", "grids", "sweeps", "conf", "benchmarks", "recipes", "reports", "docs", "tests",
             ".ci")
# folders that commands create
GENERATED = ("outputs/", "benchmarks/results/", "recipes/minisci_priors/results/",
             "recipes/minisci_priors/research/results/")
OUTPUT_FLAGS = ("--out", "--save")
PRIOR_ROUNDS = "python -m recipes.minisci_priors.prior_rounds"
OUTPUT_KEYS = ("out",)
EXTERNAL = {"mlflow", "createdb", "pip"}  # third-party programs shown as they are, their arguments not checked
PLACEHOLDER = re.compile(r"\[|\.\.\.|\||\b[A-Z][A-Z_]{1,}\b")


# ------------------------------------------------------------------------------------------------ reading pages
def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line number of the first body line, body) of every fenced block."""
    blocks, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            blocks.append((m.group(1), i + 2, "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return blocks


def prose(path: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```\s*$", "", path.read_text(), flags=re.M | re.S)


def shell_commands(body: str, first_line: int) -> list[tuple[int, str]]:
    """(line, command) of a bash block: continuation lines joined as the shell joins them, comments dropped,
    `a && b` and `a; b` split."""
    out, start, buf = [], first_line, ""
    for n, line in enumerate(body.split("\n"), first_line):
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1]
            continue
        buf += line
        lexer = shlex.shlex(buf, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", ";", "||"):
                if words:
                    out.append((start, shlex.join(words)))
                words = []
            else:
                words.append(token)
        buf = ""
    return out


def console_examples(body: str, first_line: int) -> list[tuple[int, str, str]]:
    """(line, command, expected output) of each `$ command` of a console block."""
    out = []
    for n, line in enumerate(body.split("\n"), first_line):
        if line.startswith("$ "):
            out.append([n, line[2:], ""])
        elif out:
            out[-1][2] += line + "\n"
    return [(n, c, e.strip()) for n, c, e in out]


def commands_of_pages() -> list[tuple[str, str, str]]:
    """(where, kind, text): every command of every page."""
    found = []
    for page in PAGES:
        rel = page.relative_to(ROOT)
        for lang, line, body in fenced_blocks(page):
            if lang in ("bash", "sh"):
                found += [(f"{rel}:{n}", "bash", c) for n, c in shell_commands(body, line)]
            elif lang == "console":
                found += [(f"{rel}:{n}", "console", c + "\n" + e) for n, c, e in console_examples(body, line)]
            elif lang not in ("text", "mermaid"):  # prose and diagrams hold no command
                found.append((f"{rel}:{line - 1}", "unlabelled", body))
        for span in re.findall(r"`(empo2 [^`]+)`", prose(page)):
            found.append((f"{rel} (inline)", "inline", " ".join(span.split())))
    return found


COMMANDS = commands_of_pages()


# ------------------------------------------------------------------------------------------------ checks
class CommandError(Exception):
    pass


def check_paths(argv: list[str]) -> None:
    for i, token in enumerate(argv):
        key, sep, value = token.partition("=")
        if i and argv[i - 1] in OUTPUT_FLAGS or (sep and key in OUTPUT_KEYS):
            continue
        for candidate in ([value] if sep else []) + [token]:
            candidate = candidate.split(",")[0]
            if candidate.startswith(GENERATED) or candidate.split("/")[0] not in REPO_DIRS or "/" not in candidate:
                continue
            if not (ROOT / candidate).exists():
                raise CommandError(f"{candidate}: no such file in the repository")


def empo2_parser_args(argv: list[str]):
    from empo2.cli import build_parser

    parser, err = build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, extra = parser.parse_known_args(argv)
    except SystemExit:
        raise CommandError(err.getvalue().strip().splitlines()[-1]) from None
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra)):
        raise CommandError(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def check_empo2(argv: list[str]) -> None:
    """What `empo2 ARGV` would validate before doing any work; ConfigError as the CLI would report it."""
    from empo2.config import describe, load_config

    check_paths(argv)
    args = empo2_parser_args(argv)
    if args.command == "train":
        load_config(args.overrides)
    elif args.command in ("eval", "adapt"):
        from empo2.workflows.evaluate import ADAPT_OPTIONS, EVAL_OPTIONS, int_option, parse_kv

        opts, overrides = parse_kv(args.rest, EVAL_OPTIONS if args.command == "eval" else ADAPT_OPTIONS)
        for key in ("variations", "rollouts", "trials"):
            int_option(opts, key, None)
        if opts.get("memory", "both") not in ("on", "off", "both"):
            raise ConfigError(f"memory={opts['memory']}: expected on, off or both")
        load_config(overrides)
    elif args.command in ("grid", "sweep"):
        from empo2.config.experiments import read_yaml
        from empo2.workflows.grid import parse_seeds, plan_grid
        from empo2.workflows.slurm import load_slurm_config, run_overrides, split_overrides
        from empo2.workflows.sweep_spec import load_sweep

        ours, overrides = split_overrides(args.overrides) if args.launcher == "slurm" else ([], args.overrides)
        overrides += run_overrides(load_slurm_config(ours))
        if args.command == "sweep":
            load_sweep(args.file, overrides)
            return
        seeds = parse_seeds(args.seeds if args.seeds is not None else read_yaml(args.file, "grid file").get("seeds", 1),
                            "--seeds")
        plan_grid(args.file, seeds=seeds[:1], overrides=overrides)  # seeds only change `seed=`
    elif args.command == "config":
        from empo2.workflows.slurm import describe_launcher

        describe_launcher() if args.section == "launcher" else describe(args.section)


def script_options(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    if not any(c.func.attr == "ArgumentParser" for c in calls):
        raise CommandError(f"{path.relative_to(ROOT)} builds no argparse parser")
    return {"-h", "--help"} | {a.value for c in calls if c.func.attr == "add_argument" for a in c.args
                               if isinstance(a, ast.Constant) and str(a.value).startswith("-")}


def module_names(module: str) -> tuple[Path, ast.Module, set[str]]:
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():  # a package's own names
        path = ROOT / module.replace(".", "/") / "__init__.py"
    if not path.is_file():
        raise CommandError(f"{module}: no such module")
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return path, tree, names


def dataclass_fields(module: str, cls: str) -> set[str]:
    _, tree, _ = module_names(module)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    imports = {a.asname or a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    for base in node.bases:
        if isinstance(base, ast.Name):
            fields |= dataclass_fields(imports.get(base.id, module), base.id)
    return fields


def check_python_code(code: str) -> None:
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise CommandError(f"python -c: {e}") from None
    origin = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("empo2", "recipes")):
            _, _, names = module_names(node.module)
            for a in node.names:
                if a.name not in names:
                    raise CommandError(f"{node.module} defines no {a.name}")
                origin[a.asname or a.name] = node.module
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
                and node.args and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Name)
                and node.args[0].func.id in origin):
            cls = node.args[0].func.id
            unknown = {k.arg for k in node.keywords} - dataclass_fields(origin[cls], cls)
            if unknown:
                raise CommandError(f"{cls} has no field {sorted(unknown)[0]}")


def check_python(argv: list[str]) -> None:
    if argv[:1] == ["-c"]:
        return check_python_code(argv[1])
    if argv[:2] == ["-m", "empo2.cli"]:
        return check_empo2(argv[2:])
    if argv[:2] == ["-m", "pytest"]:
        return check_paths(argv[2:])
    if argv[:2] == ["-m", "recipes.minisci_priors.prior_rounds"]:
        return check_prior_rounds(argv[2:])
    if argv[0] == "-m" and len(argv) > 1 and argv[1].startswith("recipes."):  # a recipe's script, as a module
        argv = [argv[1].replace(".", "/") + ".py", *argv[2:]]
    script = ROOT / argv[0]
    if not argv[0].startswith(("benchmarks/", "recipes/")) or not script.is_file():
        raise CommandError(f"{argv[0]}: not a script of benchmarks/ or recipes/")
    check_paths(argv[1:])
    options = script_options(script)
    for token in argv[1:]:
        if token.startswith("-") and token.split("=")[0] not in options:
            raise CommandError(f"{argv[0]} has no option {token.split('=')[0]}")


def check_prior_rounds(argv: list[str]) -> None:
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            if argv[:1] == ["round"]:
                parse_round(argv[1:])
            elif argv[:1] == ["build"] and len(argv) == 4 and argv[2] == "--out":
                for round_argv in planned_rounds(argv[1], Path(argv[3])):
                    parse_round(round_argv)
            elif not (argv[:1] == ["build"] and len(argv) == 2 and argv[1] in STAGE_ONE):
                raise CommandError(f"{PRIOR_ROUNDS} {' '.join(argv)}: neither `round` nor `build`")
    except SystemExit as e:
        raise CommandError(f"{PRIOR_ROUNDS}: {err.getvalue().strip() or e}") from None


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def check_argv(argv: list[str]) -> None:
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value before a command
        argv = argv[1:]
    prog, rest = argv[0], argv[1:]
    if prog == "empo2":
        check_empo2(rest)
    elif prog in ("python", "python3", ".venv/bin/python"):
        check_python(rest)
    elif prog == "make":
        missing = [t for t in rest if not t.startswith("-") and t not in makefile_targets()]
        if missing:
            raise CommandError(f"the Makefile has no target {missing[0]}")
    elif prog == "torchrun":  # -m MODULE or a script, after torchrun's own options
        scripts = [i for i, token in enumerate(rest) if token.endswith(".py")]
        if "-m" not in rest and not scripts:
            raise CommandError("torchrun without -m MODULE or a script")
        check_python(rest[rest.index("-m") if "-m" in rest else scripts[0]:])
    elif prog == "srun":
        check_argv(rest)
    elif prog == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for token in rest:
            for extra in re.findall(r"^\.\[([\w,-]+)\]$", token)[:1]:
                unknown = set(extra.split(",")) - set(extras)
                if unknown:
                    raise CommandError(f"pyproject.toml has no extra {sorted(unknown)[0]}")
    elif prog not in EXTERNAL:
        raise CommandError(f"{prog}: a program this test does not know; teach it how to check it")


def check_synopsis(text: str) -> None:
    """`empo2 SUB [options...]`: the subcommand exists and every --option is one of its own."""
    from empo2.cli import build_parser

    parser = build_parser()
    words = text.replace("\\|", "|").split()[1:]
    global_options = {o for a in parser._actions for o in a.option_strings}
    while words and words[0] in global_options:
        words = words[1:]
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    if words[0] == "COMMAND":
        return
    if words[0] not in subparsers:
        raise CommandError(f"no subcommand {words[0]}")
    options = {o for a in subparsers[words[0]]._actions for o in a.option_strings}
    for flag in re.findall(r"(?<![\w-])--[\w-]+", " ".join(words)):
        if flag not in options:
            raise CommandError(f"empo2 {words[0]} has no option {flag}")


def check(kind: str, text: str) -> None:
    if kind == "unlabelled":
        raise CommandError("a fenced block without a language: say bash, console or text")
    if kind == "bash":
        return check_argv(shlex.split(text))
    if kind == "inline":
        if PLACEHOLDER.search(text.replace("empo2", "")) or len(text.split()) == 2:  # a synopsis, or a name
            return check_synopsis(text)
        return check_argv(shlex.split(text))
    command, _, expected = text.partition("\n")
    want_error = re.match(r"^(empo2 \w+): error: (.*)$", expected)
    try:
        check_argv(shlex.split(command))
    except ConfigError as e:
        if not want_error:
            raise
        shown = want_error.group(2)
        if not (str(e) == shown or shown.endswith("...") and str(e).startswith(shown[:-3].rstrip(". "))):
            raise CommandError(f"prints {e!s}, the page shows {shown}") from None
        return
    if want_error:
        raise CommandError(f"succeeds, the page shows an error: {expected}")


@pytest.mark.parametrize("where,kind,text", COMMANDS, ids=[f"{w} {t.splitlines()[0][:60]}" for w, _, t in COMMANDS])
def test_every_command_a_page_shows_is_valid(where, kind, text):
    try:
        check(kind, text)
    except (CommandError, ConfigError) as e:
        pytest.fail(f"{where}: `{text.splitlines()[0]}`: {e}", pytrace=False)


def test_the_pages_show_commands_of_every_kind():
    kinds = {k for _, k, _ in COMMANDS}
    assert {"bash", "console", "inline"} <= kinds and len(COMMANDS) > 30

