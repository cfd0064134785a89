"""GPU check: the Triton kernels and the CUDA decode path, measured on one GPU in one run.

    python benchmarks/gpu_check.py            # the full check, under 5 minutes on one H200
    python benchmarks/gpu_check.py --quick    # fewer contexts, no launch-parameter sweep
    python benchmarks/gpu_check.py --json out.json

Prints one table, a row at a time, then the targets of the kernels issue:
1. correctness: each kernel against its torch reference on CUDA (write_kv bit for bit,
   paged_decode max abs error, the SDPA prefill in bf16 against fp32, and the graph-captured
   decode step against the eager torch reference path);
2. ceiling: device-to-device copy bandwidth (bytes read + written per second);
3. paged decode kernel: achieved bandwidth (K and V bytes read per second) at 1k, 8k, 32k
   and 128k context for Llama 3.1 8B's attention (8 KV heads, 32 query heads, head_dim 128,
   bf16, shuffled block table), timed from CUDA-graph replays, as % of the copy bandwidth,
   beside torch's gather + matmul decode (`engine.attention.decode_one`); then a small sweep
   of launch parameters (not with --quick);
4. prefill over a cached prefix: the engine's SDPA-over-gathered-blocks path against SDPA on
   K/V already contiguous (the floor for any gathering scheme), with the layer's matmuls for
   scale: the measurement behind keeping SDPA for prefill;
5. end to end: decode ms/token with random Llama 3.1 8B weights in bf16 through the engine
   (CUDA graph + kernels) at 1k, 8k, 32k context, beside a contiguous-cache torch SDPA decode
   loop on the same weights (eager, and graph-captured at a fixed context) and transformers'
   own LlamaForCausalLM.generate on the same geometry; with the weight-read roofline.

Every section runs in its own try/except: a failure prints its error in that row and the rest
still run. Without CUDA it prints "no CUDA device: nothing to check" and exits 0.
`--cpu-dry-run` runs every section on a tiny geometry on the CPU (kernels interpreted) to
check the script itself; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 1024
TARGET_DECODE_BW = 0.70    # decode kernel >= 70% of copy bandwidth at 8k context and above
TARGET_ROOFLINE_1K = 0.75  # end-to-end decode at 1k >= 75% of the weight-read roofline


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
    CUDA graph holding many calls (no launch overhead). On CPU (the dry run) wall time."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def eager_ms(self, fn, reps: int = 10, warmup: int = 2) -> float:
        import torch
        for _ in range(warmup):
            fn()
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1000 / reps
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
            return self.eager_ms(lambda: [f() for f in fns], reps=1, warmup=1) / len(fns)
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


def make_setup(args) -> Setup:
    import torch
    from engine.geometry import KNOWN, Geometry
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    if args.cpu_dry_run:
        geom = Geometry("tiny", n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64, intermediate=512,
                        vocab_size=512, max_position=4096)
        return Setup(device, True, True, geom, [64, 300], [64, 200], [0, 64], 32, 3, Timer(device))
    geom = KNOWN["llama-3.1-8b"]
    quick = args.quick
    return Setup(device, quick, False, geom,
                 [1 * K, 8 * K, 32 * K] if quick else [1 * K, 8 * K, 32 * K, 128 * K],
                 [1 * K, 8 * K] if quick else [1 * K, 8 * K, 32 * K],
                 [0, 8 * K] if quick else [0, 8 * K, 32 * K], 2048, 16 if quick else 32, Timer(device))


def shuffled_table(n_blocks: int, device, gen=None):
    """A block table of n_blocks distinct ids in random order (what a long-lived pool looks like)."""
    import torch
    return torch.randperm(n_blocks, generator=gen).to(torch.int32).to(device)


def random_kv(n_blocks: int, bs: int, hk: int, d: int, dtype, device):
    """Random (k_cache, v_cache, k_scale, v_scale); fp8 through the reference quantizer."""
    import torch
    from engine.attention import FP8, quantize_fp8
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
    from engine import attention
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
    from engine.attention import force_triton
    with force_triton():
        yield


# ---- 1. correctness ----------------------------------------------------------------------------
DTYPE_TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2),
             "float8_e4m3fn": (1e-2, 1.6e-2)}  # (atol, rtol), as in tests/test_kernels.py


def check_correctness(r: Report, s: Setup) -> None:
    import torch
    from engine import attention as A
    from engine import kernels
    dtypes = [torch.bfloat16, torch.float16, torch.float32] + ([A.FP8] if A.FP8 is not None else [])
    dev = s.device
    gen = torch.Generator().manual_seed(0)

    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        with r.guard("correct", f"write_kv {name} (hk 8, d 128, 300 rows)"):
            nb, bs, hk, d, t = 40, 16, 8, 128, 300
            act = torch.bfloat16 if dtype == A.FP8 else dtype
            fused = (torch.randn(t, 3 * hk * d, generator=gen) * 3).to(act).to(dev)
            k, v = fused[:, :hk * d].view(t, hk, d), fused[:, 2 * hk * d:].view(t, hk, d)
            slots = torch.randperm(nb * bs, generator=gen)[:t].to(dev)
            bufs = []
            for _ in range(2):
                c = [torch.zeros(nb, bs, hk, d, device=dev).to(dtype) for _ in range(2)]
                sc = [torch.zeros(nb, bs, hk, device=dev) for _ in range(2)] if dtype == A.FP8 else [None, None]
                bufs.append(c + sc)
            with kernels_on_cpu(s):
                kernels.write_kv(bufs[0][0], bufs[0][1], k, v, slots, bufs[0][2], bufs[0][3])
            A.write_kv_ref(bufs[1][0], bufs[1][1], k, v, slots, bufs[1][2], bufs[1][3])
            diffs = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                        for a, b in zip(bufs[0], bufs[1]) if a is not None)
            r.row("correct", f"write_kv {name} (hk 8, d 128, 300 rows)", f"{diffs} bytes differ", "write_kv_ref",
                  "PASS" if diffs == 0 else "FAIL")

    cases = [(4, 128, 16, 8, dt) for dt in dtypes] + [(1, 64, 8, 4, torch.bfloat16), (3, 64, 32, 3, torch.float16),
                                                      (8, 128, 128, 2, torch.bfloat16)]
    lens = [1, 16, 17, 1000, 5000] if not s.dry else [1, 16, 17, 100]
    for group, d, bs, hk, dtype in cases:
        name = str(dtype).replace("torch.", "")
        case = f"paged_decode {name} g{group} d{d} bs{bs} hk{hk}"
        with r.guard("correct", case):
            need = [-(-n // bs) for n in lens]
            nb = sum(need)
            ids = torch.randperm(nb, generator=gen)
            tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
            at = 0
            for i, n in enumerate(need):
                tables[i, :n] = ids[at:at + n]
                at += n
            kc, vc, ks, vs = random_kv(nb, bs, hk, d, dtype, dev)
            q = torch.randn(len(lens), hk * group, d, generator=gen).to(
                torch.bfloat16 if dtype == A.FP8 else dtype).to(dev)
            lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
            tables = tables.to(dev)
            with kernels_on_cpu(s):
                out = kernels.paged_decode(q, kc, vc, tables, lens_t, d ** -0.5, ks, vs)
            ref = A.paged_decode_ref(q, kc, vc, tables, lens_t, d ** -0.5, ks, vs)
            err = (out.float() - ref.float()).abs().max().item()
            atol, rtol = DTYPE_TOL[name]
            ok = torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
            r.row("correct", case, f"max abs err {err:.2e}", f"paged_decode_ref, tol {atol:g}+{rtol:g}x",
                  "PASS" if ok else "FAIL")

    with r.guard("correct", "paged_prefill bf16 (SDPA) vs fp32"):
        nb, bs, hk, hq, d, prefix, t = 96, 16, 8, 32, 128, 700, 300
        table = shuffled_table(nb, dev, gen)
        kc, vc, _, _ = random_kv(nb, bs, hk, d, torch.bfloat16, dev)
        q = torch.randn(t, hq, d, generator=gen).to(torch.bfloat16).to(dev)
        out = A.paged_prefill(q, kc, vc, table, prefix, d ** -0.5)
        ref = A.paged_prefill(q.float(), kc.float(), vc.float(), table, prefix, d ** -0.5)
        err = (out.float() - ref).abs().max().item()
        ok = torch.allclose(out.float(), ref, atol=1e-2, rtol=1.6e-2)
        r.row("correct", "paged_prefill bf16 (SDPA) vs fp32", f"max abs err {err:.2e}", "same path in fp32",
              "PASS" if ok else "FAIL")

    check_fused(r, s, gen)
    for fused in (True, False):
        case = f"graph decode step ({'fused' if fused else 'Llama.forward'}) vs torch reference"
        with r.guard("correct", case):
            check_graph_decoder(r, s, case, fused)


def check_fused(r: Report, s: Setup, gen) -> None:
    """The decode step's fused kernels against their torch forms (engine.cuda_graph.TorchOps)."""
    import torch
    from engine import attention as A
    from engine import kernels
    from engine.cuda_graph import TorchOps
    dev, g = s.device, s.geom
    hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
    act = torch.float32 if s.dry else torch.bfloat16
    with r.guard("correct", "add_rms_norm"):
        x = (torch.randn(1, g.hidden, generator=gen) * 3).to(act).to(dev)
        res = torch.randn(1, g.hidden, generator=gen).to(act).to(dev)
        w = (1 + 0.1 * torch.randn(g.hidden, generator=gen)).to(act).to(dev)
        x_ref = x.clone()
        want = TorchOps.add_rms_norm(x_ref, res, w, g.norm_eps)
        with kernels_on_cpu(s):
            got = kernels.add_rms_norm(x, res, w, g.norm_eps)
        err = (got.float() - want.float()).abs().max().item()
        ok = torch.equal(x, x_ref) and torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
        r.row("correct", f"add_rms_norm {str(act)[6:]} hidden {g.hidden}", f"max abs err {err:.2e}",
              "TorchOps (rms_norm)", "PASS" if ok else "FAIL")
    with r.guard("correct", "silu_mul"):
        gu = (torch.randn(1, 2 * g.intermediate, generator=gen) * 4).to(act).to(dev)
        with kernels_on_cpu(s):
            got = kernels.silu_mul(gu)
        want = TorchOps.silu_mul(gu)
        err = (got.float() - want.float()).abs().max().item()
        ok = torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
        r.row("correct", f"silu_mul {str(act)[6:]} inter {g.intermediate}", f"max abs err {err:.2e}",
              "TorchOps (F.silu)", "PASS" if ok else "FAIL")
    for cache in [act] + ([A.FP8] if A.FP8 is not None else []):
        name = str(cache).replace("torch.", "")
        with r.guard("correct", f"rope_write {name}"):
            t, nb, bs, max_pos = 4, 8, 16, 9000
            qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(act).to(dev)
            ang = torch.rand(max_pos, 1, d // 2, generator=gen) * 6.3
            cos = torch.cat((ang.cos(), ang.cos()), -1).to(act).to(dev)
            sin = torch.cat((ang.sin(), ang.sin()), -1).to(act).to(dev)
            positions = torch.randint(0, max_pos, (t,), generator=gen).to(dev)
            slots = torch.randperm(nb * bs, generator=gen)[:t].to(dev)
            bufs = []
            for _ in range(2):
                c = [torch.zeros(nb, bs, hk, d, device=dev).to(cache) for _ in range(2)]
                sc = [torch.zeros(nb, bs, hk, device=dev) for _ in range(2)] if cache == A.FP8 else [None, None]
                bufs.append(c + sc)
            with kernels_on_cpu(s):
                q_got = kernels.rope_write(qkv, cos, sin, positions, *bufs[0][:2], slots, *bufs[0][2:], hq)
            q_want = TorchOps.rope_write(qkv, cos, sin, positions, *bufs[1][:2], slots, *bufs[1][2:], hq)
            diffs = int((q_got.contiguous().view(torch.uint8) != q_want.contiguous().view(torch.uint8)).sum())
            diffs += sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                         for a, b in zip(bufs[0], bufs[1]) if a is not None)
            r.row("correct", f"rope_write {str(act)[6:]} q, cache {name}", f"{diffs} bytes differ",
                  "TorchOps (apply_rope, write_kv_ref)", "PASS" if diffs == 0 else "FAIL")


