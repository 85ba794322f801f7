"""shared/serve/metrics.py: the Prometheus text the gateway serves at /metrics."""

from __future__ import annotations

import re
from pathlib import Path

from moe_pipe.shared.serve.metrics import OUTCOMES, Metrics

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _requests(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r'^moe_pipe_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_every_outcome_is_exported_from_the_start_at_zero():
    # A series that appears only at its first event is invisible to rate() until its second.
    m = Metrics()
    assert _requests(m.render(True, 0, None)) == {k: 0 for k in OUTCOMES}
    m.requests["rejected"] += 2
    seen = _requests(m.render(True, 0, None))
    assert seen["rejected"] == 2 and all(seen[k] == 0 for k in OUTCOMES if k != "rejected")


def test_the_documented_outcomes_are_the_exported_ones():
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `moe_pipe_requests_total{outcome}`"))
    assert set(re.findall(r"`(\w+)` \(", row) + re.findall(r"outcome: `(\w+)`", row)) == set(OUTCOMES)


def test_the_warm_start_is_exported_while_there_is_one():
    from moe_pipe.shared.experts.hotset import WarmProgress

    assert "moe_pipe_warm" not in Metrics().render(True, 0, None)
    text = Metrics().render(True, 0, None, warming=WarmProgress("warming", 812, 3071))
    assert "moe_pipe_warm_experts 812\n" in text and "moe_pipe_warm_experts_total 3071\n" in text and "moe_pipe_warming 1\n" in text
    assert "moe_pipe_warming 0\n" in Metrics().render(True, 0, None, warming=WarmProgress("done", 3071, 3071))
