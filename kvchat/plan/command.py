"""`kvchat plan`: its flags, their checks, and what each mode runs.

    kvchat plan [--model M] [--gpu NAME] [--tp N] [--pool 15GB] [--users N] [...]   one plan
    kvchat plan --scenario seeds                                                  the texts' question
    kvchat plan --list-gpus                                                       the hardware table
    kvchat plan --calibrate BENCH.json[,BATCH.json] --write-calibration CAL.json  constants from benches
    kvchat plan --calibration CAL.json ...                                        a plan with them

argparse only at import: the simulation's modules load when the command runs.
"""
from __future__ import annotations

import argparse

from ..cli.args import UsageError, float_in, int_at_least, positive_int
from .options import DEFAULTS



def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="simulate N users on hardware you may not have (a vLLM-like scheduler "
                                           "over a roofline step time): TTFT, TPOT, ITL, preemptions")
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", "-m", metavar="M", default=None, help="alias (llama-3.1-8b, llama-3.1-70b, llama-2-7b, smollm2-135m), "
                                                       "a config.json, or a directory holding one (default llama-3.1-8b)")
    m.add_argument("--geometry", metavar="SPEC", default=None, help="an alias, or layers=L,hidden=H,heads=N,kv_heads=K,head_dim=D,"
                                                   "intermediate=I,vocab=V[,max_position=P]")
    m.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp8", "fp32"),
                   help="weights (default bf16; fp32 on the cpu row, as kvchat's engine runs there)")
    m.add_argument("--kv-dtype", default="auto", choices=("auto", "bf16", "fp16", "fp8", "fp32"),
                   help="KV cache (default: the weights' dtype; bf16 under fp8 weights)")
    m.add_argument("--gpu", metavar="NAME", default=None, help="a row of the hardware table (--list-gpus), or cpu (this "
                                                     "machine, measured); default h100-sxm")
    m.add_argument("--tp", metavar="N", type=positive_int("--tp", 64), default=1, help="tensor-parallel GPUs (default 1)")
    m.add_argument("--list-gpus", action="store_true", help="print the hardware table with its sources and stop")
    s = p.add_argument_group("pool and scheduler")
    s.add_argument("--pool", default=None, metavar="BYTES", help="KV pool size, all GPUs together, e.g. 15GB "
                                                               "(default: what the memory leaves after the weights)")
    s.add_argument("--memory-utilization", metavar="F", type=float_in("--memory-utilization", 0.0, 1.0, lo_open=True),
                   default=0.9, help="share of each GPU's memory for weights and pool (vLLM's default 0.9)")
    s.add_argument("--block-size", metavar="N", type=positive_int("--block-size", 4096), default=16)
    s.add_argument("--max-batched-tokens", metavar="N", type=positive_int("--max-batched-tokens", 1_000_000), default=None,
                   help="token budget per step (default: vLLM's API server's, 8192 on GPUs of 70 GiB or more but the "
                        "A100, else 2048)")
    s.add_argument("--max-seqs", metavar="N", type=positive_int("--max-seqs", 100_000), default=None,
                   help="most sequences running at once (default: vLLM's, 1024 or 256 by the same rule)")
    s.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    s.add_argument("--cap", metavar="N", type=positive_int("--cap", 2**31 - 1), default=None, help="per-request cap in tokens")
    s.add_argument("--policy", metavar="NAME", default="stop", help="at the cap: stop (refuse the turn), drop-oldest (drop old turns), "
                                                    "sink-window (keep a window)")
    w = p.add_argument_group("workload")
    w.add_argument("--users", metavar="N", type=positive_int("--users", 1_000_000), default=None,
                   help=f"conversations (default {DEFAULTS['users']})")
    w.add_argument("--rate", metavar="R", type=float_in("--rate", 0.0, 1e6, lo_open=True), default=None,
                   help="users arriving per second, Poisson (default: all start within --ramp)")
    w.add_argument("--ramp", metavar="S", default=None, help=f"seconds over which the users' first messages spread (default "
                                                f"{DEFAULTS['ramp']})")
    for flag, what in (("turns", "turns per user"), ("think", "seconds between a reply and the next message"),
                       ("context", "tokens of history a user starts with"),
                       ("message", "tokens each turn adds (message and template)"), ("reply", "reply tokens")):
        w.add_argument(f"--{flag}", default=None, metavar="DIST", help=f"{what}: N, A-B, exp:MEAN or lognormal:MEDIAN,SIGMA "
                                                       f"(default {DEFAULTS[flag]})")
    w.add_argument("--system-prompt", type=int_at_least("--system-prompt", 0, 10_000_000), default=0,
                   metavar="TOKENS", help="a system prompt every user shares (default 0)")
    w.add_argument("--long", type=positive_int("--long", 10_000_000), default=None, metavar="TOKENS",
                   help="one more user, from t=0, with this much history (the texts' long chat)")
    w.add_argument("--seed", metavar="N", type=int_at_least("--seed", 0, 2**63 - 1), default=0)
    w.add_argument("--trace", default=None, metavar="FILE", help="replay these users (a file --save-trace wrote)")
    w.add_argument("--save-trace", default=None, metavar="FILE", help="write the simulated users as a trace")
    o = p.add_argument_group("constants and output")
    o.add_argument("--calibration", default=None, metavar="FILE", help="step-time constants fitted by --calibrate")
    o.add_argument("--bw-efficiency", metavar="F", type=float_in("--bw-efficiency", 0.0, 1.5, lo_open=True), default=None,
                   help="share of the bandwidth reached, weights and cache (default 0.8)")
    o.add_argument("--flops-efficiency", metavar="F", type=float_in("--flops-efficiency", 0.0, 1.5, lo_open=True), default=None,
                   help="share of the dense FLOP/s reached (default 0.45)")
    o.add_argument("--overhead-ms", metavar="MS", type=float_in("--overhead-ms", 0.0, 10_000.0), default=None,
                   help="fixed time per step (default 1 ms)")
    o.add_argument("--slo", metavar="SPEC", default="ttft=2s,tpot=100ms", help="goodput objectives (default ttft=2s,tpot=100ms)")
    o.add_argument("--horizon", metavar="S", default=None, help="stop the simulated clock here, e.g. 1h (default: when all finish)")
    o.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="write a PNG of the pool and the TTFTs")
    o.add_argument("--no-terminal-plot", action="store_true", help="leave the text chart out")
    x = p.add_argument_group("modes")
    x.add_argument("--scenario", metavar="NAME", default=None, help="seeds: the texts' question (Llama 3.1 70B, 15 GB pool, one user "
                                                    "at 30,000 tokens among others) and its remedies, one row each")
    x.add_argument("--calibrate", nargs="?", const="", default=None, metavar="BENCH.json",
                   help="fit the step-time constants to `kvchat bench --json` records (a single bench, a `--batch` one, "
                        "or both: A.json,B.json), or with --server URL to a vLLM server's own histograms under "
                        "probe requests (--gpu names the server's hardware)")
    x.add_argument("--write-calibration", default=None, metavar="FILE", help="with --calibrate: save the constants")
    x.add_argument("--probe-context", metavar="N", type=int_at_least("--probe-context", 64, 131_072), default=None,
                   help="with --calibrate --server: the longest context probed (default 2048; the others are N/8 and "
                        "N/2); a slow server, such as vLLM on a CPU, calibrates within minutes at 512")
    x.add_argument("--validate", action="store_true",
                   help="run the workload's users for real through kvchat's engine on this CPU (and --server's), at "
                        "three loads, and set the simulation, calibrated on another run, beside each")
    x.add_argument("--server", default=None, metavar="URL", help="with --validate: a vLLM server to run the users "
                                                                 "through too; with --calibrate: the server to probe")
    return p


