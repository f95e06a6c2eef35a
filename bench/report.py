"""Write the results: ``results.json``, a table on stdout, and PNG plots when matplotlib is
importable (throughput vs batch size; acceptance per draft position)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TABLE_COLUMNS = (
    ("config", "name", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("min", "tokens_per_s_min", "{:.1f}"),
    ("max", "tokens_per_s_max", "{:.1f}"),
    ("TTFT ms", "ttft_s_mean", "{:.1f}", 1e3),
    ("ITL p50 ms", "itl_s_p50", "{:.1f}", 1e3),
    ("ITL p99 ms", "itl_s_p99", "{:.1f}", 1e3),
    ("accept", "mean_accept_len", "{:.2f}"),
    ("pre-draft hits", "predraft_hit_rate", "{:.2f}"),  # rounds whose tree was pre-drafted
    ("draft wait ms", "draft_wait_ms_per_round", "{:.2f}"),  # per round, waiting on the draft
    ("target %", "target_pct", "{:.0f}"),
    ("draft %", "draft_pct", "{:.0f}"),
    ("router %", "router_pct", "{:.0f}"),
    ("B/tok", "bytes_per_token", "{:.0f}"),
)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


def emit_json(result: dict[str, Any], out: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``out`` too when given (the GPU probes)."""
    print(json.dumps(result, indent=1))
    if out:
        write_json(result, Path(out))


def _row(c: dict[str, Any]) -> list[str]:
    split, wall = c["time_split"], c["time_split"]["wall_s"] or 1.0
    pct = {
        f"{k}_pct": None if split[f"{k}_s"] is None else 100 * split[f"{k}_s"] / wall
        for k in ("target", "draft", "router")
    }
    values = {**c, **pct}
    cells = []
    for _, key, fmt, *scale in TABLE_COLUMNS:
        v = values.get(key)
        cells.append("-" if v is None else fmt.format(v * scale[0] if scale else v))
    return cells


def format_table(results: dict[str, Any]) -> str:
    rows = [[h for h, *_ in TABLE_COLUMNS], *(_row(c) for c in results["configs"])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", "comparisons (ratio of median tokens/s; per-repeat min - max):"]
    for c in results["comparisons"]:
        goal = (
            ""
            if c["goal"] is None
            else f"  goal >= {c['goal']:.2f}: {'met' if c['met'] else 'MISSED'}"
        )
        lines.append(f"  {c['name']} {c['dtype']} @ batch {c['batch_size']}: {_ratio(c)}{goal}")
    lines += ["", "adaptive speculation, rounds planned per tree size (1 = plain decoding):"]
    lines += [f"  {name}: {plans}" for name, plans in _plans(results)]
    lines += ["", "goals:"]
    for g in results["goals"]:
        lines.append(
            f"  {g['name']}: {g['value']:.2f} (target {g['target']:.2f}) {'met' if g['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def _plans(results: dict[str, Any]) -> list[tuple[str, str]]:
    """What the adaptive policy chose in each adaptive configuration (its median run)."""
    return [
        (c["name"], ", ".join(f"{k}: {n}" for k, n in c["planned_tree_sizes"].items()))
        for c in results["configs"]
        if c.get("speculation") == "adaptive" and c.get("planned_tree_sizes")
    ]


def _ratio(c: dict[str, Any]) -> str:
    return f"{c['ratio']:.2f}x ({c['ratio_min']:.2f} - {c['ratio_max']:.2f})"


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG plots; none (and no error) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "throughput_vs_batch.png", out_dir / "accept_per_position.png"]
    fig, ax = plt.subplots(figsize=(6, 4))
    spec = results["meta"]["settings"]["spec"]
    main = (spec["num_steps"], spec["topk"], spec["num_draft_tokens"])
    for label, points in _throughput_series(results["configs"], main).items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
    ax.set(xscale="log", xlabel="batch size (requests in flight)", ylabel="tokens / s",
           title="Throughput, code workload, greedy")  # fmt: skip
    ax.set_xticks(sorted({c["batch_size"] for c in results["configs"]}), labels=None)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in results["configs"]:
        if c["backend"] == "inprocess" and c["batch_size"] == 1 and c["accept_per_position"]:
            ys = c["accept_per_position"]
            label = f"{c['draft_kind']} {c['dtype']} {c['workload']} t={c['temperature']:g} ({c['num_steps']},{c['topk']},{c['num_draft_tokens']})"
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=label)
    ax.set(xlabel="draft position", ylabel="fraction of rounds accepted", ylim=(0, 1.05),
           title="Acceptance per draft position (batch 1)")  # fmt: skip
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def _throughput_series(
    configs: list[dict[str, Any]], main: tuple[int, int, int]
) -> dict[str, dict[int, float]]:
    """backend + mode -> {batch size: tokens/s}, for code / greedy / main-spec configs."""
    series: dict[str, dict[int, float]] = {}
    for c in configs:
        spec = (c["num_steps"], c["topk"], c["num_draft_tokens"])
        if (
            c["workload"] != "code"
            or c["temperature"] != 0.0
            or (c["speculative"] and spec != main)
        ):
            continue  # another workload or temperature, or a sweep point
        mode = f"{c['draft_kind']} {','.join(map(str, spec))}" if c["speculative"] else "plain"
        label = f"{c['backend']} {c['dtype']} {mode}"
        series.setdefault(label, {})[c["batch_size"]] = c["tokens_per_s"]
    return series


def format_markdown(results: dict[str, Any]) -> str:
    """The table and the comparisons as Markdown (for bench/README.md)."""
    head = [h for h, *_ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_row(c)) + " |" for c in results["configs"]]
    lines += ["", "| comparison | dtype | batch | ratio (min - max) | goal |", "|---|---|---|---|---|"]  # fmt: skip
    for c in results["comparisons"]:
        goal = (
            "-" if c["goal"] is None else f">= {c['goal']:.2f} ({'met' if c['met'] else 'missed'})"
        )
        lines.append(f"| {c['name']} | {c['dtype']} | {c['batch_size']} | {_ratio(c)} | {goal} |")
    lines += ["", "| adaptive configuration | rounds per tree size (1 = plain) |", "|---|---|"]
    lines += [f"| {name} | {plans} |" for name, plans in _plans(results)]
    return "\n".join(lines)
