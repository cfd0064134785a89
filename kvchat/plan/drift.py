"""The machine's speed as it drifts during a validation: a fixed probe, timed on the engine.

This machine is shared: between the calibration run and a load level minutes later, other
tenants' work can change every step's time by half or more (a validation run measured its
last level's steps at 0.62x the calibrated model, its first two at 0.94x and 0.99x, the same
model and engine throughout). A probe measures that drift without looking at the level's own
runs: the same small batch (two prompts of 64 tokens, 32 decode steps of the pair, through
Engine.generate, one to two seconds) right after the calibration run and right before and after
each level; the level's model is the calibrated one with every time scaled by the probes'
median decode step over the calibration's, their mean before and after.

The probe is a fixed workload, not the validation's users: it can only say how fast the
machine is now, not fit the model to what the level measured.
"""
from __future__ import annotations

from statistics import median

from .step_time import Constant

PROMPT_TOKENS = 64
ROWS = 2
NEW_TOKENS = 33           # the first from the prefill, then 32 decode steps of both rows
SCALED_TIMES = ("overhead", "row_overhead", "chunk_overhead", "request_overhead")
SCALED_RATES = ("bandwidth", "flops", "attn_flops")


def probe_ms(engine) -> float:
    """The median decode step of the probe batch, in ms."""
    from kvchat.engine.sampler import SamplingParams
    prompts = [[100 + (37 * i + 11 * j) % 2000 for j in range(PROMPT_TOKENS)] for i in range(ROWS)]
    _, records = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), ignore_eos=True)
    steps = [r.step_ms for r in records if r.decode_rows == ROWS and not r.prefill_tokens]
    if not steps:
        raise RuntimeError("the speed probe ran no decode step of its batch")
    return median(steps)


def scaled(overrides: dict[str, Constant], factor: float, why: str) -> dict[str, Constant]:
    """The calibrated constants with every time `factor` times longer (rates divided by it)."""
    out = dict(overrides)
    for name in SCALED_TIMES:
        if name in out:
            c = out[name]
            out[name] = Constant(c.value * factor, c.unit, f"{c.source}; x {factor:.2f}: {why}")
    for name in SCALED_RATES:
        if name in out:
            c = out[name]
            out[name] = Constant(c.value / factor, c.unit, f"{c.source}; / {factor:.2f}: {why}")
    return out
