"""Section 1 of the GPU check: every kernel against its torch reference on the device."""
from __future__ import annotations



from gpu_common import Report, Setup, kernels_on_cpu, random_kv, shuffled_table, torch_reference_path


# ---- 1. correctness ----------------------------------------------------------------------------
DTYPE_TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2),
             "float8_e4m3fn": (1e-2, 1.6e-2)}  # (atol, rtol), as in tests/test_kernels.py


def check_correctness(r: Report, s: Setup) -> None:
    import torch
    from kvchat.engine import attention as A
    from kvchat.engine import kernels
    dtypes = [torch.bfloat16, torch.float16, torch.float32] + ([A.FP8] if A.FP8 is not None else [])
    dev = s.device
    gen = torch.Generator().manual_seed(0)

    t = 300 if not s.dry else 48          # the interpreter's time grows with the rows
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        with r.guard("correct", f"write_kv {name} (hk 8, d 128, {t} rows)"):
            nb, bs, hk, d = 40, 16, 8, 128
            act = torch.bfloat16 if dtype == A.FP8 else dtype
            fused = (torch.randn(t, 3 * hk * d, generator=gen) * 3).to(act).to(dev)
            k, v = fused[:, :hk * d].view(t, hk, d), fused[:, 2 * hk * d:].view(t, hk, d)
            slots = torch.randperm(nb * bs, generator=gen)[:t].to(dev)
            bufs = [caches(nb, bs, hk, d, dtype, where) for where in (dev, dev, "cpu")]
            with kernels_on_cpu(s):
                kernels.write_kv(bufs[0][0], bufs[0][1], k, v, slots, bufs[0][2], bufs[0][3])
            A.write_kv_ref(bufs[1][0], bufs[1][1], k, v, slots, bufs[1][2], bufs[1][3])
            A.write_kv_ref(bufs[2][0], bufs[2][1], k.cpu(), v.cpu(), slots.cpu(), bufs[2][2], bufs[2][3])
            cpu, values = byte_diffs(bufs[0], bufs[2]), value_diffs(bufs[0], bufs[2])
            here, where = byte_diffs(bufs[0], bufs[1]), first_diff(bufs[0], bufs[2])
            r.row("correct", f"write_kv {name} (hk 8, d 128, {t} rows)", f"{values} values, {cpu} bytes differ{where}",
                  f"write_kv_ref on CPU; on {dev.type}: {here} B", "PASS" if values == 0 else "FAIL")

    # the dry run sweeps the dtypes with 2 KV heads: a quarter of the interpreted programs, the
    # same code (tests/test_kernels.py checks 8 KV heads)
    sweep_hk = 8 if not s.dry else 2
    cases = [(4, 128, 16, sweep_hk, dt) for dt in dtypes] + [
        (1, 64, 8, 4, torch.bfloat16), (3, 64, 32, 3, torch.float16), (8, 128, 128, 2, torch.bfloat16)]
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
    case = "graph decode, a 23-token chunk as rows of one sequence vs eager prefill"
    with r.guard("correct", case):
        check_graph_chunk(r, s, case)
    for b in (3, 5) if not s.dry else (3,):      # the dry run: one padded bucket shows the path
        case = f"graph decode, batch {b} (padded to its bucket) vs each alone"
        with r.guard("correct", case):
            check_graph_batch(r, s, case, b)


def caches(nb: int, bs: int, hk: int, d: int, dtype, device) -> list:
    """Zeroed K and V caches (nb, bs, hk, d), and for fp8 their scales (nb, bs, hk), on device."""
    import torch
    from kvchat.engine import attention as A
    c = [torch.zeros(nb, bs, hk, d, device=device).to(dtype) for _ in range(2)]
    return c + ([torch.zeros(nb, bs, hk, device=device) for _ in range(2)] if dtype == A.FP8 else [None, None])


def byte_diffs(got: list, want: list) -> int:
    """Bytes that differ between two lists of tensors (None entries skipped), compared on the CPU:
    the verdict is against torch's CPU arithmetic, the semantics tests/ pin the kernels to."""
    import torch
    return sum(int((a.cpu().contiguous().view(torch.uint8) != b.cpu().contiguous().view(torch.uint8)).sum())
               for a, b in zip(got, want) if a is not None)


def value_diffs(got: list, want: list) -> int:
    """Elements whose values differ (+0 and -0 equal, NaN equal to NaN): what any later use of
    the cache can tell apart. The verdicts count these; the bytes are shown beside them."""
    import torch
    n = 0
    for a, b in zip(got, want):
        if a is not None:
            a, b = a.cpu().float().reshape(-1), b.cpu().float().reshape(-1)
            n += int(((a != b) & ~(a.isnan() & b.isnan())).sum())
    return n


