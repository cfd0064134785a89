"""The machine's speed as it drifts during a validation: a fixed probe, timed on the engine.

This machine is shared: between the calibration run and a load level minutes later, other
tenants' work can change every step's time by a third or more. A probe says how much, without
looking at the level's own runs: the same small batch (two prompts of 64 tokens, 32 decode
steps of the pair, through Engine.generate, one to two seconds) right after the calibration
run and right before and after each level. Its median decode step, over the calibration's, is
printed beside each level's error split.

It is reported, not applied. Scaling each level's model by it was tried on two real runs and
made the step-time half worse: the measured steps over the model went from 0.77, 0.79 and
1.16 (unscaled) to 1.00, 1.28 and 1.45 (scaled) in one, from 0.75, 0.62 and 0.67 to 0.74,
1.26 and 1.10 in the other. A second or two of probe, taken between the levels, samples the
neighbours' load more noisily than the minutes of a level average it.
"""
from __future__ import annotations

from statistics import median

PROMPT_TOKENS = 64
ROWS = 2
NEW_TOKENS = 33           # the first from the prefill, then 32 decode steps of both rows


def probe_ms(engine) -> float:
    """The median decode step of the probe batch, in ms."""
    from kvchat.engine.sampler import SamplingParams
    prompts = [[100 + (37 * i + 11 * j) % 2000 for j in range(PROMPT_TOKENS)] for i in range(ROWS)]
    _, records = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), ignore_eos=True)
    steps = [r.step_ms for r in records if r.decode_rows == ROWS and not r.prefill_tokens]
    if not steps:
        raise RuntimeError("the speed probe ran no decode step of its batch")
    return median(steps)
