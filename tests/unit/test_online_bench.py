"""The online-learning bench's pieces that need no model run: its prompts (from a line inside a
file, held-out files never served) and its table and plot."""

from __future__ import annotations

import itertools
from pathlib import Path

from specmesh.bench.online import sampling
from specmesh.bench.online_data import domain_files, eval_prompts, prompt_at, traffic
from specmesh.bench.online_report import EVALS, plot, table


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0, *map(ord, text)]


def _files(root: Path, count: int) -> list[Path]:
    out = []
    for i in range(count):
        path = root / f"f{i}.py"
        path.write_text("".join(f"line {i} {n}\n" for n in range(30)))
        out.append(path)
    return out


def test_prompts_start_at_a_line_inside_the_file(tmp_path: Path) -> None:
    files = _files(tmp_path, 6)
    prompt = prompt_at(CharTokenizer(), files[0], 1 / 3, 12)
    assert prompt == [0, *map(ord, "line 0 10\nl")]  # bos, then the line at a third
    assert prompt_at(CharTokenizer(), files[0], 0.99, 200) is None  # too short there
    assert len(eval_prompts(CharTokenizer(), files, 3, 12)) == 3
    served = list(itertools.islice(traffic(CharTokenizer(), files, 12, seed=0), 14))
    assert len(served) == 14 and all(len(p) == 12 for p in served)


def test_the_new_domains_held_out_files_are_never_served(tmp_path: Path) -> None:
    for package in ("torch", "transformers"):
        for i in range(40):
            (tmp_path / package / f"m{i}").mkdir(parents=True)
            (tmp_path / package / f"m{i}" / "x.py").write_text("x = 1\n")
    held, served = domain_files("python-packages", tmp_path)
    assert held and served and not set(held) & set(served) and len(held) + len(served) == 80
    (tmp_path / "lib.js").write_text("var x = 1;\n")
    held, served = domain_files("javascript", tmp_path)
    assert [*held, *served] == [tmp_path / "lib.js"]


def test_traffic_is_one_greedy_request_in_four() -> None:
    params = [sampling(i, 16) for i in range(8)]
    assert [p.temperature for p in params] == [0.0, 0.8, 0.8, 0.8] * 2
    assert params[1].seed != params[2].seed


def test_table_and_plot(tmp_path: Path) -> None:
    point = lambda t, a: {"tokens_served": t, "serve_s": 1.0, "traffic_accept": (a - 0.1) if t else None,
                          "accept_length": dict.fromkeys(
        EVALS, a), "learner": {"version": 1, "num_updates": 1, "num_rollbacks": 2,
                               "train_seconds": 3.0}}  # fmt: skip
    step = {"steps": 5, "mean_ms": 1.0, "p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 2.0,
            "max_ms": 3.0, "tokens_per_s": 100.0}  # fmt: skip
    results = {"points": [point(0, 2.0), point(1000, 2.5)], "args": {"domain": "javascript"},
               "target_as_draft":
               dict.fromkeys(EVALS, 3.0), "step_times": {"trainer idle": step,
               "trainer busy": step, "swap_ms_mean": 0.5}}  # fmt: skip
    text = table(results)
    assert "| 0 |  | 2.00 (+0 %)" in text and "| 1,000 | 2.40 | 2.50 (+25 %)" in text
    assert "target as its own draft | | 3.00 (+50 %)" in text
    assert "| trainer busy | 5 |" in text and "0.50 ms" in text
    plot(results, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_online_speed_plans_three_drafts_per_temperature_and_compares_to_learning_off(
    tmp_path: Path,
) -> None:
    from specmesh.bench.online_speed import OFF, compare, format_table, plan
    from specmesh.bench.worker import TWO_DEVICES

    configs = plan(tmp_path / "learned", batch=8, num_requests=16)
    assert [label for label, _ in configs] == [
        f"t{t} {d}" for t in ("0", "0.8") for d in (OFF, "learning on", "learned, learning on")
    ]
    for label, job in configs:
        assert job.cpus == TWO_DEVICES and job.run.backend == "cluster"
        assert ("--online-learning" in job.draft_args) == (not label.endswith(OFF))
        assert (job.draft == str(tmp_path / "learned")) == label.endswith("learned, learning on")
    run = lambda label, tps: {"label": label, "tokens_per_s": tps[1], "tokens_per_s_min": tps[0],
                              "tokens_per_s_max": tps[2], "tokens_per_s_runs": list(tps),
                              "mean_accept_len": 2.0}  # fmt: skip
    results = [run(f"t0 {OFF}", (90, 100, 110)), run("t0 learning on", (81, 95, 99))]
    (ratio,) = compare(results)
    assert ratio["label"] == "t0 learning on" and ratio["ratio"] == 0.95
    assert ratio["ratio_min"] == 0.9 and ratio["ratio_max"] == 0.95  # per repeat
    assert "| t0 learning on | 95.0 (81.0 - 99.0) | 0.95 (0.90 - 0.95) | 2.00 |" in format_table(
        results, [ratio]
    )