def first_diff(got: list, want: list, names=("k cache", "v cache", "k scales", "v scales")) -> str:
    """Where the first differing element is, and both values: a finding to act on, not a count."""
    import torch
    for name, a, b in zip(names, got, want):
        if a is None:
            continue
        a, b = a.cpu().contiguous(), b.cpu().contiguous()
        bad = (a.view(torch.uint8) != b.view(torch.uint8)).view(-1)
        if bad.any():
            i = int(bad.nonzero()[0]) // a.element_size()
            count = int((a.reshape(-1).float() != b.reshape(-1).float()).sum())
            return (f" ({count} elements; first in {name}[{i}]: "
                    f"{a.reshape(-1)[i].float().item():.6g} vs {b.reshape(-1)[i].float().item():.6g})")
    return ""


def check_fused(r: Report, s: Setup, gen) -> None:
    """The decode step's fused kernels against their torch forms (engine.cuda_graph.TorchOps)."""
    import torch
    from kvchat.engine import attention as A
    from kvchat.engine import kernels
    from kvchat.engine.cuda_graph import TorchOps
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
            bufs = [caches(nb, bs, hk, d, cache, where) for where in (dev, dev, "cpu")]
            with kernels_on_cpu(s):
                q_got = kernels.rope_write(qkv, cos, sin, positions, *bufs[0][:2], slots, *bufs[0][2:], hq)
            q_dev = TorchOps.rope_write(qkv, cos, sin, positions, *bufs[1][:2], slots, *bufs[1][2:], hq)
            q_cpu = TorchOps.rope_write(qkv.cpu(), cos.cpu(), sin.cpu(), positions.cpu(), *bufs[2][:2], slots.cpu(),
                                        *bufs[2][2:], hq)
            got = [q_got.contiguous(), *bufs[0]]
            cpu, values = byte_diffs(got, [q_cpu.contiguous(), *bufs[2]]), value_diffs(got, [q_cpu.contiguous(), *bufs[2]])
            here = byte_diffs(got, [q_dev.contiguous(), *bufs[1]])
            where = first_diff(got, [q_cpu.contiguous(), *bufs[2]], ("q", "k cache", "v cache", "k scales", "v scales"))
            r.row("correct", f"rope_write {str(act)[6:]} q, cache {name}", f"{values} values, {cpu} bytes differ{where}",
                  f"TorchOps on CPU; on {dev.type}: {here} B", "PASS" if values == 0 else "FAIL")


def check_graph_decoder(r: Report, s: Setup, case: str, fused: bool) -> None:
    """A 2-layer model of the check's geometry: logits of decode steps replayed from the CUDA
    graph (Triton kernels) against the eager torch reference path, over the same prefill."""
    import torch
    from dataclasses import replace
    from kvchat.engine.cuda_graph import GraphDecoder
    from kvchat.engine.kv_cache import KVPool, plan_pool
    from kvchat.engine.model import Step
    from kvchat.engine.weights import random_model
    geom = replace(s.geom, n_layers=2)
    dtype = torch.float32 if s.dry else torch.bfloat16
    kv = "fp32" if s.dry else "bf16"
    model = random_model(geom, s.device, dtype, seed=1)
    # the dry run: 3 steps show the replay runs and matches (6 took twice its interpreted time)
    bs, prompt, steps = 16, 100, 6 if not s.dry else 3
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
        pool = KVPool(geom, spec, s.device, layout="tokens")  # the kernels' layout, in the dry run too
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