def run(args) -> int:
    from ..bench.flags import output_path
    if args.list_gpus:
        return list_gpus()
    modes = [f for f, on in (("--scenario", args.scenario is not None), ("--calibrate", args.calibrate is not None),
                             ("--validate", args.validate)) if on]
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)}: one mode at a time")
    if args.write_calibration and args.calibrate is None:
        raise UsageError("--write-calibration goes with --calibrate (it saves the constants fitted)")
    if args.server and not (args.validate or args.calibrate is not None):
        raise UsageError("--server goes with --validate or --calibrate")
    if args.probe_context is not None and not (args.server and args.calibrate is not None):
        raise UsageError("--probe-context goes with --calibrate --server URL (the probes' longest context)")
    json_path = output_path("--json", args.json)
    plot_path = output_path("--plot", args.plot, ".png")
    save = output_path("--save-trace", args.save_trace)
    if args.calibrate is not None:
        return run_calibrate(args, output_path("--write-calibration", args.write_calibration))
    if args.scenario is not None:
        from .scenario import run_scenario
        return run_scenario(args, json_path, plot_path)
    if args.validate:
        from .validate import run_validate
        return run_validate(args, json_path)
    from .options import plan_config
    from .planner import run_plan
    from .plot import terminal, write_png
    from .report import print_report, record, write_json
    cfg = plan_config(args)
    result = run_plan(cfg)
    if save is not None:
        from .workload import write_trace
        write_trace(save, result.trace, cfg.workload.describe())
    print_report(result, None if args.no_terminal_plot else terminal(result))
    if json_path is not None:
        write_json(json_path, record(result))
    if plot_path is not None:
        write_png(plot_path, result)
    return 0


