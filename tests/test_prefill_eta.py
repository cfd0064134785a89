"""The prefill's ETA from its recent chunks (issue 26: a constant rate since the start
underestimated a long prompt, 18 s shown where about 40 s were taken). The chunks here cost
what a real prefill's do, more the more tokens precede them: chunk k of 512 tokens takes
100 + 50·k ms."""
from __future__ import annotations

from kvchat.chat.prefill_eta import PrefillEta
from kvchat.engine.telemetry import PrefillProgress
from kvchat.text import prefill_line

CHUNK, TOTAL = 512, 8 * 512


def chunk_ms(k: int) -> float:
    return 100.0 + 50.0 * k


def events() -> list[PrefillProgress]:
    out, elapsed = [PrefillProgress(0, TOTAL, 20.0)], 20.0
    for k in range(TOTAL // CHUNK):
        elapsed += chunk_ms(k)
        out.append(PrefillProgress((k + 1) * CHUNK, TOTAL, elapsed))
    return out


def test_the_eta_follows_the_recent_chunks_where_the_average_rate_falls_short():
    eta = PrefillEta()
    seen = [eta.add(ev) for ev in events()]
    assert seen[0] is None                                          # nothing timed yet
    assert abs(seen[1] - 7 * chunk_ms(0) / 1000) < 1e-9             # one chunk: its rate
    for done in range(2, 8):
        truth = sum(chunk_ms(k) for k in range(done, 8)) / 1000
        assert abs(seen[done] - truth) < 0.02 * truth, (done, seen[done], truth)
        assert events()[done].eta_s < 0.8 * truth                   # the rate since the start: short
    assert seen[8] == 0.0


def test_a_new_prefill_starts_the_fit_again_and_the_line_shows_the_eta_given():
    eta = PrefillEta()
    for ev in events()[:5]:
        eta.add(ev)
    assert eta.add(PrefillProgress(0, 1024, 5.0)) is None
    assert eta.add(PrefillProgress(512, 1024, 105.0)) == 0.1
    line = prefill_line(PrefillProgress(512, 1024, 105.0), eta_s=65.0)
    assert "ETA 1 min 05 s" in line and "512 / 1,024 tokens" in line
