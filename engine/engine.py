"""The engine: one model, one KV pool, one block manager, and the conversations using them.

    engine = Engine(EngineConfig(model="smollm2-135m"))
    chat = engine.new_conversation()
    for event in chat.send("Hello"):      # TokenEvent ..., then TurnStats
        ...
    engine.snapshot(chat)                  # CacheSnapshot for panels
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from . import native
from .block_manager import BlockManager
from .chat_template import check_chat_template
from .errors import KvchatError
from .geometry import Geometry
from .kv_cache import TORCH_DTYPES, KVPool, PoolSpec, plan_pool
from .telemetry import CACHED, HELD, OTHER, PARTIAL, REUSED, SHARED, CacheSnapshot
from .units import parse_bytes
from .sources import ModelSource, resolve
from .weights import load_model

MODEL_DTYPES = ("auto", "fp32", "bf16", "fp16")
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    random_weights: bool = False
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "auto"
    kv_budget: int | str | None = None   # bytes, or a string like "512MiB"; None: from free memory
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise KvchatError(f"unknown --dtype {self.dtype!r}; accepted: {', '.join(MODEL_DTYPES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise KvchatError(f"unknown --kv-dtype {self.kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise KvchatError(f"--block-size must be a positive number of tokens, got {self.block_size}")
        if self.kv_budget is not None:
            self.kv_budget = parse_bytes(self.kv_budget)
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise KvchatError(f"unknown --device {self.device!r}; accepted: auto, cpu, cuda, cuda:N")

    @property
    def budget_bytes(self) -> int | None:
        """kv_budget in bytes (__post_init__ has parsed a string like "512MiB")."""
        return None if self.kv_budget is None else int(self.kv_budget)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise KvchatError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return torch.device(name)


def cpu_auto_dtype() -> str:
    """bf16 weights where the C kernels multiply them with AVX512-BF16 (vdpbf16ps), else fp32.
    bf16 halves the bytes a decode step reads; on the bundled model (benchmarks/cpu_bf16.py,
    issue 25) it held fp32's quality within the bounds kvchat asks of it: prefill perplexity
    within 1% of fp32's (measured 0.999x), greedy agreement over teacher-forced decode steps at
    least 95% (measured 100% of 96), and decoded in 0.56x fp32's time. Without the instruction
    the widening loop reads the same bytes but fp32 stays the default, as the reference tests
    hold it to transformers within 1e-3 (--dtype bf16 asks for bf16 anywhere)."""
    return "bf16" if native.bf16_native() else "fp32"


def pick_dtypes(cfg: EngineConfig, device: torch.device) -> tuple[str, str]:
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else cpu_auto_dtype())
    # bf16 weights on a CPU compute in fp32 (model.Llama.act_dtype): an fp32 cache, which the C kernels read
    kv = cfg.kv_dtype if cfg.kv_dtype != "auto" else ("fp32" if device.type == "cpu" and dtype == "bf16" else dtype)
    if kv == "fp8" and "fp8" not in TORCH_DTYPES:
        raise KvchatError("--kv-dtype fp8 needs torch with float8_e4m3fn (torch >= 2.1)")
    return dtype, kv


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def default_budget(geom: Geometry, kv_dtype: str, device: torch.device) -> int:
    """GPU: 90% of what is free after the weights. CPU: room for two full contexts, at most
    a quarter of available memory."""
    free = available_memory(device)
    if device.type == "cuda":
        return int(free * 0.9)
    want = 2 * geom.max_position * geom.kv_bytes_per_token(kv_dtype) * (2 if kv_dtype == "fp8" else 1)
    return max(min(want, free // 4), 64 * 2**20)


def check_memory(geom: Geometry, dtype: str, kv_dtype: str, kv_budget: int | None, device: torch.device) -> None:
    """Refuse in one line, before allocating anything, a model whose weights and pool cannot
    fit in the device's free memory (an 8B model in fp32 on a 24 GiB machine)."""
    from .geometry import DTYPE_BYTES
    from .sizing import memory_plan
    pool = kv_budget or (0 if device.type == "cuda" else default_budget(geom, kv_dtype, device))
    plan = memory_plan(geom, dtype, pool, available_memory(device), str(device))
    if not plan.fits:
        smaller = {d: geom.param_count() * DTYPE_BYTES[d] for d in ("bf16",) if DTYPE_BYTES[d] < DTYPE_BYTES[dtype]}
        raise KvchatError(plan.refusal(smaller))


