"""GPU check: the Triton kernels and the CUDA decode path, measured on one GPU in one run.

    python benchmarks/gpu_check.py            # the full check, under 5 minutes on one H200
    python benchmarks/gpu_check.py --quick    # fewer contexts, no launch-parameter sweep
    python benchmarks/gpu_check.py --json out.json

Prints one table, a row at a time, then the targets of the kernels issue:
1. correctness: each kernel against its torch reference on CUDA (write_kv bit for bit,
   paged_decode max abs error, the SDPA prefill in bf16 against fp32, the graph-captured
   decode step against the eager torch reference path, and batches of 3 and 5 sequences
   replayed from the graphs of buckets 4 and 8 (padded rows writing nothing) against each
   sequence decoded alone);
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
   own LlamaForCausalLM.generate on the same geometry; with the weight-read roofline; then
   the step time and aggregate tokens/s of 1, 4 and 16 sequences decoding together through
   the engine's scheduler at 1k.

Every section runs in its own try/except: a failure prints its error in that row and the rest
still run. Without CUDA it prints "no CUDA device: nothing to check" and exits 0.
`--cpu-dry-run` runs every section on a tiny geometry on the CPU (kernels interpreted) to
check the script itself; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_common import (K, TARGET_DECODE_BW, Report, Setup, header, kernels_on_cpu,  # noqa: E402
                        make_setup, random_kv, shuffled_table)
from gpu_correctness import check_correctness  # noqa: E402
from gpu_e2e import check_end_to_end  # noqa: E402


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
    from kvchat.engine import attention as A
    from kvchat.engine.kernels import DecodeConfig, paged_decode
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

    if not s.sweep:
        return
    sweep = [DecodeConfig(), DecodeConfig(block_n=32), DecodeConfig(block_n=128), DecodeConfig(num_warps=8),
             DecodeConfig(num_stages=3), DecodeConfig(num_stages=4), DecodeConfig(waves=2), DecodeConfig(waves=8),
             DecodeConfig(waves=16), DecodeConfig(block_n=128, waves=8), DecodeConfig(num_warps=8, waves=8),
             DecodeConfig(block_n=128, num_warps=8, num_stages=3), DecodeConfig(block_n=32, waves=8),
             DecodeConfig(block_n=32, waves=16)]
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
    from kvchat.engine import attention as A
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
        import kvchat.engine.kernels  # noqa: F401  (an ImportError here is the row's finding)
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
    ap.add_argument("--sweep", action="store_true", help="with --quick: the decode kernel's launch-parameter sweep too")
    ap.add_argument("--only", metavar="NAME,...", help=f"these sections alone ({', '.join(SECTIONS)})")
    ap.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)  # internal: one child's part
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else list(SECTIONS)
    if set(only) - set(SECTIONS):
        ap.error(f"--only: unknown section(s) {', '.join(sorted(set(only) - set(SECTIONS)))}; "
                 f"accepted: {', '.join(SECTIONS)}")
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
        flags = [f for f, on in (("--quick", args.quick), ("--cpu-dry-run", args.cpu_dry_run), ("--sweep", args.sweep))
                 if on]
        for name, (_, limit) in SECTIONS.items():
            if name not in only:
                continue
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
    # on the engine's compute thread, where the engines' steps run: one thread for the CUDA
    # streams and graphs, and one OpenMP pool in the process (engine/compute.py)
    from kvchat.engine import compute  # noqa: E402  (no triton import: TRITON_INTERPRET is set in main)
    sys.exit(compute.run(main))
