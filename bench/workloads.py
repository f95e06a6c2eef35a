"""Benchmark prompts, as token ids of the target tokenizer, every prompt exactly ``prompt_len``
tokens long (so batched baselines need no padding to be fair).

- ``code``: held-out standard-library source: the start of each held-out file, then the start
  of each top-level function / class, taken round-robin across files for variety.
- ``text``: English prose: docstrings of the held-out files (module, class, function), falling
  back to a small built-in list when the standard library sources are not on disk.

Held-out files are those listed in ``models/demo/heldout_files.txt`` (relative to the running
interpreter's stdlib); they were never trained on by the demo pair.
"""

from __future__ import annotations

import ast
import itertools
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmesh.defaults import REPO_MODELS

WORKLOADS = ("code", "text")
HELDOUT_LIST = REPO_MODELS / "heldout_files.txt"
CHARS_PER_TOKEN_MAX = 12  # text kept per prompt token: enough for any prompt, cheap to tokenize

PROSE = [
    "The history of the city begins with a small fishing village on the northern bank of the "
    "river, where traders from the coast stopped on their way to the markets inland.",
    "When the committee met again in the spring, its members agreed that the old bridge could "
    "no longer carry the traffic of the growing town, and they asked engineers for a plan.",
    "Most gardeners learn early that the soil matters more than the seeds: a bed that drains "
    "well and holds enough organic matter will forgive many other mistakes.",
    "This function returns a new list containing the items of the input sequence that satisfy "
    "the predicate, preserving their original order and leaving the input unchanged.",
    "The report describes how the team measured the latency of each request, why the median "
    "hides the slow cases, and which percentile the service level objective should use.",
    "Before the invention of the printing press, books were copied by hand, usually in "
    "monasteries, and a single volume could take a scribe many months to complete.",
    "If the configuration file is missing, the program falls back to the default settings, "
    "logs a warning, and continues; it only stops when a required value is invalid.",
    "The weather on the island changes quickly: a calm and sunny morning can turn into a storm "
    "by noon, so the fishermen watch the clouds over the western hills.",
]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # [num_prompts][prompt_len] token ids
    source: str  # where the prompts came from, for the report


def heldout_paths() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not HELDOUT_LIST.is_file():
        return []
    names = [n.strip() for n in HELDOUT_LIST.read_text().splitlines() if n.strip()]
    return [stdlib / n for n in names if (stdlib / n).is_file()]


def code_snippets(paths: list[Path]) -> list[str]:
    """File starts first, then definition starts, interleaved across files."""
    per_file: list[list[str]] = []
    for path in paths:
        src = path.read_text(encoding="utf-8", errors="replace")
        lines = src.splitlines(keepends=True)
        starts = [0] + [n.lineno - 1 for n in _top_level_defs(src)]
        per_file.append(["".join(lines[s : s + 200]) for s in starts])
    return _round_robin(per_file)


def text_snippets(paths: list[Path]) -> list[str]:
    per_file: list[list[str]] = []
    for path in paths:
        tree = _parse(path.read_text(encoding="utf-8", errors="replace"))
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _DEF_TYPES))] if tree else []
        docs = [ast.get_docstring(n) or "" for n in nodes]
        per_file.append([" ".join(d.split()) for d in docs if len(d) >= 200])
    return _round_robin(per_file)


def load_workload(
    name: str, tokenizer: Any, num_prompts: int, prompt_len: int, paths: list[Path] | None = None
) -> Workload:
    """``num_prompts`` prompts of exactly ``prompt_len`` tokens (repeating the pool if short)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if num_prompts < 1 or prompt_len < 2:
        raise ValueError(
            f"need num_prompts >= 1 and prompt_len >= 2, got {num_prompts}, {prompt_len}"
        )
    paths = heldout_paths() if paths is None else paths
    texts = (code_snippets if name == "code" else text_snippets)(paths)
    source = f"{len(paths)} held-out stdlib files"
    pool = _encode_all(texts, tokenizer, prompt_len)
    if not pool:  # no sources on disk (or none long enough): built-in prose, repeated
        prose = " ".join(PROSE * (1 + 4 * prompt_len // len(" ".join(PROSE))))
        pool = _encode_all([prose[i:] for i in range(0, 400, 50)], tokenizer, prompt_len)
        source = "built-in prose"
    if not pool:
        raise ValueError(f"no prompt of {prompt_len} tokens could be built for workload {name!r}")
    prompts = list(itertools.islice(itertools.cycle(pool), num_prompts))
    return Workload(name, prompts, source)


def _encode_all(texts: list[str], tokenizer: Any, prompt_len: int) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tokenizer.encode(text[: CHARS_PER_TOKEN_MAX * prompt_len], add_special_tokens=True)
        if len(ids) >= prompt_len:
            out.append(ids[:prompt_len])
    return out


_DEF_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _parse(src: str) -> ast.Module | None:
    try:
        return ast.parse(src)
    except SyntaxError:
        return None


def _top_level_defs(src: str) -> list[ast.AST]:
    tree = _parse(src)
    return [n for n in tree.body if isinstance(n, _DEF_TYPES)] if tree else []


def _round_robin(groups: list[list[str]]) -> list[str]:
    return [x for row in itertools.zip_longest(*groups) for x in row if x is not None]