def check_graph_decoder(r: Report, s: Setup, case: str, fused: bool) -> None:
    """A 2-layer model of the check's geometry: logits of decode steps replayed from the CUDA
    graph (Triton kernels) against the eager torch reference path, over the same prefill."""
    import torch
    from dataclasses import replace
    from engine.cuda_graph import GraphDecoder
    from engine.kv_cache import KVPool, plan_pool
    from engine.model import Step
    from engine.weights import random_model
    geom = replace(s.geom, n_layers=2)
    dtype = torch.float32 if s.dry else torch.bfloat16
    kv = "fp32" if s.dry else "bf16"
    model = random_model(geom, s.device, dtype, seed=1)
    bs, prompt, steps = 16, 100, 6
    spec = plan_pool(geom, kv, 64 * bs * geom.kv_bytes_per_token(kv), bs)
    order = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(2))[:16].tolist()
    table = torch.tensor(order + [0] * (spec.num_blocks - 16), dtype=torch.int32, device=s.device)

    def slot(p: int) -> int:
        return order[p // bs] * bs + p % bs

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, geom.vocab_size, (prompt,), generator=gen).to(s.device)
    tokens = torch.randint(0, geom.vocab_size, (steps,), generator=gen).tolist()  # the same in both runs
    results = []
    for graphed in (False, True):
        pool = KVPool(geom, spec, s.device)
        step = Step(table, torch.tensor([slot(p) for p in range(prompt)], device=s.device), 0, decode=False)
        model.forward(ids, torch.arange(prompt, device=s.device), step, pool)
        seq = []
        decoder = GraphDecoder(model, pool, use_graph=not s.dry, fused=fused) if graphed else None
        for i, token in enumerate(tokens):
            pos = prompt + i
            if graphed:
                with kernels_on_cpu(s):
                    out = decoder(token, pos, slot(pos), table, pos // bs + 1)
            else:
                with torch_reference_path():
                    st = Step(table, torch.tensor([slot(pos)], device=s.device), pos, decode=True)
                    out = model.forward(torch.tensor([token], device=s.device), torch.tensor([pos], device=s.device),
                                        st, pool)[0]
            seq.append(out.float())
        results.append(seq)
    err = max((a - b).abs().max().item() for a, b in zip(*results))
    scale = max(a.abs().max().item() for a in results[0])
    ok = err <= 5e-2 * max(1.0, scale)
    fallback = f"; fell back: {decoder.fallback}" if decoder.fallback else ""
    r.row("correct", case, f"max abs err {err:.2e}", f"{steps} steps, logits up to {scale:.2f}",
          ("PASS" if ok else "FAIL") + fallback)


# ---- 2. copy bandwidth -------------------------------------------------------------------------
def check_copy_bandwidth(r: Report, s: Setup) -> None:
    import torch
    with r.guard("ceiling", "device-to-device copy"):
        n = (1 << 30) if not s.dry else (1 << 24)
        src = torch.empty(n, dtype=torch.uint8, device=s.device).random_()
        dst = torch.empty_like(src)
        ms = s.timer.eager_ms(lambda: dst.copy_(src), reps=20, warmup=3)
        gbps = 2 * n / ms / 1e6
        r.facts["copy_gbps"] = gbps
        r.row("ceiling", f"device-to-device copy ({n >> 20} MiB)", f"{gbps:,.0f} GB/s", "read + write bytes", "")


# ---- 3. paged decode kernel ----------------------------------------------------------------------
def check_decode_kernel(r: Report, s: Setup) -> None:
    import torch
    from engine import attention as A
    from engine.kernels import DecodeConfig, paged_decode
    g = s.geom
    hk, hq, d, bs = g.n_kv_heads, g.n_heads, g.head_dim, 16
    copy = r.facts.get("copy_gbps")

    def build(ctx: int):
        """Enough distinct caches (one per layer, like the model) that the set is >> L2."""
        per = 2 * ctx * hk * d * 2
        copies = max(1, min(32, math.ceil((1 << 30) / per))) if not s.dry else 2
        nb = -(-ctx // bs)
        sets = []
        for _ in range(copies):
            kc, vc, _, _ = random_kv(nb, bs, hk, d, torch.bfloat16, s.device)
            sets.append((kc, vc, shuffled_table(nb, s.device)[None]))
        q = torch.randn(1, hq, d, device=s.device, dtype=torch.bfloat16)
        lens = torch.tensor([ctx], dtype=torch.int32, device=s.device)
        return sets, q, lens, per

    def kernel_ms(sets, q, lens, cfg=None) -> float:
        with kernels_on_cpu(s):
            return s.timer.graph_ms([lambda kc=kc, vc=vc, t=t: paged_decode(q, kc, vc, t, lens, d ** -0.5, config=cfg)
                                     for kc, vc, t in sets])

    with r.guard("decode", "graph launch floor"):
        tiny = [torch.zeros(1, device=s.device) for _ in range(32)]
        floor = s.timer.graph_ms([lambda t=t: t.add_(1) for t in tiny])
        r.row("decode", "graph launch floor (one tiny kernel)", f"{floor * 1000:.1f} us",
              "per kernel in a CUDA graph", "paged_decode is 2 kernels")

    for ctx in s.decode_contexts:
        case = f"paged_decode {ctx // K if ctx >= K else ctx}{'k' if ctx >= K else ''} ctx, {g.name} layer"
        with r.guard("decode", case):
            sets, q, lens, per = build(ctx)
            ms = kernel_ms(sets, q, lens)
            gbps = per / ms / 1e6
            frac = gbps / copy if copy else float("nan")
            peer = ""
            with r.guard("decode", case + " (torch peer)"):
                if ctx <= 32 * K:
                    kc, vc, t = sets[0]
                    tms = s.timer.eager_ms(lambda: A.decode_one(q[0], kc, vc, t[0], ctx, d ** -0.5), reps=5)
                    peer = f"torch gather+matmul {tms * 1000:.0f} us"
            verdict = ""
            if ctx >= 8 * K and copy:
                verdict = f"{'PASS' if frac >= TARGET_DECODE_BW else 'FAIL'} (target >= {TARGET_DECODE_BW:.0%})"
            r.row("decode", case, f"{ms * 1000:.1f} us {gbps:,.0f} GB/s {frac:.0%}", peer, verdict)
            r.facts.setdefault("decode_frac", {})[ctx] = frac

    if s.quick:
        return
    sweep = [DecodeConfig(), DecodeConfig(block_n=32), DecodeConfig(block_n=128), DecodeConfig(num_warps=8),
             DecodeConfig(num_stages=3), DecodeConfig(num_stages=4), DecodeConfig(waves=2), DecodeConfig(waves=8),
             DecodeConfig(block_n=128, num_warps=8, num_stages=3), DecodeConfig(block_n=32, waves=8)]
    for ctx in (8 * K, 32 * K):
        with r.guard("sweep", f"{ctx // K}k"):
            sets, q, lens, per = build(ctx)
            best = None
            for cfg in sweep:
                name = f"bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} waves{cfg.waves}"
                with r.guard("sweep", f"{ctx // K}k {name}"):
                    ms = kernel_ms(sets, q, lens, cfg)
                    gbps = per / ms / 1e6
                    r.row("sweep", f"{ctx // K}k {name}", f"{ms * 1000:.1f} us {gbps:,.0f} GB/s",
                          f"{gbps / copy:.0%} of copy" if copy else "", "default" if cfg == DecodeConfig() else "")
                    if best is None or gbps > best[0]:
                        best = (gbps, name)
            if best:
                r.row("sweep", f"{ctx // K}k best", f"{best[0]:,.0f} GB/s", best[1], "")


# ---- 4. prefill over a cached prefix ------------------------------------------------------------
def check_prefill(r: Report, s: Setup) -> None:
    import torch
    import torch.nn.functional as F
    from engine import attention as A
    g = s.geom
    hk, hq, d, bs, t = g.n_kv_heads, g.n_heads, g.head_dim, 16, s.prefill_chunk
    dt = torch.float32 if s.dry else torch.bfloat16
    with r.guard("prefill", "layer matmuls"):
        x = torch.randn(t, g.hidden, device=s.device, dtype=dt)
        shapes = (((hq + 2 * hk) * d, g.hidden), (g.hidden, hq * d), (2 * g.intermediate, g.hidden),
                  (g.hidden, g.intermediate))
        w = [torch.randn(n, m, device=s.device, dtype=dt) * 0.02 for n, m in shapes]

        def matmuls():
            h = x @ w[0].T
            o = h[:, :hq * d] @ w[1].T
            gu = o @ w[2].T
            return gu[:, :g.intermediate] @ w[3].T
        mm = s.timer.eager_ms(matmuls, reps=5)
        r.row("prefill", f"layer matmuls, chunk {t}", f"{mm:.3f} ms", "qkv, o, gate_up, down", "")
        r.facts["prefill_matmul_ms"] = mm
        del x, w
    for prefix in s.prefill_prefixes:
        total = prefix + t
        nb = -(-total // bs)
        label = f"{prefix // K}k" if prefix >= K else str(prefix)
        with r.guard("prefill", f"prefix {label} + {t}"):
            kc, vc, _, _ = random_kv(nb, bs, hk, d, dt, s.device)
            q = torch.randn(t, hq, d, device=s.device, dtype=dt)
            shuffled = shuffled_table(nb, s.device)
            ascending = torch.arange(nb, dtype=torch.int32, device=s.device)
            sc = d ** -0.5
            paged_shuf = s.timer.eager_ms(lambda: A.paged_prefill(q, kc, vc, shuffled, prefix, sc), reps=5)
            paged_asc = s.timer.eager_ms(lambda: A.paged_prefill(q, kc, vc, ascending, prefix, sc), reps=5)
            k_c = kc.view(nb * bs, hk, d)[:total].transpose(0, 1).contiguous()      # (hk, S, d)
            v_c = vc.view(nb * bs, hk, d)[:total].transpose(0, 1).contiguous()
            qt = q.transpose(0, 1)                                                    # (hq, T, d)
            mask = torch.ones(t, total, dtype=torch.bool, device=s.device).tril(diagonal=prefix)
            k_x, v_x = k_c.repeat_interleave(hq // hk, 0), v_c.repeat_interleave(hq // hk, 0)
            # the engine's own call, on K/V already contiguous and expanded: what gathering costs
            kw = dict(is_causal=True) if prefix == 0 else dict(attn_mask=mask)
            ideal = s.timer.eager_ms(lambda: F.scaled_dot_product_attention(qt, k_x, v_x, scale=sc, **kw), reps=5)
            gqa = float("nan")
            with contextlib.suppress(TypeError, RuntimeError):
                gqa = s.timer.eager_ms(lambda: F.scaled_dot_product_attention(
                    qt, k_c, v_c, scale=sc, enable_gqa=True, **kw), reps=5)
            # No mask tensor at all: the lower-right causal bias lets SDPA pick its fused
            # kernels for "query i sees keys <= prefix + i" (torch.nn.attention.bias).
            lower_right = float("nan")
            with contextlib.suppress(ImportError, TypeError, RuntimeError):
                from torch.nn.attention.bias import causal_lower_right
                bias = causal_lower_right(t, total)
                lower_right = s.timer.eager_ms(lambda: F.scaled_dot_product_attention(
                    qt, k_x, v_x, attn_mask=bias, scale=sc), reps=5)
            mm = r.facts.get("prefill_matmul_ms", float("nan"))
            overhead = paged_shuf / ideal - 1
            r.row("prefill", f"prefix {label} + {t}: engine path, shuffled table", f"{paged_shuf:.3f} ms",
                  f"contiguous SDPA {ideal:.3f} ms", f"gather+repeat {overhead:+.0%}")
            r.row("prefill", f"prefix {label} + {t}: engine path, ascending table", f"{paged_asc:.3f} ms",
                  f"SDPA enable_gqa {gqa:.3f} ms", f"attention {paged_shuf / (paged_shuf + mm):.0%} of layer")
            r.row("prefill", f"prefix {label} + {t}: SDPA causal_lower_right", f"{lower_right:.3f} ms",
                  "contiguous, no mask tensor", f"{ideal / lower_right:.2f}x the masked SDPA's speed")


# ---- 5. end to end ------------------------------------------------------------------------------
def make_engine(s: Setup, budget_tokens: int):
    """The engine on random weights of the check's geometry. The tokenizer is skipped: random
    token ids need none, and the GPU machine may lack the bundled model it would load."""
    from engine import engine as engine_mod
    from engine.engine import Engine, EngineConfig
    from engine.weights import ModelSource
    src = ModelSource(s.geom.name, s.geom, None, Path("."), random_weights=True)
    budget = budget_tokens * s.geom.kv_bytes_per_token("fp32" if s.dry else "bf16")
    real = engine_mod.load_tokenizer
    engine_mod.load_tokenizer = lambda src: None
    try:
        return Engine(EngineConfig(model=s.geom.name, random_weights=True, kv_budget=budget,
                                   device="cpu" if s.dry else "auto"), source=src)
    finally:
        engine_mod.load_tokenizer = real


def engine_decode_ms(s: Setup, engine, ctx: int, fused: bool = True) -> float:
    """Fill a conversation's cache with ctx random tokens (prefill), then time decode steps
    the way Conversation's turn loop runs them: make room, decode, read the greedy token.
    fused=False installs a decoder that captures Llama.forward itself instead."""
    import torch
    from engine import cuda_graph
    if s.device.type == "cuda":
        dec = cuda_graph.decoder_for(engine.model, engine.pool)
        if dec.fused != fused and dec.fallback is None:
            cuda_graph._DECODERS[engine.model] = cuda_graph.GraphDecoder(engine.model, engine.pool, fused=fused)
    conv = engine.new_conversation()
    try:
        ids = torch.randint(0, s.geom.vocab_size, (ctx,)).tolist()
        conv._claim(ids)
        logits = conv._prefill(ids, 0)
        token, pos = int(logits.argmax()), ctx
        times = []
        for i in range(s.decode_steps + 3):
            t0 = time.perf_counter()
            conv._make_room_for(pos)
            with kernels_on_cpu(s):
                logits = conv._decode(token, pos)
            token = int(logits.argmax())
            times.append(time.perf_counter() - t0)
            pos += 1
        times = sorted(times[3:])  # the first steps capture the graph
        return 1000 * times[len(times) // 2]
    finally:
        engine.close_conversation(conv)


class ContiguousSDPA:
    """A plain torch decode loop over the same weights: one contiguous (hk, max_len, d) K and V
    per layer, F.scaled_dot_product_attention over the first pos+1 rows. The peer a paged
    cache has to keep up with."""

    def __init__(self, model, max_len: int) -> None:
        import torch
        g = model.geom
        self.model = model
        if model._cos.shape[0] < max_len:
            model._extend_rope(max_len)  # the step indexes the table directly
        shape = (g.n_layers, 1, g.n_kv_heads, max_len, g.head_dim)
        self.k = torch.randn(shape, device=model.device, dtype=model.dtype)
        self.v = torch.randn(shape, device=model.device, dtype=model.dtype)

    def step(self, ids, positions, pos: int):
        import torch
        import torch.nn.functional as F
        from engine.model import apply_rope, rms_norm
        m, g = self.model, self.model.geom
        hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
        with torch.inference_mode():
            cos, sin = m._cos[positions], m._sin[positions]
            x = m.embed[ids]                                                    # (1, hidden)
            for i, layer in enumerate(m.layers):
                h = rms_norm(x, layer.attn_norm, g.norm_eps)
                q, k, v = (h @ layer.wqkv.T).split((hq * d, hk * d, hk * d), dim=-1)
                q = apply_rope(q.view(1, hq, d), cos, sin)                      # (1, hq, d)
                k = apply_rope(k.view(1, hk, d), cos, sin)
                self.k[i, 0, :, pos] = k[0]
                self.v[i, 0, :, pos] = v.view(hk, d)
                o = F.scaled_dot_product_attention(q.view(1, hq, 1, d), self.k[i, :, :, :pos + 1],
                                                   self.v[i, :, :, :pos + 1], scale=m.scale, enable_gqa=True)
                x = x + o.reshape(1, hq * d) @ layer.wo.T
                x = x + m._mlp(x, layer)
            return m._logits(x)

    def eager_ms(self, ctx: int, steps: int) -> float:
        import torch
        dev = self.model.device
        token, times = 1, []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            pos = ctx + i
            logits = self.step(torch.tensor([token], device=dev), torch.tensor([pos], device=dev), pos)
            token = int(logits.argmax())
            times.append(time.perf_counter() - t0)
        times = sorted(times[2:])
        return 1000 * times[len(times) // 2]


def hf_llama(s: Setup):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    g = s.geom
    cfg = dict(vocab_size=g.vocab_size, hidden_size=g.hidden, intermediate_size=g.intermediate,
               num_hidden_layers=g.n_layers, num_attention_heads=g.n_heads, num_key_value_heads=g.n_kv_heads,
               head_dim=g.head_dim, max_position_embeddings=g.max_position, rms_norm_eps=g.norm_eps,
               tie_word_embeddings=g.tie_embeddings, rope_theta=g.rope_theta)
    if g.rope_scaling:
        cfg["rope_scaling"] = dict(g.rope_scaling)
    config = LlamaConfig(**cfg, attn_implementation="sdpa")
    dtype = torch.float32 if s.dry else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(s.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def hf_decode_ms(s: Setup, model, ctx: int) -> float:
    """(time of generate with 1 + N new tokens - time with 1) / N: decode alone, prefill excluded."""
    import torch
    ids = torch.randint(0, s.geom.vocab_size, (1, ctx), device=s.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        s.timer.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        s.timer.sync()
        return time.perf_counter() - t0

    run(2)
    one = run(1)
    many = run(1 + s.decode_steps)
    return 1000 * (many - one) / s.decode_steps


def check_end_to_end(r: Report, s: Setup) -> None:
    import torch
    copy = r.facts.get("copy_gbps")
    engine = None
    ms_engine: dict[int, float] = {}
    with r.guard("e2e", "engine set-up"):
        t0 = time.perf_counter()
        engine = make_engine(s, max(s.e2e_contexts) + 4 * K)
        model = engine.model
        r.facts["weight_bytes"] = model.weight_bytes
        read = model.weight_bytes - (model.embed.nbytes if model.lm_head is not model.embed else 0)
        r.facts["weights_read"] = read
        r.row("e2e", f"engine: {s.geom.name}, random weights, {engine.dtype_name}",
              f"{model.weight_bytes / 1e9:.2f} GB weights",
              f"{read / 1e9:.2f} GB read per token", f"set-up {time.perf_counter() - t0:.1f} s")
    if engine is None:
        return
    del model  # the engine holds it; freeing the engine below must free the weights
    kv_per_token = s.geom.kv_bytes_per_token("fp32" if s.dry else "bf16")
    for ctx in s.e2e_contexts:
        label = f"{ctx // K}k" if ctx >= K else str(ctx)
        with r.guard("e2e", f"engine decode {label}"):
            ms = engine_decode_ms(s, engine, ctx)
            ms_engine[ctx] = ms
            verdict, peer = "", ""
            if copy:
                roof_w = r.facts["weights_read"] / copy / 1e6
                roof_all = (r.facts["weights_read"] + ctx * kv_per_token) / copy / 1e6
                peer = f"roofline {roof_w:.2f} ms (+KV {roof_all:.2f})"
                verdict = f"{roof_w / ms:.0%} of weight roofline"
                if ctx == 1 * K:
                    hit = roof_w / ms >= TARGET_ROOFLINE_1K
                    verdict += f" {'PASS' if hit else 'FAIL'} (>= {TARGET_ROOFLINE_1K:.0%})"
            dec = None
            with contextlib.suppress(Exception):
                from engine import cuda_graph
                dec = cuda_graph._DECODERS.get(engine.model)
            if dec is not None and dec.fallback:
                verdict += f" (fused step fell back: {dec.fallback[:60]})"
            r.row("e2e", f"engine decode {label} (fused graph + kernels)", f"{ms:.2f} ms/token", peer, verdict)
            with r.guard("e2e", f"engine decode {label}, unfused graph"):
                plain = engine_decode_ms(s, engine, ctx, fused=False)
                r.row("e2e", f"engine decode {label}, graph of Llama.forward", f"{plain:.2f} ms/token",
                      "unfused: norms, RoPE, silu in torch", f"fusion saves {plain - ms:.2f} ms/token")
    r.facts["engine_ms"] = ms_engine

    with r.guard("e2e", "torch SDPA contiguous cache"):
        sdpa = ContiguousSDPA(engine.model, max(s.e2e_contexts) + s.decode_steps + 8)
        for ctx in s.e2e_contexts:
            label = f"{ctx // K}k" if ctx >= K else str(ctx)
            with r.guard("e2e", f"torch SDPA contiguous {label}"):
                eager = sdpa.eager_ms(ctx, s.decode_steps)
                dev = engine.device
                ids, pos_t = torch.tensor([1], device=dev), torch.tensor([ctx], device=dev)
                graphed = s.timer.graph_ms([lambda: sdpa.step(ids, pos_t, ctx)], reps=s.decode_steps)
                mine = ms_engine.get(ctx)
                r.row("e2e", f"torch SDPA contiguous {label}", f"{eager:.2f} ms/token eager",
                      f"{graphed:.2f} ms graph-captured", f"engine {eager / mine:.2f}x as fast as eager, "
                      f"{graphed / mine:.2f}x as graphed" if mine else "")
        del sdpa
    engine.pool = None
    del engine
    free_memory()

    with r.guard("e2e", "transformers generate"):
        t0 = time.perf_counter()
        hf = hf_llama(s)
        r.row("e2e", "transformers LlamaForCausalLM (random, sdpa)", f"set-up {time.perf_counter() - t0:.1f} s", "", "")
        for ctx in s.e2e_contexts:
            label = f"{ctx // K}k" if ctx >= K else str(ctx)
            with r.guard("e2e", f"transformers generate {label}"):
                ms = hf_decode_ms(s, hf, ctx)
                mine = ms_engine.get(ctx)
                verdict = ""
                if mine:
                    verdict = f"{'PASS' if mine < ms else 'FAIL'}: engine {ms / mine:.2f}x as fast"
                r.row("e2e", f"transformers generate {label}", f"{ms:.2f} ms/token", "DynamicCache, sdpa", verdict)
                r.facts.setdefault("hf_ms", {})[ctx] = ms
        del hf


# ---- main -------------------------------------------------------------------------------------
def environment(r: Report, s: Setup) -> None:
    import torch
    with r.guard("env", "versions"):
        import triton
        try:
            import transformers
            tv = transformers.__version__
        except ImportError:
            tv = "missing"
        r.row("env", "torch / triton / transformers", f"{torch.__version__} / {triton.__version__} / {tv}", "", "")
    if s.device.type == "cuda":
        with r.guard("env", "device"):
            p = torch.cuda.get_device_properties(s.device)
            r.row("env", "device", p.name, f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB",
                  f"cc {p.major}.{p.minor}")
    with r.guard("env", "engine.kernels import"):
        import engine.kernels  # noqa: F401  (an ImportError here is the row's finding)
        r.row("env", "engine.kernels import", "ok", "", "")


SECTIONS = {  # name: (function, seconds before the section is stopped)
    "env": (lambda r, s: environment(r, s), 90),
    "correctness": (lambda r, s: check_correctness(r, s), 150),
    "copy": (lambda r, s: check_copy_bandwidth(r, s), 45),
    "decode": (lambda r, s: check_decode_kernel(r, s), 150),
    "prefill": (lambda r, s: check_prefill(r, s), 90),
    "e2e": (lambda r, s: check_end_to_end(r, s), 240),
}


def run_section(name: str, args, state: Path) -> None:
    """In a child process: run one section, adding its rows and facts to the state file."""
    s = make_setup(args)
    saved = json.loads(state.read_text())
    r = Report(rows=saved["rows"], facts=saved["facts"])
    fn, _ = SECTIONS[name]
    with r.guard(name, "section"):
        fn(r, s)
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(rows=r.rows, facts=r.facts), default=str))
    tmp.replace(state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer contexts, no launch-parameter sweep")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--cpu-dry-run", action="store_true", help="exercise the script on CPU (tiny model)")
    ap.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)  # internal: one child's part
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before engine.kernels is imported
    import torch
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    if args.section:
        run_section(args.section, args, args.state)
        return 0

    # Each section runs in its own process, so that a sticky CUDA error (an illegal address,
    # a device-side assert) or a hang costs that section only; rows print as they come.
    import subprocess
    import tempfile
    t0 = time.perf_counter()
    header()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        state.write_text(json.dumps(dict(rows=[], facts={})))
        flags = [f for f, on in (("--quick", args.quick), ("--cpu-dry-run", args.cpu_dry_run)) if on]
        for name, (_, limit) in SECTIONS.items():
            before = state.read_text()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--state", str(state), *flags]
            try:
                code = subprocess.run(cmd, timeout=limit).returncode
                problem = f"exit status {code}" if code else ""
            except subprocess.TimeoutExpired:
                problem = f"stopped after {limit} s"
            if problem:
                try:
                    saved = json.loads(state.read_text())
                except ValueError:  # the child died while writing it
                    saved = json.loads(before)
                r = Report(rows=saved["rows"], facts=saved["facts"])
                r.row(name, "section", "ERROR", "child process", problem)
                state.write_text(json.dumps(dict(rows=r.rows, facts=r.facts), default=str))
        saved = json.loads(state.read_text())
    r = Report(rows=saved["rows"], facts=saved["facts"])
    summary(r)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=r.rows, facts=r.facts), indent=1, default=str))
    return 0


def summary(r: Report) -> None:
    """The verdicts again, in one place: correctness checks and the issue's targets."""
    print("\nverdicts")
    counts = {"PASS": 0, "FAIL": 0, "ERROR": 0}
    for row in r.rows:
        v = row["verdict"]
        kind = "ERROR" if row["value"] == "ERROR" else "FAIL" if "FAIL" in v else "PASS" if "PASS" in v else None
        if kind:
            counts[kind] += 1
            print(f"  {row['section']:<10} {row['case']:<48} {v if kind != 'ERROR' else row['verdict']}")
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['ERROR']} errors")


if __name__ == "__main__":
    sys.exit(main())
