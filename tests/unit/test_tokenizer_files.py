"""What ``Target/GetTokenizer`` sends and the router accepts (`specmesh.rpc.tokenizer_files`):
which files, the digest's framing, the size bound, the checks on a reply, and loading it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from specmesh.defaults import REPO_MODELS
from specmesh.router.tokenizer import load_tokenizer, load_tokenizer_files
from specmesh.rpc.tokenizer_files import (
    NoTokenizerError,
    TokenizerDigestError,
    TokenizerFiles,
    TokenizerTooLargeError,
    read_tokenizer_files,
    tokenizer_digest,
)
from specmesh.v1 import target_pb2


def test_digest_frames_each_file_by_name_and_size() -> None:
    files = (("a.json", b"xy"), ("b.txt", b""))
    framed = b"a.json\0" + (2).to_bytes(8, "big") + b"xy" + b"b.txt\0" + bytes(8)
    assert tokenizer_digest(files) == hashlib.sha256(framed).hexdigest()
    # the same bytes cut differently between names and contents hash differently
    assert tokenizer_digest((("a.jsonx", b"y"), ("b.txt", b""))) != tokenizer_digest(files)


def test_reads_only_tokenizer_files_sorted_with_config(tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors", "notes.txt"):
        (tmp_path / name).write_bytes(b"{}")
    with pytest.raises(NoTokenizerError, match="no tokenizer files"):
        read_tokenizer_files(tmp_path, 1 << 20)
    (tmp_path / "tokenizer_config.json").write_bytes(b"{1}")
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ x }}")
    files = read_tokenizer_files(tmp_path, 1 << 20)
    names = [n for n, _ in files.files]
    assert names == ["chat_template.jinja", "config.json", "tokenizer_config.json"]
    assert files.sha256 == tokenizer_digest(files.files) and files.num_bytes == 12
    with pytest.raises(TokenizerTooLargeError, match="tokenizer files of 12 bytes"):
        read_tokenizer_files(tmp_path, 11)


def test_a_reply_is_checked_before_anything_is_written() -> None:
    files = TokenizerFiles(
        (("tokenizer.json", b"{}"),), tokenizer_digest((("tokenizer.json", b"{}"),))
    )
    assert TokenizerFiles.from_pb(files.to_pb(), "t") == files
    damaged = files.to_pb()
    damaged.files[0].content = b"{ }"
    with pytest.raises(TokenizerDigestError, match="t: the tokenizer files do not match"):
        TokenizerFiles.from_pb(damaged, "t")
    for names in (["../evil.json"], ["tokenizer.json", "tokenizer.json"]):
        listed = [target_pb2.TokenizerFile(name=n, content=b"{}") for n in names]
        sha = tokenizer_digest(tuple((n, b"{}") for n in names))
        with pytest.raises(TokenizerDigestError, match="GetTokenizer"):
            TokenizerFiles.from_pb(target_pb2.TokenizerFiles(files=listed, sha256=sha), "t")


@pytest.mark.skipif(not (REPO_MODELS / "target").is_dir(), reason="no committed demo pair")
def test_fetched_files_load_as_the_checkpoint_does() -> None:
    files = read_tokenizer_files(REPO_MODELS / "target", 64 << 20)
    assert "chat_template.jinja" in dict(files.files)  # the demo's chat template travels
    fetched, local = load_tokenizer_files(files), load_tokenizer(REPO_MODELS / "target")
    text = "import os\n\ndef main():\n    return 0\n"
    assert fetched.encode(text) == local.encode(text)
    assert fetched.chat_template == local.chat_template is not None
    assert not Path(fetched.name_or_path).exists()  # its private folder is gone once loaded