def check_graph_batch(r: Report, s: Setup, case: str, b: int) -> None:
    """b sequences of different lengths, each with its own shuffled blocks of one pool,
    decoded together through the graph decoder (the bucket's padded rows write nothing):
    every row's logits against the same sequence decoded alone on the eager torch path."""
    import torch
    from dataclasses import replace
    from kvchat.engine.cuda_graph import GraphDecoder
    from kvchat.engine.kv_cache import KVPool, plan_pool
    from kvchat.engine.model import Step
    from kvchat.engine.weights import random_model
    geom = replace(s.geom, n_layers=2)
    dtype = torch.float32 if s.dry else torch.bfloat16
    kv = "fp32" if s.dry else "bf16"
    model = random_model(geom, s.device, dtype, seed=1)
    # the dry run: 3 steps, the last still taking the 94-token prompt's row into a new block (96)
    bs, steps = 16, 4 if not s.dry else 3
    lens = [20 + 37 * i for i in range(b)]                       # prompts of 20, 57, 94, ... tokens
    per = -(-(max(lens) + steps) // bs)                          # blocks each sequence needs
    spec = plan_pool(geom, kv, (b * per + 8) * bs * geom.kv_bytes_per_token(kv), bs)
    # the last block stays unowned: a padded row writing slot -1 would land in it (the end of
    # the previous layer's V), and the check below would see it
    order = torch.randperm(spec.num_blocks - 1, generator=torch.Generator().manual_seed(2)).tolist()
    owned = [order[i * per:(i + 1) * per] for i in range(b)]
    tables = [torch.tensor(o, dtype=torch.int32, device=s.device) for o in owned]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, geom.vocab_size, (n,), generator=gen).to(s.device) for n in lens]
    feeds = torch.randint(0, geom.vocab_size, (steps, b), generator=gen).tolist()   # the same in both runs

    def slot(i: int, p: int) -> int:
        return owned[i][p // bs] * bs + p % bs

    def prefill(pool) -> None:
        for i, ids in enumerate(prompts):
            step = Step(tables[i], torch.tensor([slot(i, p) for p in range(lens[i])], device=s.device), 0, decode=False)
            model.forward(ids, torch.arange(lens[i], device=s.device), step, pool)

    alone_pool = KVPool(geom, spec, s.device, layout="tokens")
    prefill(alone_pool)
    alone = []
    for k in range(steps):
        row = []
        for i in range(b):
            pos = lens[i] + k
            with torch_reference_path():
                st = Step(tables[i], torch.tensor([slot(i, pos)], device=s.device), pos, decode=True)
                row.append(model.forward(torch.tensor([feeds[k][i]], device=s.device),
                                         torch.tensor([pos], device=s.device), st, alone_pool)[0].float())
        alone.append(torch.stack(row))
    pool = KVPool(geom, spec, s.device, layout="tokens")
    pool.data.fill_(7.0)                                         # a sentinel in every slot no row owns
    prefill(pool)
    decoder = GraphDecoder(model, pool, use_graph=not s.dry, pad=True)
    together = []
    for k in range(steps):
        pos = [lens[i] + k for i in range(b)]
        with kernels_on_cpu(s):
            together.append(decoder.decode(feeds[k], pos, [slot(i, p) for i, p in enumerate(pos)],
                                           [t[:p // bs + 1] for t, p in zip(tables, pos)],
                                           [p + 1 for p in pos]).float())
    err = max((a - g).abs().max().item() for a, g in zip(alone, together))
    scale = max(a.abs().max().item() for a in alone)
    unowned = sorted(set(range(spec.num_blocks)) - {x for o in owned for x in o})
    stray = int((pool.data[:, :, unowned] != 7.0).sum())        # (layers, 2, unowned, bs, hk, d)
    ok = err <= 5e-2 * max(1.0, scale) and stray == 0
    r.row("correct", case, f"max abs err {err:.2e}, {stray} stray writes",
          f"{steps} steps of {b} rows, bucket {decoder.bucket(b)}", "PASS" if ok else "FAIL")


def check_graph_chunk(r: Report, s: Setup, case: str) -> None:
    """A new turn's 23 tokens after a 100-token prefix as 23 rows of one sequence through the
    graph decoder (how the runner sends short prompt chunks on CUDA), then two decode steps
    over what those rows wrote: logits against the eager torch prefill and decode."""
    import torch
    from dataclasses import replace
    from kvchat.engine.cuda_graph import GraphDecoder
    from kvchat.engine.kv_cache import KVPool, plan_pool
    from kvchat.engine.model import Step
    from kvchat.engine.weights import random_model
    geom = replace(s.geom, n_layers=2)
    dtype, kv = (torch.float32, "fp32") if s.dry else (torch.bfloat16, "bf16")
    model = random_model(geom, s.device, dtype, seed=1)
    bs, prompt, n = 16, 100, 23
    spec = plan_pool(geom, kv, 64 * bs * geom.kv_bytes_per_token(kv), bs)
    order = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(4))[:16].tolist()
    table = torch.tensor(order + [0] * (spec.num_blocks - 16), dtype=torch.int32, device=s.device)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, geom.vocab_size, (prompt + n + 2,), generator=gen).tolist()

    def slots(a: int, b: int):
        return torch.tensor([order[p // bs] * bs + p % bs for p in range(a, b)], device=s.device)

    def step(pool, a: int, b: int, decode: bool):
        return model.forward(torch.tensor(ids[a:b], device=s.device), torch.arange(a, b, device=s.device),
                             Step(table, slots(a, b), a, decode=decode), pool)[0].float()

    results = []
    for graphed in (False, True):
        pool = KVPool(geom, spec, s.device, layout="tokens")
        step(pool, 0, prompt, False)
        if not graphed:
            with torch_reference_path():
                out = [step(pool, prompt, prompt + n, False)] + [step(pool, p, p + 1, True)
                                                                 for p in (prompt + n, prompt + n + 1)]
        else:
            dec = GraphDecoder(model, pool, use_graph=not s.dry)
            pos = list(range(prompt, prompt + n))
            with kernels_on_cpu(s):
                rows = dec.decode(ids[prompt:prompt + n], pos, slots(prompt, prompt + n).tolist(),
                                  [table[:(prompt + n) // bs + 1]] * n, [p + 1 for p in pos])
                out = [rows[-1].float()] + [dec(ids[p], p, int(slots(p, p + 1)[0]), table, p // bs + 1).float()
                                            for p in (prompt + n, prompt + n + 1)]
        results.append(out)
    err = max((a - b).abs().max().item() for a, b in zip(*results))
    scale = max(a.abs().max().item() for a in results[0])
    r.row("correct", case, f"max abs err {err:.2e}", f"chunk's last row + 2 steps, logits up to {scale:.2f}",
          "PASS" if err <= 5e-2 * max(1.0, scale) else "FAIL")