class Engine:
    def __init__(self, config: EngineConfig | None = None, source: ModelSource | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.source = source or resolve(cfg.model, cfg.random_weights)
        self.geometry = self.source.geometry
        self.device = pick_device(cfg.device)
        self.dtype_name, kv_dtype = pick_dtypes(cfg, self.device)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        check_memory(self.geometry, self.dtype_name, kv_dtype, cfg.budget_bytes, self.device)
        self.tokenizer = load_tokenizer(self.source)
        self.model = load_model(self.source, self.device, self.dtype, cfg.seed)
        if self.device.type == "cpu":
            native.lib()   # the C kernels compile (once per machine, about 4 s) while the model loads, not at the first reply
            if self.dtype == torch.bfloat16 and native.lib() is not None:
                self.model.fp32_rows()
        self.lock = threading.RLock()  # one turn at a time touches the pool
        self.conversations: list = []
        self.preemptions = 0
        self.pool: KVPool
        self.blocks: BlockManager
        self._build_pool(kv_dtype)

    # ---- the pool ------------------------------------------------------------------------
    def _build_pool(self, kv_dtype: str) -> None:
        # the budget in bytes is fixed at the first build: another KV dtype changes the blocks
        # that fit, never the bytes (fp32 -> bf16 doubles the blocks, -> fp8 about quadruples)
        if getattr(self, "kv_budget_bytes", None) is None:
            self.kv_budget_bytes = self.config.budget_bytes or default_budget(self.geometry, kv_dtype, self.device)
        budget = self.kv_budget_bytes
        spec = plan_pool(self.geometry, kv_dtype, budget, self.config.block_size)
        if hasattr(self, "pool"):
            del self.pool  # free the old tensors before allocating new ones
        self.pool = KVPool(self.geometry, spec, self.device)
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)

    @property
    def spec(self) -> PoolSpec:
        return self.pool.spec

    @property
    def kv_dtype(self) -> str:
        return self.spec.kv_dtype

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    def set_kv_dtype(self, kv_dtype: str) -> None:
        """Rebuild the pool in another storage dtype, keeping the same byte budget. Every
        conversation's cache is dropped; each recomputes its history on its next turn."""
        if kv_dtype not in KV_DTYPES:
            raise KvchatError(f"unknown KV dtype {kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
        kv_dtype = self.dtype_name if kv_dtype == "auto" else kv_dtype
        with self.lock:
            for conv in self.conversations:
                conv.drop_cache()
            self._build_pool(kv_dtype)
            for conv in self.conversations:
                conv.resize_table()

    # ---- conversations ---------------------------------------------------------------------
    def new_conversation(self, system_prompt: str | None = None, cap: int | None = None,
                         policy: str = "stop"):
        from .conversation import Conversation
        conv = Conversation(self, system_prompt=system_prompt, cap=cap, policy=policy)
        self.conversations.append(conv)
        return conv

    def close_conversation(self, conv) -> None:
        with self.lock:
            conv.drop_cache(keep_index=True)
            if conv in self.conversations:
                self.conversations.remove(conv)

    def make_room(self, n_blocks: int, requester) -> None:
        """Ensure n_blocks can be allocated: cached blocks go first (LRU, inside allocate);
        then whole idle conversations are preempted, the most recently started first, as
        vLLM does, each counted in self.preemptions."""
        others = [c for c in self.conversations if c is not requester]
        if not self.blocks.can_allocate(n_blocks) and n_blocks > (
                self.blocks.num_free + self.blocks.num_cached + sum(len(c.block_table) for c in others)):
            raise KvchatError(
                f"KV pool full: this turn needs {n_blocks} more blocks of {self.spec.block_size} tokens, more than "
                f"the pool can free even by preempting every other conversation; raise --kv-budget, set a cap, "
                f"or /reset")
        while not self.blocks.can_allocate(n_blocks):
            victims = [c for c in reversed(self.conversations) if c is not requester and c.block_table]
            if not victims:
                need, have = n_blocks, self.blocks.num_free + self.blocks.num_cached
                raise KvchatError(
                    f"KV pool full: this turn needs {need} more blocks of {self.spec.block_size} tokens and "
                    f"only {have} can be freed; raise --kv-budget, lower the cap, or /reset")
            victims[0].preempt()
            self.preemptions += 1  # counted as it happens: a later failure does not lose it

    # ---- telemetry ---------------------------------------------------------------------------
    def snapshot(self, focus=None) -> CacheSnapshot:
        with self.lock:
            spec, bm = self.spec, self.blocks
            # O(cached + held) rather than O(pool): a GPU pool can have 100k blocks
            codes = bytearray(spec.num_blocks)  # all FREE
            for block_id in bm.cached_ids():
                codes[block_id] = CACHED
            shared = set()
            for conv in self.conversations:
                for block_id in conv.block_table:
                    if bm.blocks[block_id].ref_count > 1:
                        codes[block_id] = SHARED
                        shared.add(block_id)
                    else:
                        codes[block_id] = OTHER
            held = blocks = wasted = 0
            if focus is not None:
                seq = focus.seq
                held = len(seq)
                blocks = seq.num_blocks
                wasted = blocks * spec.block_size - held
                for i, block_id in enumerate(seq.block_table):
                    if codes[block_id] == SHARED:
                        continue
                    if i < seq.reused_blocks:
                        codes[block_id] = REUSED
                    elif (i + 1) * spec.block_size > held:
                        codes[block_id] = PARTIAL
                    else:
                        codes[block_id] = HELD
            return CacheSnapshot(
                model=self.source.name, kv_dtype=spec.kv_dtype, block_size=spec.block_size,
                num_blocks=spec.num_blocks, bytes_per_token=spec.bytes_per_token,
                capacity_bytes=self.pool.nbytes, tokens_held=held, bytes_used=held * spec.bytes_per_token,
                bytes_allocated=blocks * spec.block_size * spec.bytes_per_token, blocks_used=blocks,
                wasted_slots=wasted, pool_free=bm.num_free, pool_active=bm.num_active,
                pool_cached=bm.num_cached, pool_shared=len(shared), block_map=bytes(codes),
                cap=focus.cap if focus is not None else None,
                policy=focus.policy.name if focus is not None else "",
                mode=focus.mode if focus is not None else "cache",
                evictions=bm.evictions, preemptions=self.preemptions)

    def describe(self) -> dict:
        g, spec = self.geometry, self.spec
        return {
            "model": self.source.name, "device": str(self.device), "dtype": self.dtype_name,
            "kv_dtype": spec.kv_dtype, "random_weights": self.source.random_weights,
            "n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
            "kv_bytes_per_token": spec.bytes_per_token, "block_size": spec.block_size,
            "num_blocks": spec.num_blocks, "capacity_tokens": spec.capacity_tokens,
            "capacity_bytes": self.pool.nbytes, "weight_bytes": self.model.weight_bytes,
        }


def load_tokenizer(src: ModelSource):
    """The model's tokenizer, never its own code (trust_remote_code=False), and no larger
    than the embedding table: a token id past the config's vocab_size would index out of it."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(src.tokenizer_path), trust_remote_code=False)
    except Exception as err:  # transformers raises OSError, ValueError, and more
        detail = " ".join(str(err).split())[:300]
        raise KvchatError(f"{src.tokenizer_path}: cannot load the tokenizer ({type(err).__name__}: {detail})") from None
    check_chat_template(tok, src.tokenizer_path)
    if len(tok) > src.geometry.vocab_size:
        raise KvchatError(f"{src.tokenizer_path}: the tokenizer has {len(tok):,} tokens but config.json's "
                          f"vocab_size is {src.geometry.vocab_size:,}; accepted: a tokenizer no larger than the "
                          "model's vocabulary")
    return tok
