"""The command line contract: `make-tiny` writes loadable checkpoints for every draft kind,
`generate --in-process --json` prints the documented fields and the transformers greedy tokens,
bad flags are clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import assert_speculated

from specmesh.cli.main import main


def _generate(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert main(["generate", "--in-process", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp", "standalone"])
def test_make_tiny_then_generate(tmp_path: Path, capsys, oracle, kind: str) -> None:
    assert main(["make-tiny", str(tmp_path), "--draft-kind", kind]) == 0
    paths = json.loads(capsys.readouterr().out)
    assert paths == {"target": str(tmp_path / "target"), "draft": str(tmp_path / "draft")}
    out = _generate(
        capsys, "--target-model", paths["target"], "--draft-model", paths["draft"],
        "--draft-kind", kind, "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "5",
        "--prompt-ids", "5,6,7,8", "--max-new-tokens", "10", "--ignore-eos",
        "--speculation", "always",  # random heads: adaptive would soon stop speculating
    )  # fmt: skip
    assert out["token_ids"] == oracle(paths["target"], [5, 6, 7, 8], 10)
    assert out["finish_reason"] == "length" and isinstance(out["text"], str)
    assert out["mean_accept_len"] == pytest.approx(
        sum(out["accept_lens"]) / len(out["accept_lens"])
    )
    assert_speculated([SimpleNamespace(**out)])


def test_generate_json_says_when_and_why_the_policy_decoded_plainly(tiny_dir: Path, capsys) -> None:
    """A random draft head: the adaptive policy soon plans plain rounds, and ``speculation``
    counts them and gives the costs it compared; without a draft it says so."""
    target, draft = str(tiny_dir / "target"), str(tiny_dir / "draft")
    out = _generate(
        capsys, "--target-model", target, "--draft-model", draft, "--draft-kind", "eagle3",
        "--prompt-ids", "5,6,7,8", "--max-new-tokens", "40", "--ignore-eos",
    )  # fmt: skip
    spec = out["speculation"]
    assert spec["mode"] == "adaptive" and spec["plain_rounds"] > 0
    assert spec["plain_rounds"] + spec["speculative_rounds"] >= len(out["accept_lens"])
    assert spec["note"].startswith(f"plain decoding in {spec['plain_rounds']} of ")
    assert "a plain step: 1.00 tokens in " in spec["note"] and "-node trees" in spec["note"]
    out = _generate(
        capsys, "--target-model", target, "--prompt-ids", "5,6", "--max-new-tokens", "2"
    )
    assert out["speculation"] == {"mode": "off", "note": "no draft: plain decoding"}


def test_generate_without_a_draft_and_with_a_stop(tiny_dir: Path, capsys, oracle) -> None:
    target = str(tiny_dir / "target")
    ref = oracle(target, [9, 10, 11], 12)
    out = _generate(
        capsys, "--target-model", target, "--prompt-ids", "9,10,11", "--max-new-tokens", "12",
        "--stop-token-ids", str(ref[5]), "--ignore-eos",
    )  # fmt: skip
    assert out["token_ids"] == ref[: ref.index(ref[5]) + 1] and out["finish_reason"] == "stop"


def test_bad_flags_are_clear_errors(tiny_dir: Path, capsys) -> None:
    target = str(tiny_dir / "target")
    assert main(["generate", "--in-process", "--target-model", target, "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids must be comma-separated integers" in capsys.readouterr().err
    args = ["generate", "--target-model", target, "--prompt-ids", "1", "--draft-kind"]
    assert main([*args, "eagle3"]) == 2
    assert "draft kind 'eagle3' needs --draft-model DIR" in capsys.readouterr().err
    assert main([*args, "ngram", "--num-steps", "1", "--topk", "1", "--num-draft-tokens", "5"]) == 2
    assert "num_draft_tokens 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--draft-kind", "medusa"])


def test_dtype_defaults_to_fp32_on_a_cpu_and_the_checkpoints_on_cuda(capsys) -> None:
    """No --dtype: fp32 on a CPU (bf16 is slower there, AMX or not), the checkpoint's (None) on
    CUDA; the service prints its choice at start."""
    from specmesh.cli.cmd_serve import _runtime_kwargs
    from specmesh.cli.main import build_parser

    parse = lambda *a: build_parser("target").parse_args(["target", "--model", "m", *a])
    assert _runtime_kwargs(parse())["dtype"] == "fp32"
    assert "specmesh target: device cpu, dtype fp32," in capsys.readouterr().err
    assert _runtime_kwargs(parse("--device", "cuda:1"))["dtype"] is None
    err = capsys.readouterr().err
    assert "dtype the checkpoint's, attention triton" in err and "given: --device" in err
    assert _runtime_kwargs(parse("--dtype", "bf16"))["dtype"] == "bf16"
    assert "dtype bf16, " in capsys.readouterr().err


def test_bench_online_learning_runs_the_online_report(monkeypatch, tmp_path: Path) -> None:
    """`specmesh bench --online-learning [TOKENS]` hands `bench.online` its folder and budget
    (--quick: few prompts, and 10000 tokens unless it names its own)."""
    import specmesh.bench.online as online

    seen: list[list[str]] = []
    monkeypatch.setattr(online, "main", lambda argv: seen.append(argv) or 0)
    assert main(["bench", "--online-learning", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--online-learning", "5000", "--quick", "--out", str(tmp_path)]) == 0
    assert seen[0] == ["--out", str(tmp_path / "online"), "--max-tokens", "200000"]
    assert seen[1][:4] == ["--out", str(tmp_path / "online"), "--max-tokens", "5000"]
    assert "--eval-prompts" in seen[1]


def test_bench_online_learning_fine_tunes_the_target_first(monkeypatch, tmp_path: Path) -> None:
    """`--fine-tuned-target`: `demo.finetune` writes the target, then `bench.online` serves it
    at 2e-4; a failed fine-tune runs no bench."""
    import specmesh.bench.online as online
    import specmesh.demo.finetune as finetune

    tuned, seen = [], []
    monkeypatch.setattr(finetune, "main", lambda argv: tuned.append(argv) or 0)
    monkeypatch.setattr(online, "main", lambda argv: seen.append(argv) or 0)
    args = ["bench", "--online-learning", "--fine-tuned-target", "--out", str(tmp_path)]
    assert main(args) == 0
    target = str(tmp_path / "online-finetuned" / "target")
    assert tuned == [[target, "--steps", "224", "--seconds", "1e9"]]
    assert seen[0][:2] == ["--out", str(tmp_path / "online-finetuned")]
    learned = ["--online-learning-dir", str(tmp_path / "online-finetuned" / "learned")]
    assert seen[0][4:] == ["--target-model", target, "--lr", "2e-4", *learned]
    monkeypatch.setattr(finetune, "main", lambda argv: 1)
    assert main([*args, "--quick"]) == 1 and len(seen) == 1
    assert main(["bench", "--fine-tuned-target", "--out", str(tmp_path)]) == 2