def list_gpus() -> int:
    from .hardware import TABLE
    print(f"{'key':<16}{'name':<27}{'memory':>9}{'bandwidth':>12}{'bf16 dense':>13}{'fp8 dense':>12}{'link':>10}")
    for h in TABLE.values():
        fp8 = f"{h.fp8_flops / 1e12:,.0f} TF" if h.fp8_flops else "none"
        link = f"{h.link_bandwidth / 1e9:,.0f} GB/s" if h.link_bandwidth else "none"
        print(f"{h.key:<16}{h.name:<27}{h.memory_bytes / 2**30:>6.0f} GiB{h.bandwidth / 1e12:>8.2f} TB/s"
              f"{h.bf16_flops / 1e12:>10,.0f} TF{fp8:>12}{link:>10}")
        print(f"{'':<16}{h.source}: {h.quoted}")
    print("cpu             this machine, measured when named (bandwidth, fp32 FLOP/s, available memory)")
    print("link: one direction, per GPU; FLOP/s: dense tensor rates (the sheets' sparse figures halved)")
    return 0


def run_calibrate(args, out_path) -> int:
    """--calibrate BENCH.json, or --calibrate --server URL: fit the constants, print the fit
    point by point, save them."""
    import json

    from .calibration import calibration_from_fit, costs_for
    from .fitter import fit
    from .step_time import DEFAULT_BW_EFF, DEFAULT_OVERHEAD_MS
    if args.calibrate:
        from .bench_points import from_bench_json
        data = from_bench_json(args.calibrate, args.gpu)
    elif args.server:
        from .server_probe import from_server
        data = from_server(args)
    else:
        raise UsageError("--calibrate needs a `kvchat bench --json` record (--calibrate BENCH.json) or a server "
                         "(--calibrate --server URL)")
    costs = costs_for(data.geometry, data.dtype, {p.kv_dtype for p in data.points}, kv_scales=data.kv_scales)
    bw = data.bandwidth
    prior = {"overhead": DEFAULT_OVERHEAD_MS / 1e3, "row": 0.0, "weight": 1 / (bw * DEFAULT_BW_EFF),
             "kv": 1 / (bw * DEFAULT_BW_EFF), "lin": 1e-12, "attn": 1e-12, "request": 0.0}
    model_kv = data.dtype if data.dtype in {p.kv_dtype for p in data.points} else data.points[0].kv_dtype
    f = fit(data.points, costs, prior, model_kv=model_kv)
    cal = calibration_from_fit(f, data.hardware, data.model, data.dtype, bw, data.bandwidth_source, data.source,
                               data.points)
    print(f"kvchat plan --calibrate: {len(data.points)} measured points of {data.source}")
    print(f"  model {data.model} ({data.dtype}), hardware {data.hardware}")
    print(f"{'point':<44}{'measured ms':>13}{'fitted ms':>11}{'error':>8}")
    for p, ms in zip(data.points, f.predicted_ms):
        print(f"{p.what:<44}{p.ms:>13,.2f}{ms:>11,.2f}{(ms - p.ms) / p.ms:>8.1%}")
    print(f"mean absolute percentage error of the fit: {f.mape(data.points):.1%}")
    for kv in sorted(cal.kv_efficiency):
        print(f"  kv_bw_efficiency ({kv}) {cal.kv_efficiency[kv]:>10.3g}   {cal.sources['kv_bw_efficiency']}")
    for name, const in cal.overrides(model_kv).items():
        if name != "kv_bw_efficiency":
            print(f"  {name:<22} {const.text():>14}   {const.source}")
    if out_path is not None:
        out_path.write_text(json.dumps(cal.to_dict(), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out_path}")
    return 0
