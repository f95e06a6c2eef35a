"""The online-learning bench's table and plot (`specmesh.bench.online`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EVALS = ("domain greedy", "domain t0.8", "stdlib greedy", "stdlib t0.8")


def table(results: dict[str, Any]) -> str:
    """Markdown: the served traffic's accept length since the last point, the accept length
    per evaluation set at each point and its change from the first point, the learner's counts
    and the wall time; then the draft step times."""
    points = results["points"]
    first = points[0]["accept_length"]
    head = (
        "| tokens served | traffic | "
        + " | ".join(EVALS)
        + " | version (kept / rolled back) | serve s | train s |"
    )
    lines = [head, "|" + "---|" * (len(EVALS) + 5)]
    for p in points:
        acc, learner = p["accept_length"], p["learner"]
        cells = [f"{acc[k]:.2f} ({100 * (acc[k] / first[k] - 1):+.0f} %)" for k in EVALS]
        counts = f"v{learner['version']} ({learner['num_updates']} / {learner['num_rollbacks']})"
        traffic = p.get("traffic_accept")
        served = f"| {p['tokens_served']:,} | " + ("" if traffic is None else f"{traffic:.2f}")
        lines.append(served + " | " + " | ".join(cells)
                     + f" | {counts} | {p['serve_s']:.0f} | {learner['train_seconds']:.0f} |")  # fmt: skip
    top = results.get("target_as_draft")
    if top:
        cells = [f"{top[k]:.2f} ({100 * (top[k] / first[k] - 1):+.0f} %)" for k in EVALS]
        lines.append("| target as its own draft | | " + " | ".join(cells) + " | | | |")
    lines += ["", "| draft steps | steps | mean ms | p50 ms | p90 ms | p99 ms | max ms | tokens/s |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    times = results.get("step_times", {})
    for label, t in times.items():
        if isinstance(t, dict):
            lines.append(f"| {label} | {t['steps']} | {t['mean_ms']:.2f} | {t['p50_ms']:.2f} | "
                         f"{t['p90_ms']:.2f} | {t['p99_ms']:.2f} | {t['max_ms']:.2f} | "
                         f"{t['tokens_per_s']:.0f} |")  # fmt: skip
    if "swap_ms_mean" in times:
        lines.append(f"\nA version's swap into the served head: {times['swap_ms_mean']:.2f} ms.")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Accept length against tokens served, one line per evaluation set; faint horizontal
    lines: the target as its own draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["points"]
    served = [p["tokens_served"] / 1000 for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in zip(EVALS, ("-o", "-s", "--o", "--s"), strict=True):
        ax.plot(served, [p["accept_length"][name] for p in points], style, label=name)
    top = results.get("target_as_draft") or {}
    for name, color in zip(EVALS, ("C0", "C1", "C2", "C3"), strict=True):
        if name in top:
            ax.axhline(top[name], color=color, alpha=0.35, linewidth=1)
    ax.set_xlabel("new-domain tokens served (thousands)")
    ax.set_ylabel("accept length (tokens / round)")
    args = results.get("args", {})
    domain = args.get("domain", "a new domain")
    pair = (
        "the demo pair" if not args.get("target_model") else "a fine-tuned target, the demo draft"
    )
    ax.set_title(f"Online learning: {pair} serving {domain}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
