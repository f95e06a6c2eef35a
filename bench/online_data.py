"""The prompts of the online-learning bench (`specmesh.bench.online`).

    new domain   the `.py` files of the installed torch and transformers packages: code the
                 demo pair never saw (`specmesh.demo.corpus` keeps them out of training in every
                 preset), split by a hash of the path: 10 % held out (evaluation prompts only),
                 the rest the traffic the draft learns from
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

DOMAIN_PACKAGES = ("torch", "transformers")
HELDOUT_PERCENT = 10  # of the new domain's files
SKIPPED_DIRS = {"test", "tests", "testing", "__pycache__"}


@dataclass(frozen=True)
class Prompts:
    traffic: Iterator[list[int]]  # new-domain prompts to serve, endless
    domain_eval: list[list[int]]  # held-out new-domain prompts
    stdlib_eval: list[list[int]]  # held-out stdlib prompts


def _rank(rel_path: str) -> int:
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")


def domain_files(site_packages: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(held out, traffic) files of the new domain (tests left out), in path-hash order."""
    root = Path(site_packages or sysconfig.get_paths()["purelib"])
    rel = sorted(
        (p.relative_to(root).as_posix() for name in DOMAIN_PACKAGES for p in
         (root / name).rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts)),
        key=_rank,
    )  # fmt: skip
    if not rel:
        raise ValueError(f"none of {DOMAIN_PACKAGES} is installed under {root}")
    held = [root / r for r in rel if _rank(r) % 100 < HELDOUT_PERCENT]
    return held, [root / r for r in rel if _rank(r) % 100 >= HELDOUT_PERCENT]


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


def load_prompts(tokenizer, pair_dir: Path, num_eval: int, length: int, seed: int) -> Prompts:
    held, served = domain_files()
    return Prompts(
        traffic(tokenizer, served, length, seed),
        eval_prompts(tokenizer, held, num_eval, length),
        eval_prompts(tokenizer, stdlib_heldout(pair_dir), num_eval, length),
    )
