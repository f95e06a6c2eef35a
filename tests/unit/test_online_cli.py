"""``specmesh draft --online-learning [--online-learning-dir DIR]``: the flags reach the draft's
config and its metrics, kinds that cannot learn are refused before the service listens, and the
directory without the switch is a usage error."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmesh.cli.main import main


@pytest.fixture
def served(monkeypatch):
    """Run `specmesh draft` up to its loaded runtime, without serving: what it built."""
    from specmesh.rpc import service_common

    built = {}

    async def serve_model(servicer, add, load, warm_up, **kw):
        built["runtime"], built["servicer"] = load(), servicer
        await servicer.attach(built["runtime"], warm_up)  # as serving does, warm-up included

    monkeypatch.setattr(service_common, "serve_model", serve_model)
    return built


def test_the_flags_reach_the_draft_and_its_metrics(copy_dir: Path, tmp_path, served) -> None:
    args = ["draft", "--kind", "eagle3", "--model", str(copy_dir / "eagle3"),
            "--target-model", str(copy_dir / "target"), "--num-kv-slots", "1024",
            "--online-learning", "--online-learning-dir", str(tmp_path / "learned"),
            "--online-learning-rate", "2e-4"]  # fmt: skip
    assert main(args) == 0
    runtime = served["runtime"]
    assert runtime.cfg.online_learning and runtime.cfg.online_learning_dir.endswith("learned")
    assert runtime.learner is not None and runtime.learner.checkpoints is not None
    assert runtime.learner.settings.lr == 2e-4
    assert runtime.learner.optimizer.param_groups[0]["lr"] == 2e-4
    runtime.learner.close()
    from prometheus_client import generate_latest

    text = generate_latest(served["servicer"].metrics.registry).decode()
    assert 'specmesh_online_weight_version{service="draft"} 0.0' in text
    assert runtime.learner.buffer.open == {} and runtime.learner.stats().train_tokens == 0


def test_off_by_default(copy_dir: Path, served) -> None:
    args = ["draft", "--kind", "eagle3", "--model", str(copy_dir / "eagle3"),
            "--target-model", str(copy_dir / "target"), "--num-kv-slots", "1024"]  # fmt: skip
    assert main(args) == 0
    assert served["runtime"].learner is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--kind", "ngram", "--online-learning"],
            "needs --kind eagle3 or eagle, not ngram: n-gram",
        ),
        (["--kind", "standalone", "--online-learning"], "not standalone: a standalone draft"),
        (["--kind", "mtp", "--online-learning"], "not mtp: MTP layers are not trained online"),
        (["--kind", "eagle3", "--online-learning-dir", "x"], "needs --online-learning"),
        (["--kind", "eagle3", "--online-learning-rate", "1e-4"], "needs --online-learning"),
        (["--kind", "eagle3", "--online-learning", "--online-learning-rate", "0"], "must be > 0"),
    ],
)
def test_refusals_name_the_reason(copy_dir: Path, capsys, served, flags, message) -> None:
    assert main(["draft", "--target-model", str(copy_dir / "target"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not served  # refused before loading anything
