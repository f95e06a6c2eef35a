"""Hugging Face ids as models (`specmesh.hub`), offline from a Hub cache built on disk
(`tests/hub_cache.py`): an id resolves to its cached snapshot (by branch or commit) and is
served under its Hub id, not its commit; the real CLI and `Engine` load an id as they load a
directory; an id the cache lacks is a clear error naming it; paths never become names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_cache import DRAFT_ID, TARGET_ID, make_hub, use_hub

from specmesh.cli.main import main
from specmesh.hub import resolve_model
from specmesh.rpc.security import model_name


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hub(tmp_path_factory.mktemp("hf"))


@pytest.fixture
def offline(hub: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    use_hub(monkeypatch, hub)
    return hub


def test_an_id_resolves_to_its_cached_snapshot_by_branch_or_commit(offline: Path) -> None:
    snapshot = Path(resolve_model(TARGET_ID))
    repo = offline / "models--acme--tiny-llama"
    commit = (repo / "refs" / "main").read_text()
    assert snapshot == repo / "snapshots" / commit and (snapshot / "config.json").is_file()
    assert resolve_model(TARGET_ID, commit) == str(snapshot)
    assert model_name(str(snapshot)) == TARGET_ID  # the Hub id, not the commit


def test_an_id_missing_offline_is_an_error_naming_it(offline: Path) -> None:
    with pytest.raises(ValueError) as e:
        resolve_model("acme/not-cached", what="--target-model")
    text = str(e.value)
    assert "--target-model acme/not-cached" in text and "HF_HUB_OFFLINE" in text
    assert str(offline) in text  # where it looked
    with pytest.raises(ValueError, match="revision v9"):
        resolve_model(TARGET_ID, "v9")


def test_a_directory_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("ckpt", "ignored") == str(tmp_path / "ckpt")  # absolute
    with pytest.raises(ValueError, match="/no/such/dir: no such directory"):
        resolve_model("/no/such/dir")


@pytest.mark.parametrize(
    "path,name",
    [
        ("/srv/models/target", "target"),
        ("/h/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/" + "0" * 40,
         "meta-llama/Llama-3.1-8B-Instruct"),
        ("/h/hub/models--gpt2/snapshots/abc/", "gpt2"),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),  # reported
        ("target", "target"),
        ("../../etc/target", "target"),
        ("models/demo/target", "target"),
    ],
)  # fmt: skip
def test_a_model_is_named_never_by_its_path(path: str, name: str) -> None:
    assert model_name(path) == name


def test_the_cli_generates_from_hub_ids_as_from_directories(offline: Path, capsys, oracle) -> None:
    target = resolve_model(TARGET_ID)
    args = ["generate", "--in-process", "--json", "--prompt-ids", "5,6,7", "--max-new-tokens"]
    args += ["8", "--ignore-eos", "--target-model", TARGET_ID, "--draft-model", DRAFT_ID]
    assert main([*args, "--draft-kind", "eagle3", "--speculation", "always"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == oracle(target, [5, 6, 7], 8) and out["accept_lens"]
    assert main([*args[:-4], "--target-model", "acme/missing"]) == 2
    assert "--target-model acme/missing: not a local directory" in capsys.readouterr().err


def test_the_engine_takes_hub_ids(offline: Path, oracle) -> None:
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.router.engine import Engine

    engine = Engine(TARGET_ID, draft_model=DRAFT_ID, draft_kind="eagle3")
    assert engine.target.cfg.model_dir == resolve_model(TARGET_ID)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    (result,) = engine.generate([[9, 10, 11]], params)
    assert result.token_ids == oracle(resolve_model(TARGET_ID), [9, 10, 11], 6)
