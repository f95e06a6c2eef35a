"""The demo pair's speed table (`specmesh.demo.speed`): what it runs, how it renders, and where
it goes in the model card (measuring itself is `specmesh bench`'s worker, tested there)."""

from __future__ import annotations

from pathlib import Path

from specmesh.demo.card import SPEED_SECTION
from specmesh.demo.speed import SPEC, SpeedSettings, plan, render, write_card_section


def test_the_plan_is_plain_against_adaptive_in_process_and_through_a_cluster() -> None:
    runs = plan(SpeedSettings(max_new_tokens=16))
    assert len(runs) == 8 and len({r.name for r in runs}) == 8
    assert {(r.backend, r.temperature) for r in runs} == {
        (b, t) for b in ("inprocess", "cluster") for t in (0.0, 0.7)
    }
    speculative = [r for r in runs if r.spec is not None]
    assert len(speculative) == 4 and all(r.spec == SPEC for r in speculative)
    assert all(r.speculation == "adaptive" and r.draft_kind == "eagle3" for r in speculative)
    assert all(r.max_new_tokens == 16 and r.batch_size == 1 for r in runs)


def test_the_table_gives_median_min_max_and_the_card_section_is_replaced(tmp_path: Path) -> None:
    row = {
        "backend": "cluster", "temperature": 0.7, "speculative": True, "tokens_per_s": 80.0,
        "tokens_per_s_min": 70.0, "tokens_per_s_max": 90.5, "mean_accept_len": 2.5,
    }  # fmt: skip
    section = render([row], SpeedSettings())
    assert section.startswith(SPEED_SECTION)
    assert "| gRPC cluster | 0.7 | adaptive | **80.0** (70.0 - 90.5) | 2.50 |" in section
    card = tmp_path / "README.md"
    card.write_text(f"# pair\n\n{SPEED_SECTION}\n\nold\n\n## Held-out files (1)\n\n- `a.py`\n")
    write_card_section(card, section)
    write_card_section(card, section)  # twice: still one section
    text = card.read_text()
    assert text.count(SPEED_SECTION) == 1 and "old" not in text and "80.0" in text
    assert text.startswith("# pair\n\n") and text.endswith("## Held-out files (1)\n\n- `a.py`\n")
    card.write_text("# pair\n\n## Held-out files (1)\n")  # no section yet: added before it
    write_card_section(card, section)
    assert card.read_text().index(SPEED_SECTION) < card.read_text().index("## Held-out")
