"""The demo's text: the Python standard library's own sources and, for presets with
`extra_sources`, the `.py` files of the installed packages.

    stdlib files     --hash of the relative path-->  held out (heldout_percent) | train
    package files    --top-level package-->          torch, transformers: eval-only | train

The stdlib split is a pure function of each file's path relative to the stdlib root, so it does
not depend on the seed, the machine or which other files exist. With extra sources, a training
file whose content (sha256) equals a held-out or eval-only file's, or an earlier training file's,
is dropped, so no evaluated text is trained on verbatim. Byte caps pick files in path-hash order
(a deterministic sample spread over every package); each kept set is then sorted by path.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from specmesh.demo.config import DemoConfig

# Folders that are tests, bundled tools or generated tables rather than ordinary library code.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "encodings", "pydoc_data", "__pycache__"}
)
EVAL_ONLY_PACKAGES = frozenset({"torch", "transformers"})  # top-level dirs kept out of training


@dataclass(frozen=True)
class TextSet:
    files: list[str]  # paths relative to their root (stdlib or site-packages)
    texts: list[str]  # same order as files
    num_bytes: int  # UTF-8 bytes of all texts

    @classmethod
    def of(cls, files: list[str], texts: list[str]) -> TextSet:
        return cls(files, texts, sum(len(t.encode()) for t in texts))

    def __add__(self, other: TextSet) -> TextSet:
        return TextSet(
            self.files + other.files, self.texts + other.texts, self.num_bytes + other.num_bytes
        )

    def sample(self, max_chars: int | None) -> list[str]:
        """Texts in path-hash order up to `max_chars` (all of them when None), e.g. for BPE."""
        if max_chars is None:
            return self.texts
        ranked = sorted(range(len(self.files)), key=lambda i: path_hash(self.files[i]))
        texts, total = [], 0
        for i in ranked:
            if total + len(self.texts[i]) > max_chars and texts:
                break
            texts.append(self.texts[i])
            total += len(self.texts[i])
        return texts


EMPTY = TextSet([], [], 0)


@dataclass(frozen=True)
class SourceStats:
    name: str  # "stdlib train", "stdlib held out", "installed packages train", "eval-only (...)"
    num_files: int
    num_bytes: int


@dataclass(frozen=True)
class Corpus:
    stdlib_dir: Path
    python_version: str  # e.g. "3.11.7"
    train: TextSet  # stdlib training files, then installed packages' files
    heldout: TextSet  # stdlib held-out files (paths relative to stdlib_dir)
    eval_only: TextSet  # a sample of torch / transformers; empty without extra sources
    sources: list[SourceStats]
    package_bytes: list[tuple[str, int]]  # training bytes per top-level package, largest first


def path_hash(rel_path: str) -> int:
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    return path_hash(rel_path) % 100 < heldout_percent


def list_py_files(root: Path) -> list[str]:
    """Relative paths of the `.py` files under `root`, sorted, tests and tables excluded."""
    rel_paths = []
    for dir_path, dir_names, file_names in os.walk(root):
        dir_names[:] = [d for d in dir_names if d not in EXCLUDED_DIRS]
        rel_dir = Path(dir_path).relative_to(root)
        for name in file_names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                rel_paths.append((rel_dir / name).as_posix())
    return sorted(rel_paths)


def read_files(
    files: list[tuple[str, Path]], max_chars: int | None, seen: set[bytes] | None = None
) -> TextSet:
    """Read (label, path) pairs in order, skipping unreadable or blank files and, when `seen`
    (sha256 digests, updated) is given, repeated contents; stop before the file that would pass
    `max_chars` (characters; Python sources are nearly all ASCII)."""
    kept, texts, total = [], [], 0
    for label, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if seen is not None:
            digest = _digest(text)
            if digest in seen:
                continue
            seen.add(digest)
        if max_chars is not None and total + len(text) > max_chars and kept:
            break
        kept.append(label)
        texts.append(text)
        total += len(text)
    return TextSet.of(kept, texts)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _sample_files(
    files: list[tuple[str, Path]], max_chars: int | None, seen: set[bytes] | None = None
) -> TextSet:
    """`read_files` in path-hash order (a spread-out sample under a cap), returned sorted."""
    sample = read_files(sorted(files, key=lambda f: path_hash(f[0])), max_chars, seen)
    order = sorted(range(len(sample.files)), key=lambda i: sample.files[i])
    files_sorted = [sample.files[i] for i in order]
    return TextSet(files_sorted, [sample.texts[i] for i in order], sample.num_bytes)


def installed_package_roots() -> list[Path]:
    """The site-packages folders of the running Python (purelib and platlib, once each)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths[key]).resolve() for key in ("purelib", "platlib")})


