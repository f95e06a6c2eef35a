"""The prompts of the online-learning bench (`specmesh.bench.online`).

    new domain   code the demo pair never saw, one of `DOMAINS`: ``javascript`` (the default:
                 the `.js` files of this machine's Node.js packages, where the shipped draft
                 falls furthest below what the target would accept) or ``python-packages`` (the
                 `.py` files of the installed torch and transformers, which `specmesh.demo.corpus`
                 keeps out of training in every preset, but Python all the same); split by a hash
                 of the path: 10 % held out (evaluation prompts only), the rest the traffic the
                 draft learns from
    stdlib       the demo pair's own held-out standard-library files (never trained on), as its
                 `heldout_files.txt` lists them

A prompt is `prompt_len` tokens (`<|bos|>` first) starting at a line inside its file: traffic
prompts at seeded lines between 20 % and 80 % of the file (past the license header many files
share), evaluation prompts at a third of it, one per file, from evenly spaced files.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 10  # of the new domain's files
SKIPPED_DIRS = {"test", "tests", "testing", "__pycache__"}


@dataclass(frozen=True)
class Domain:
    roots: tuple[str, ...]  # directories searched (those that exist); "" is site-packages
    subdirs: tuple[str, ...]  # under each root, where to look ("" for the root itself)
    suffix: str


DOMAINS = {
    "javascript": Domain(("/usr/lib/node_modules", "/usr/share/nodejs"), ("",), ".js"),
    "python-packages": Domain(("",), ("torch", "transformers"), ".py"),
}


@dataclass(frozen=True)
class Prompts:
    traffic: Iterator[list[int]]  # new-domain prompts to serve, endless
    domain_eval: list[list[int]]  # held-out new-domain prompts
    stdlib_eval: list[list[int]]  # held-out stdlib prompts


def _rank(rel_path: str) -> int:
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")


def domain_files(domain: str, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(held out, traffic) files of the new domain (tests left out), in path-hash order;
    ``root`` replaces the domain's directories (tests)."""
    spec = DOMAINS[domain]
    roots = [root] if root is not None else [
        Path(r or sysconfig.get_paths()["purelib"]) for r in spec.roots]  # fmt: skip
    found = sorted(
        (p for r in roots if r.is_dir() for sub in spec.subdirs
         for p in (r / sub).rglob(f"*{spec.suffix}")
         if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(r).parts)),
        key=lambda p: _rank(p.as_posix()),
    )  # fmt: skip
    if not found:
        raise ValueError(f"no {spec.suffix} files of the {domain} domain under {roots}")
    held = [p for p in found if _rank(p.as_posix()) % 100 < HELDOUT_PERCENT]
    return held, [p for p in found if _rank(p.as_posix()) % 100 >= HELDOUT_PERCENT]


def stdlib_heldout(pair_dir: Path) -> list[Path]:
    """The stdlib files the pair at ``pair_dir`` held out of its training."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listed = (pair_dir / "heldout_files.txt").read_text().split()
    return [stdlib / rel for rel in listed if (stdlib / rel).is_file()]


def prompt_at(tokenizer, path: Path, fraction: float, length: int) -> list[int] | None:
    """``length`` tokens from the line at ``fraction`` of ``path``; None when too short."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except (UnicodeDecodeError, OSError):
        return None
    text = "".join(lines[int(fraction * len(lines)) :])
    ids = tokenizer.encode(text[: 16 * length], add_special_tokens=True)
    return ids[:length] if len(ids) >= length and text.strip() else None


def eval_prompts(tokenizer, files: list[Path], count: int, length: int) -> list[list[int]]:
    """One prompt per file from evenly spaced files that have one."""
    found = [p for f in files if (p := prompt_at(tokenizer, f, 1 / 3, length)) is not None]
    if len(found) < count:
        raise ValueError(f"only {len(found)} files give a {length}-token prompt, need {count}")
    return [found[i * len(found) // count] for i in range(count)]


def traffic(tokenizer, files: list[Path], length: int, seed: int) -> Iterator[list[int]]:
    """Prompts at seeded lines of the traffic files, file after file, round after round."""
    rng = random.Random(seed)
    while True:
        for path in files:
            prompt = prompt_at(tokenizer, path, rng.uniform(0.2, 0.8), length)
            if prompt is not None:
                yield prompt


def load_prompts(
    tokenizer, pair_dir: Path, num_eval: int, length: int, seed: int, domain: str = "javascript"
) -> Prompts:
    held, served = domain_files(domain)
    return Prompts(
        traffic(tokenizer, served, length, seed),
        eval_prompts(tokenizer, held, num_eval, length),
        eval_prompts(tokenizer, stdlib_heldout(pair_dir), num_eval, length),
    )
