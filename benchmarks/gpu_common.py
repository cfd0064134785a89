"""The GPU check's shared parts: its table, its timer, and the set-up every section uses."""
from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

K = 1024
TARGET_DECODE_BW = 0.70    # decode kernel >= 70% of copy bandwidth at 8k context and above
TARGET_ROOFLINE_1K = 0.80  # end-to-end decode at 1k >= 80% of the weight-read roofline (issue 28)



# ---- the table ---------------------------------------------------------------------------------
@dataclass
class Report:
    rows: list[dict] = field(default_factory=list)
    facts: dict = field(default_factory=dict)   # numbers later sections use (copy bandwidth, ...)

    def row(self, section: str, case: str, value: str, peer: str = "", verdict: str = "") -> None:
        self.rows.append(dict(section=section, case=case, value=value, peer=peer, verdict=verdict))
        print(f"{section:<9} {case:<50} {value:<28} {peer:<32} {verdict}", flush=True)

    def error(self, section: str, case: str, err: BaseException) -> None:
        where = traceback.extract_tb(err.__traceback__)[-1]
        msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
        self.row(section, case, "ERROR", f"{Path(where.filename).name}:{where.lineno}", msg)

    @contextlib.contextmanager
    def guard(self, section: str, case: str):
        """One row's worth of work: an exception becomes an ERROR row, and the run goes on."""
        try:
            yield
        except Exception as err:  # noqa: BLE001  (a check script reports every failure and continues)
            self.error(section, case, err)
        finally:
            free_memory()


def header() -> None:
    print(f"{'section':<9} {'case':<50} {'measured':<28} {'peer / reference':<32} verdict")
    print("-" * 140)


def free_memory() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- timing ----------------------------------------------------------------------------------
class Timer:
    """GPU time of a callable: CUDA events around back-to-back calls, or around replays of a
    CUDA graph holding many calls (no launch overhead). On CPU (the dry run: interpreted
    kernels, timings that mean nothing) wall time of one call, no warm-up: the run checks that
    each measurement runs, not its figure."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def eager_ms(self, fn, reps: int = 10, warmup: int = 2) -> float:
        import torch
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1000
        for _ in range(warmup):
            fn()
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def graph_ms(self, fns: list, reps: int = 5) -> float:
        """Mean time of one call, from a graph holding every fn in `fns` once (distinct data
        per fn keeps the L2 cache from serving repeated reads)."""
        import torch
        if not self.cuda:
            return self.eager_ms(lambda: [f() for f in fns]) / len(fns)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        graph.replay()
        self.sync()
        ms = self.eager_ms(graph.replay, reps=reps, warmup=1) / len(fns)
        del graph
        return ms


# ---- shared set-up ----------------------------------------------------------------------------
@dataclass
class Setup:
    device: object
    quick: bool
    dry: bool
    geom: object            # the model geometry of the end-to-end section
    decode_contexts: list[int]
    e2e_contexts: list[int]
    prefill_prefixes: list[int]
    prefill_chunk: int
    decode_steps: int
    timer: Timer
    sweep: bool = False     # the decode kernel's launch-parameter sweep (always without --quick)


def make_setup(args) -> Setup:
    import torch
    from kvchat.engine.geometry import KNOWN, Geometry
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    if args.cpu_dry_run:
        geom = Geometry("tiny", n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64, intermediate=512,
                        vocab_size=512, max_position=4096)
        # one context each where one shows the path runs (the correctness section keeps its lengths)
        # one decode step timed (the engine runs 4 and drops the slowest 3): it shows the path runs
        return Setup(device, True, True, geom, [64], [64], [0, 64], 32, 1, Timer(device))
    geom = KNOWN["llama-3.1-8b"]
    quick = args.quick
    return Setup(device, quick, False, geom,
                 [1 * K, 8 * K, 32 * K] if quick else [1 * K, 8 * K, 32 * K, 128 * K],
                 [1 * K, 8 * K] if quick else [1 * K, 8 * K, 32 * K],
                 [0, 8 * K] if quick else [0, 8 * K, 32 * K], 2048, 16 if quick else 32, Timer(device),
                 sweep=not quick or getattr(args, "sweep", False))


def shuffled_table(n_blocks: int, device, gen=None):
    """A block table of n_blocks distinct ids in random order (what a long-lived pool looks like)."""
    import torch
    return torch.randperm(n_blocks, generator=gen).to(torch.int32).to(device)


def random_kv(n_blocks: int, bs: int, hk: int, d: int, dtype, device):
    """Random (k_cache, v_cache, k_scale, v_scale); fp8 through the reference quantizer."""
    import torch
    from kvchat.engine.attention import FP8, quantize_fp8
    act = torch.bfloat16 if dtype == FP8 else dtype
    k = torch.randn(n_blocks * bs, hk, d, device=device, dtype=act)
    v = torch.randn(n_blocks * bs, hk, d, device=device, dtype=act)
    if dtype != FP8:
        return k.view(n_blocks, bs, hk, d), v.view(n_blocks, bs, hk, d), None, None
    (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
    return (kq.view(n_blocks, bs, hk, d), vq.view(n_blocks, bs, hk, d),
            ks.view(n_blocks, bs, hk), vs.view(n_blocks, bs, hk))


@contextlib.contextmanager
def torch_reference_path():
    """Route CUDA tensors through the torch reference paths instead of the Triton kernels."""
    from kvchat.engine import attention
    real = attention._use_triton
    attention._use_triton = lambda t: False
    try:
        yield
    finally:
        attention._use_triton = real


@contextlib.contextmanager
def kernels_on_cpu(s: Setup):
    """Dry run only: CPU tensors through the (interpreted) kernels."""
    if not s.dry:
        yield
        return
    from kvchat.engine.attention import force_triton
    with force_triton():
        yield