def _top_level(rel_path: str) -> str:
    return rel_path.split("/")[0]


def _with_packages(
    cfg: DemoConfig, stdlib: list[tuple[str, Path]], heldout: TextSet, roots: list[Path]
) -> tuple[TextSet, TextSet, TextSet]:
    """(stdlib train, packages train, eval-only), training files deduplicated by content."""
    package_files = [(rel, root / rel) for root in roots for rel in list_py_files(root)]
    eval_files = [f for f in package_files if _top_level(f[0]) in EVAL_ONLY_PACKAGES]
    eval_only = _sample_files(eval_files, cfg.max_eval_only_bytes)
    seen = {_digest(text) for text in heldout.texts + eval_only.texts}
    stdlib_train = read_files(stdlib, cfg.max_train_bytes, seen)
    train_files = [f for f in package_files if _top_level(f[0]) not in EVAL_ONLY_PACKAGES]
    if cfg.max_train_bytes is None:
        return stdlib_train, _sample_files(train_files, None, seen), eval_only
    left = cfg.max_train_bytes - stdlib_train.num_bytes
    packages_train = _sample_files(train_files, left, seen) if left > 0 else EMPTY
    return stdlib_train, packages_train, eval_only


def _stats(*named: tuple[str, TextSet]) -> list[SourceStats]:
    return [SourceStats(name, len(text.files), text.num_bytes) for name, text in named]


def _package_bytes(text: TextSet) -> list[tuple[str, int]]:
    counts: Counter[str] = Counter()
    for rel, body in zip(text.files, text.texts, strict=True):
        counts[_top_level(rel)] += len(body.encode())
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def split_stdlib(
    stdlib_dir: Path, heldout_percent: int
) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(held out, train) as (relative path, path) pairs, sorted, split by path hash."""
    rel_paths = list_py_files(stdlib_dir)
    held = [(p, stdlib_dir / p) for p in rel_paths if is_heldout(p, heldout_percent)]
    kept = [(p, stdlib_dir / p) for p in rel_paths if not is_heldout(p, heldout_percent)]
    return held, kept


def load_corpus(
    cfg: DemoConfig, stdlib_dir: Path | None = None, package_roots: list[Path] | None = None
) -> Corpus:
    """The stdlib split, plus (with `cfg.extra_sources`) the installed packages' text; the roots
    default to the running Python's."""
    stdlib_dir = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    held, kept = split_stdlib(stdlib_dir, cfg.heldout_percent)
    heldout = read_files(held, cfg.max_heldout_bytes)
    version = ".".join(str(v) for v in sys.version_info[:3])
    if not cfg.extra_sources:
        train = read_files(kept, cfg.max_train_bytes)
        sources = _stats(("stdlib train", train), ("stdlib held out", heldout))
        return Corpus(stdlib_dir, version, train, heldout, EMPTY, sources, [])
    roots = installed_package_roots() if package_roots is None else package_roots
    stdlib_train, packages_train, eval_only = _with_packages(cfg, kept, heldout, roots)
    sources = _stats(
        ("stdlib train", stdlib_train),
        ("stdlib held out", heldout),
        ("installed packages train", packages_train),
        (f"eval-only ({', '.join(sorted(EVAL_ONLY_PACKAGES))})", eval_only),
    )
    train = stdlib_train + packages_train
    return Corpus(
        stdlib_dir, version, train, heldout, eval_only, sources, _package_bytes(packages_train)
    )
