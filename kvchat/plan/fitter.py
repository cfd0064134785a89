"""Fitting the step-time constants to measured steps.

A measured point is one or more steps of known composition (tokens, rows sampling a token,
sequences, cached tokens read, attention pairs) and the time they took in all: a decode step
at some context, a prefill of several chunks, a turn's first token after a cached history. The
step-time model (step_time.py) is linear in its unknowns once each step's roofline branch
(memory- or compute-bound) is fixed, so the fit alternates: choose the branches with the
current values, solve the least squares on the relative error, repeat until the branches
settle; it starts from several FLOP rates and keeps the best. Each point weighs as many
measurements as it stands for (Point.weight: a bin of n steps at their median counts n times,
a lone step with a prompt chunk once): unweighted, a validation run's ~30 chunk steps, each its
own point, outweighed its hundreds of decode steps in a dozen bins, and the fit traded the
decode steps (which set TPOT and ITL) for them.

The unknowns, in seconds: per step, per sequence in a step, per weight byte, per matrix-product
FLOP, per attention FLOP, per request (time before its first step that the measurement holds:
rendering the chat, tokenising), and per KV byte for each cache dtype measured (kernels read
an fp8 cache differently from an fp32 one: kvchat's bench measures fp8 decode on the CPU no
faster than fp32, a quarter of the bytes in the same time). What the points cannot tell apart keeps its
prior and is named: the weights share the cache's bandwidth efficiency when every point ran the
same weights (their bytes move in step with the fixed overhead); the per-sequence overhead
needs steps of more than one sequence; the per-chunk-step overhead (the eager path a step
with a prompt chunk takes: step_time.py) needs such steps timed on their own beside others.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cli.args import UsageError
from .step_time import ModelCosts

# tokens, logit rows, sequences, cached tokens read, pairs[, prompt chunks (0 when left out)]
StepRow = tuple[int, int, int, float, float] | tuple[int, int, int, float, float, int]
BASE = ("overhead", "row", "weight", "lin", "attn", "request", "chunk")
OVERHEAD, ROW, WEIGHT, LIN, ATTN, REQUEST, CHUNK = range(7)
OVERHEADS = (OVERHEAD, ROW, REQUEST, CHUNK)        # held at zero or above


@dataclass(frozen=True, slots=True)
class Point:
    what: str
    kv_dtype: str
    steps: tuple[StepRow, ...]
    ms: float
    requests: int = 0         # request overheads inside the measured time (a TTFT holds one)
    weight: float = 1.0       # how many measurements it stands for (a bin of n steps at their median: n)

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a point's weight must be positive, got {self.weight}")


@dataclass(frozen=True, slots=True)
class Fit:
    names: tuple[str, ...]            # BASE, then "kv:<dtype>" per cache dtype measured
    x: tuple[float, ...]              # seconds per unit
    fixed: dict[str, str]             # unknown -> why the points could not fit it (it kept its prior)
    predicted_ms: tuple[float, ...]

    def value(self, name: str) -> float:
        return self.x[self.names.index(name)]

    def mape(self, points: list[Point]) -> float:
        """Per measurement: each point counts as often as the steps it stands for."""
        return sum(q.weight * abs(p - q.ms) / q.ms for p, q in zip(self.predicted_ms, points)) / \
            sum(q.weight for q in points)


def _row(p: Point, c: ModelCosts, x: list[float], kv: int) -> list[float]:
    """The point's coefficient on each unknown, each step's roofline branches chosen by x."""
    phi = [0.0] * len(x)
    for step in p.steps:
        tokens, logit_rows, rows, cached, pairs = step[:5]
        wb = c.weight_bytes
        lf = c.linear_flops_per_token * tokens + c.head_flops_per_row * logit_rows
        kb = (cached + tokens) * c.kv_bytes_per_token
        af = pairs * c.attn_flops_per_pair
        phi[OVERHEAD] += 1.0
        phi[ROW] += rows
        if len(step) > 5 and step[5]:
            phi[CHUNK] += 1.0
        if x[WEIGHT] * wb >= x[LIN] * lf:
            phi[WEIGHT] += wb
        else:
            phi[LIN] += lf
        if x[kv] * kb >= x[ATTN] * af:
            phi[kv] += kb
        else:
            phi[ATTN] += af
    phi[REQUEST] = float(p.requests)
    return phi


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


class _Problem:
    def __init__(self, points: list[Point], costs: dict[str, ModelCosts], model_kv: str) -> None:
        self.points, self.costs = points, costs
        dtypes = sorted({p.kv_dtype for p in points})
        self.names = BASE + tuple(f"kv:{d}" for d in dtypes)
        self.kv_of = {d: len(BASE) + i for i, d in enumerate(dtypes)}
        self.tie = len({costs[p.kv_dtype].weight_bytes for p in points}) == 1
        self.tied_kv = self.kv_of.get(model_kv, len(BASE))      # the weights' efficiency follows this cache's

    def row(self, p: Point, x: list[float]) -> list[float]:
        phi = _row(p, self.costs[p.kv_dtype], x, self.kv_of[p.kv_dtype])
        if self.tie:
            phi[self.tied_kv] += phi[WEIGHT]
            phi[WEIGHT] = 0.0
        return phi

    def predict(self, p: Point, x: list[float]) -> float:
        return sum(r * v for r, v in zip(_row(p, self.costs[p.kv_dtype], x, self.kv_of[p.kv_dtype]), x))

    def refit(self, x: list[float], free: list[int]) -> list[float] | None:
        """One least-squares solve for the free unknowns, the overheads kept non-negative and
        the rates positive: an overhead the solve wants below zero is held at zero, a rate it
        wants at or below zero at its current value (the starting rate, or the last step's),
        and the rest solved again (clamping after the solve would leave the others fitted to
        an impossible value). A rate once held this way ended the whole start before, and a
        calibration whose every start did so kept its priors: a 41% error on a real run."""
        free = list(free)
        x = list(x)
        while True:
            out = self._solve(x, free)
            if out is None:
                return None
            negative = [i for i in OVERHEADS if i in free and out[i] < 0]
            negative += [i for i in free if i not in OVERHEADS and out[i] <= 0]
            if not negative:
                break
            for i in negative:
                if i in OVERHEADS:
                    x[i] = 0.0
                free.remove(i)
        if min(out[i] for i in range(len(out)) if i not in OVERHEADS) <= 0:
            return None
        return out

    def _solve(self, x: list[float], free: list[int]) -> list[float] | None:
        rows, ys = [], []
        for p in self.points:
            phi = self.row(p, x)
            y = p.ms / 1000 - sum(phi[i] * x[i] for i in range(len(x)) if i not in free)
            scale = 1000 / p.ms * p.weight ** 0.5       # relative error, squared, times the weight
            rows.append([phi[i] * scale for i in free])
            ys.append(y * scale)
        cols = [j for j in range(len(free)) if any(r[j] for r in rows)]
        sol = solve([[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols],
                    [sum(r[i] * y for r, y in zip(rows, ys)) for i in cols])
        if sol is None:
            return None
        out = list(x)
        for j, v in zip(cols, sol):
            out[free[j]] = v
        if self.tie:
            out[WEIGHT] = out[self.tied_kv]
        return out


def _bound(pb: _Problem, x: list[float], i: int) -> float:
    """The most seconds per FLOP that keeps every step's branch memory-bound."""
    best = float("inf")
    for p in pb.points:
        c, kv = pb.costs[p.kv_dtype], pb.kv_of[p.kv_dtype]
        for tokens, logit_rows, _, cached, pairs, *_ in p.steps:
            if i == LIN:
                flops, mem = c.linear_flops_per_token * tokens + c.head_flops_per_row * logit_rows, \
                    x[WEIGHT] * c.weight_bytes
            else:
                flops, mem = pairs * c.attn_flops_per_pair, x[kv] * (cached + tokens) * c.kv_bytes_per_token
            if flops:
                best = min(best, mem / flops)
    return best


def fit(points: list[Point], costs: dict[str, ModelCosts], prior: dict[str, float], model_kv: str) -> Fit:
    """`prior`: seconds per unit by name ("kv" for every cache dtype), kept for whatever the
    points cannot identify; `model_kv`: the cache dtype whose efficiency the weights share when
    they cannot be told apart."""
    if len(points) < 3:
        raise UsageError(f"a calibration needs at least 3 measured points, got {len(points)}")
    pb = _Problem(points, costs, model_kv)
    start = [prior[n] if n in prior else 0.0 if n == "chunk" else prior["kv"] for n in pb.names]
    fixed: dict[str, str] = {}
    if all(s[2] == 1 for p in points for s in p.steps):
        fixed["row"] = "every measured step held one sequence"
    if not any(p.requests for p in points):
        fixed["request"] = "no measured point held a request's first step"
    chunked = [p for p in points if any(len(s) > 5 and s[5] for s in p.steps)]
    if not any(not p.requests for p in chunked) or len(chunked) == len(points):
        fixed["chunk"] = ("no step with a prompt chunk was timed on its own, beside steps without one (a prefill "
                          "timed with its request cannot tell the two overheads apart)")
    free = [i for i, n in enumerate(pb.names) if n not in fixed and not (pb.tie and i == WEIGHT)]
    best: tuple[float, list[float]] | None = None
    # fastest rates first, and a later start must do strictly better: where a memory-bound and a
    # compute-bound reading explain the points equally (decode attention reads as many bytes as
    # it does pairs), the memory-bound one stands
    for rate in (1e-15, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10, 1e-9):
        x = list(start)
        x[LIN] = x[ATTN] = rate
        for _ in range(40):
            new = pb.refit(x, free)
            if new is None or new == x:
                break
            x = new
        err = sum(p.weight * ((pb.predict(p, x) - p.ms / 1000) * 1000 / p.ms) ** 2 for p in points)
        if best is None or err < best[0] * (1 - 1e-9) - 1e-18:
            best = (err, x)
    x = best[1]                                               # type: ignore[index]
    for i, what in ((LIN, "matrix products"), (ATTN, "attention")):
        if not sum(pb.row(p, x)[i] for p in points):
            # the points only bound this rate (every step was memory-bound): keep the prior
            # where it keeps them so, else the bound itself
            x[i] = min(start[i], _bound(pb, x, i))
            fixed[pb.names[i]] = (f"no measured step's {what} were compute-bound: at least "
                                  f"{1 / x[i] / 1e9:,.0f} GFLOP/s, from the points' bound or the default")
    if pb.tie:
        fixed["weight"] = (f"every point ran the same weights, so the weights share the {model_kv} cache's "
                           "bandwidth efficiency")
    return Fit(pb.names, tuple(x), fixed, tuple(pb.predict(p, x) * 1000 for p in points))
