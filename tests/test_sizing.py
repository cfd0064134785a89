"""What-if sizing and per-step reads, from the formula alone: `kvchat info --tokens`."""
from __future__ import annotations

import json

from kvchat.engine.geometry import KNOWN
from kvchat.engine.sizing import CPU_PREFILL_CHUNK, PREFILL_CHUNK, prefill_chunk, step_reads, what_if

from kvchat.cli.command import main

from cli_helpers import fails_with


def test_what_if_70b_in_a_15_gb_budget():
    w = what_if(KNOWN["llama-3.1-70b"], "bf16", 30_000, budget=15 * 10**9)
    assert w.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert w.bytes_needed == 30_000 * 327_680 == 9_830_400_000
    assert abs(w.share - 9_830_400_000 / 15e9) < 1e-12      # about two thirds
    assert w.users_that_fit == 1 and w.fits


def test_what_if_counts_whole_blocks_and_fp8_scales():
    g = KNOWN["llama-3.1-8b"]
    w = what_if(g, "fp8", 8_193, users=3, budget=2**30, block_size=16)
    per_token = 2 * 32 * 8 * 128 * 1 + 2 * 32 * 8 * 4          # fp8 elements + one fp32 scale per head
    assert w.bytes_needed == 3 * 8_193 * per_token
    blocks = 2**30 // (16 * per_token)
    assert w.users_that_fit == blocks // 513                     # 8,193 tokens take 513 blocks of 16
    assert w.fits == (w.users_that_fit >= 3)


def test_cache_read_equals_weight_read():
    r8 = step_reads(KNOWN["llama-3.1-8b"], "bf16", "bf16", 1024)
    assert r8.crossover_tokens == round(KNOWN["llama-3.1-8b"].param_count() * 2 / 131_072)
    assert 120_000 < r8.crossover_tokens < 125_000               # about 122k, the figure
    small = step_reads(KNOWN["smollm2-135m"], "fp32", "fp32", 11_677)
    assert abs(small.cache_share - 0.5) < 0.01                   # at the crossover, half the bytes are cache


def test_info_what_if_json_and_text(capsys):
    argv = ["info", "--model", "llama-3.1-70b", "--tokens", "30000", "--kv-budget", "15GB"]
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)["what_if"]
    assert d["bytes_needed"] == 9_830_400_000 and d["users_that_fit"] == 1
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "9.83 GB" in out and "66% of the 15.00 GB budget" in out and "1 such conversation fits" in out
    assert "equals the weight read at" in out
    fails_with(capsys, ["info", "--tokens", "0"], "--tokens must be a positive integer")


def test_a_lone_prompts_chunk_is_sized_by_its_products_where_the_cpu_multiplies_bf16():
    small, big = KNOWN["smollm2-135m"], KNOWN["llama-3.1-8b"]
    assert prefill_chunk(small, "bf16", "cpu", True) == 2048      # 2 x 134.5M x 2,048 = 5.5e11 FLOP
    assert prefill_chunk(big, "bf16", "cpu", True) == CPU_PREFILL_CHUNK == 512   # never below the shared step's
    assert prefill_chunk(small, "bf16", "cpu", False) == 512       # bf16 widened to fp32: several times slower
    assert prefill_chunk(small, "fp32", "cpu", True) == 512
    assert prefill_chunk(big, "bf16", "cuda", False) == PREFILL_CHUNK == 8192
