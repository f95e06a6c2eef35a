"""The README and docs/ stay true to the code: every `specmesh ...` command their shell blocks
show parses against the real command line (`specmesh.cli.main.build_parser`; nothing runs),
every `python -m specmesh...` module they name exists, every relative link (there, in
bench/README.md and bench_results/HISTORY.md) points to a file (and a heading, when it names
one), the README's copy of the round is router/round.py's, and the README stays short
(issue 50)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from specmesh.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.M | re.S)
SHELL = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1).strip().lower(), m.group(2)) for m in FENCE.finditer(text)]


def _logical_lines(body: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    return body.replace("\\\n", " ").splitlines()


def _commands(line: str) -> list[list[str]]:
    """Each simple command of a shell line, as its words (comments and `VAR=x` prefixes
    dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, words = [], []
    try:
        tokens = list(lexer)
    except ValueError:  # not shell (a layout, a diagram): an unbalanced quote
        return [line.split()] if line.split() else []
    for token in tokens:
        if token in SEPARATORS:
            commands.append(words)
            words = []
        elif words or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token):
            words.append(token)
    return [c for c in [*commands, words] if c]


def shell_commands(text: str) -> list[list[str]]:
    """Every simple command in the shell blocks of a Markdown text."""
    return [
        words
        for lang, body in _code_blocks(text)
        if lang in SHELL
        for line in _logical_lines(body)
        for words in _commands(line)
    ]


@cache
def _parser() -> argparse.ArgumentParser:
    """The whole `specmesh` command line, with no flag abbreviations: a README flag must be
    spelled as declared."""
    parser = build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return parser


def check_specmesh(args: list[str]) -> str | None:
    """None when ``specmesh ARGS`` parses, else argparse's complaint."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _parser().parse_args(args)
        except SystemExit as e:
            return err.getvalue().strip().splitlines()[-1] if e.code else None
    return None


def _module_exists(name: str) -> bool:
    """Whether module ``name`` exists, without importing it or its own package (finding
    ``specmesh.demo.compare`` imports ``specmesh`` only: the demo and bench packages load torch)."""
    parent, _, leaf = name.rpartition(".")
    if "." not in parent:  # a top-level module, or a package right under one (imports that one)
        return importlib.util.find_spec(name) is not None
    spec = importlib.util.find_spec(parent)
    dirs = [Path(d) for d in (spec.submodule_search_locations or [])] if spec else []
    return any((d / f"{leaf}.py").is_file() or (d / leaf / "__init__.py").is_file() for d in dirs)


def check_command(words: list[str]) -> str | None:
    """None when a shell command that calls specmesh (its CLI, a `python -m specmesh...`
    module, a script under scripts/) would start, else why not; other commands pass."""
    name = words[0]
    if name == "specmesh" or name.endswith("/specmesh"):
        return check_specmesh(words[1:])
    if re.fullmatch(r"(.*/)?python3?", name) and words[1:2] == ["-m"] and len(words) > 2:
        module = words[2]
        if module.startswith("specmesh"):
            return None if _module_exists(module) else f"no module {module}"
    if name.endswith("python") or name == "bash":
        script = next((w for w in words[1:] if not w.startswith("-")), None)
        if script is not None and script.startswith("scripts/") and not (ROOT / script).is_file():
            return f"no file {script}"
    return None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", text, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file (or heading) does not exist."""
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {file or path.name}")
    return bad


DOC_FILES = [README, *DOCS]
IDS = [str(p.relative_to(ROOT)) for p in DOC_FILES]


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def test_docs_exist_and_the_readme_links_them() -> None:
    assert DOCS, "docs/*.md"
    linked = {t.partition("#")[0] for t in LINK.findall(README.read_text())}
    assert not [p.name for p in DOCS if f"docs/{p.name}" not in linked], "README links every doc"


@pytest.mark.parametrize("path", DOC_FILES, ids=IDS)
def test_every_shown_command_parses(path: Path) -> None:
    commands = shell_commands(path.read_text())
    bad = [f"{shlex.join(c)}\n    -> {why}" for c in commands if (why := check_command(c))]
    assert not bad, "\n".join(bad)


def test_the_readme_shows_specmesh_commands() -> None:
    shown = [c for c in shell_commands(README.read_text()) if c[0].endswith("specmesh")]
    assert len(shown) >= 5
    assert [".venv/bin/python", "-m", "pytest", "-q"] in shell_commands(README.read_text())


LINKED = [*DOC_FILES, ROOT / "bench/README.md", ROOT / "bench_results/HISTORY.md"]


@pytest.mark.parametrize("path", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_every_relative_link_resolves(path: Path) -> None:
    assert not broken_links(path)


def test_the_readme_round_is_the_code() -> None:
    """The round the README quotes is `router/round.py`'s, line for line (comments aside)."""
    text = README.read_text().split("## The round", 1)[1]
    block = next(body for lang, body in _code_blocks(text) if lang == "python")
    source = (ROOT / "router/round.py").read_text().splitlines()
    code = {line.split("#")[0].strip() for line in source}
    quoted = [line.split("#")[0].strip() for line in block.splitlines()]
    assert not [line for line in quoted if line and line not in code], "update README's round"


def test_the_checks_bite(tmp_path: Path) -> None:
    """A subcommand or flag that does not exist, a misspelt module, a dead link: each fails."""
    text = (
        "```bash\nspecmesh serve router --port 1\n"
        "specmesh up --no-such-flag \\\n    --port 2   # comment\n"
        "SPECMESH_TP=2 specmesh target --model m --tensor-parallel-size two\n"
        "bash scripts/setup.sh && .venv/bin/specmesh up --num-step 5\n"
        "python -m specmesh.bench.nope\n"
        "specmesh up  # fine\n```\n"
    )
    verdicts = [check_command(c) for c in shell_commands(text)]
    assert [v is None for v in verdicts] == [False, False, False, True, False, False, True]
    assert "invalid choice: 'serve'" in verdicts[0]
    assert "--no-such-flag" in verdicts[1] and "two" in verdicts[2] and "--num-step" in verdicts[4]
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Real heading (`x`)\n")
    doc.write_text("[ok](b.md#real-heading-x) [gone](c.md) [no](b.md#other) `[code](d.md)`\n")
    assert broken_links(doc) == ["c.md: no such file", "b.md#other: no heading #other in b.md"]
