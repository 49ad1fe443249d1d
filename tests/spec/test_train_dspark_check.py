"""The re-check section `tools/train_dspark.py check` writes into the draft's card."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import train_dspark as td  # noqa: E402

CARD = "# draft\n\n## Acceptance\n\nold figures\n\n## Speed\n\nx\n\n## Limits\n\n* one\n"


def _res(rates: list[float]) -> dict:
    ev = {"mean_accepted": sum(rates), "tokens_per_step": sum(rates) + 1, "accept_rate_by_position": rates}
    return {
        "bf16": ev,
        "bf16_no_markov": dict(ev, accept_rate_by_position=[r / 2 for r in rates]),
        "draft_vocab_coverage_val": 0.9912,
        "val_seqs": 64,
        "seed": 1000,
        "target_sha256": "ab" * 32,
        "date": "2026-12-07",
    }


def test_the_recheck_section_goes_before_limits_once_and_is_replaced_after():
    rates = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3][: td.N]
    first = td.with_section(CARD, td.recheck_section(_res(rates)))
    assert first.count(td.RECHECK) == 1
    assert first.index("## Acceptance") < first.index(td.RECHECK) < first.index("## Limits")
    assert "| 3 | 0.700 | 0.350 |" in first and "99.12%" in first
    assert first.replace(td.recheck_section(_res(rates)) + "\n", "") == CARD  # nothing else moved
    again = td.with_section(first, td.recheck_section(_res([r / 3 for r in rates])))
    assert again.count(td.RECHECK) == 1 and "| 3 | 0.700 |" not in again and "| 3 | 0.233 |" in again
    assert again.split(td.RECHECK)[0] == first.split(td.RECHECK)[0]
    assert again.split("## Limits")[1] == first.split("## Limits")[1]
