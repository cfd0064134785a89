"""The engine: one model, one KV pool, one scheduler, and the conversations using them.

    engine = Engine(EngineConfig(model="smollm2-135m"))
    chat = engine.new_conversation()
    for event in chat.send("Hello"):      # TokenEvent ..., then TurnStats
        ...
    engine.snapshot(chat)                  # CacheSnapshot for panels

`step()` is the only loop (nano-vllm's LLMEngine.step): the scheduler picks the rows, the
runner computes them in one forward, the scheduler samples and hands each request its
tokens. Steps are driven by whoever waits: a conversation whose request has nothing new to
read runs the next step under the lock, for every request at once; the others, finding
their tokens queued when they get the lock, read them and go on. So several threads sending
on different conversations share every step, and one thread alone runs as before batching.
The tensor work of each step (and of a pool rebuild) runs on one thread of the process,
engine/compute.py, while the thread that drove it holds the lock and waits: with
each driving thread running its own steps, each kept an OpenMP pool and libgomp's workers
slept between regions (a step 1.6x slower; compute.py says why).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import compute, cuda_graph, native, native_build
from .block_manager import BlockManager
from .errors import KvchatError
from .fair_lock import FairLock
from .geometry import KV_DTYPES, MODEL_DTYPES, Geometry
from .kv_cache import TORCH_DTYPES, KVPool, PoolSpec, plan_pool
from .request import Request
from .runner import Runner
from .sampler import Sampler, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .sizing import prefill_chunk, step_tokens
from .sources import ModelSource, resolve
from .telemetry import SHARED, CacheSnapshot, SchedulerSnapshot, StepRecord
from .template import render_chat, stop_ids
from .tokenizer import load_tokenizer
from .units import parse_bytes
from .weights import load_model

__all__ = ["KV_DTYPES", "MODEL_DTYPES", "Engine", "EngineConfig", "Generation", "Preflight", "preflight"]


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
    step_tokens: int | None = None       # most prompt + decode tokens in one step; None: one prefill chunk

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
        if self.step_tokens is not None and (not isinstance(self.step_tokens, int) or self.step_tokens <= 0):
            raise KvchatError(f"step tokens must be a positive number, got {self.step_tokens!r}")

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
    """(weights, cache). --kv-dtype auto is the weights' dtype, on the CPU too: bf16 weights
    there compute in fp32 (model.Llama.act_dtype) and store a bf16 cache, which the C kernels
    read and write (benchmarks/cpu_bf16.py: 0.96x / 0.92x the fp32 cache's ms/token at 1k / 4k
    tokens beside bf16 weights, greedy agreement and perplexity the same)."""
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else cpu_auto_dtype())
    kv = cfg.kv_dtype if cfg.kv_dtype != "auto" else dtype
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


@dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's result from Engine.generate."""
    prompt_tokens: int
    tokens: tuple[int, ...]           # the tokens generated
    ttft_ms: float
    decode_ms: tuple[float, ...]      # the time of each step that fed one of its tokens
    stop_reason: str


@dataclass(frozen=True, slots=True)
class Preflight:
    """What is settled before any weight is read."""
    source: ModelSource
    device: torch.device
    dtype: str
    kv_dtype: str


def preflight(cfg: EngineConfig, source: ModelSource | None = None) -> Preflight:
    """The model resolved (its geometry read), the device and dtypes chosen, and the weights
    and pool checked against free memory: every refusal that needs no weights, in one line.
    The CLI, the app's launcher and the Engine itself all start here."""
    src = source or resolve(cfg.model, cfg.random_weights)
    device = pick_device(cfg.device)
    dtype, kv_dtype = pick_dtypes(cfg, device)
    check_memory(src.geometry, dtype, kv_dtype, cfg.budget_bytes, device)
    return Preflight(src, device, dtype, kv_dtype)


class Engine:
    def __init__(self, config: EngineConfig | None = None, source: ModelSource | None = None,
                 checked: Preflight | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        pre = checked or preflight(cfg, source)
        self.source, self.device = pre.source, pre.device
        self.geometry = self.source.geometry
        self.dtype_name = pre.dtype
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.tokenizer = load_tokenizer(self.source)
        self.model = load_model(self.source, self.device, self.dtype, cfg.seed)
        if self.device.type == "cpu":
            native.lib()   # the C kernels compile (once per machine, about 4 s) while the model loads, not at the first reply
            if self.dtype == torch.bfloat16 and native.lib() is not None:
                self.model.fp32_rows()
        self.lock = FairLock()  # held for one step, or one change to the pool; handed over in order
        self.conversations: list = []
        self.prefill_chunk = prefill_chunk(self.geometry, self.dtype_name, self.device.type,   # a lone prompt's
                                           native_build.computes_bf16())
        self._next_conversation = 0
        self.scheduler: Scheduler
        self.pool: KVPool
        self.blocks: BlockManager
        self.runner: Runner
        self._build_pool(pre.kv_dtype)
        # the load ran here, on the calling thread, so that ctrl+c stops it at once; the OpenMP
        # pool its tensor ops gave this thread is let go (the steps run on compute.py's thread)
        compute.release_pool()

    # ---- the pool ------------------------------------------------------------------------
    def _build_pool(self, kv_dtype: str) -> None:
        # the budget in bytes is fixed at the first build: another KV dtype changes the blocks
        # that fit, never the bytes (fp32 -> bf16 doubles the blocks, -> fp8 about quadruples)
        if getattr(self, "kv_budget_bytes", None) is None:
            self.kv_budget_bytes = self.config.budget_bytes or default_budget(self.geometry, kv_dtype, self.device)
        spec = plan_pool(self.geometry, kv_dtype, self.kv_budget_bytes, self.config.block_size)
        if hasattr(self, "pool"):  # every hold on the old tensors let go before the new ones are made
            del self.pool, self.runner
            cuda_graph.forget(self.model)
        self.pool = KVPool(self.geometry, spec, self.device)
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)
        if not hasattr(self, "scheduler"):    # the first build; a rebuild keeps the scheduler
            self.scheduler = Scheduler(self.blocks, self.config.step_tokens or step_tokens(self.device.type),
                                       self.model.step_weight_bytes)
        self.scheduler.blocks = self.blocks     # the scheduler outlives a rebuild: its queues and counts stay
        self.scheduler.cache_bytes_per_token = spec.bytes_per_token + spec.scale_bytes_per_token
        self.runner = Runner(self.model, self.pool)
        self.runner.capture()   # CUDA: the decode graphs now, while loading, not in a reply

    @property
    def spec(self) -> PoolSpec:
        return self.pool.spec

    @property
    def kv_dtype(self) -> str:
        return self.spec.kv_dtype

    @property
    def bytes_per_token(self) -> int:
        """What one token holds in the pool, fp8's scales included (PoolSpec.stored_bytes_per_token)."""
        return self.spec.stored_bytes_per_token

    @property
    def preemptions(self) -> int:
        """Conversations preempted since start, pool-wide (counted by the scheduler)."""
        return self.scheduler.preemptions

    def set_kv_dtype(self, kv_dtype: str) -> None:
        """Rebuild the pool in another storage dtype, keeping the same byte budget. Every
        conversation's cache is dropped; each recomputes its history on its next turn (a
        reply running now goes back to the queue and recomputes its text in the new pool)."""
        if kv_dtype not in KV_DTYPES:
            raise KvchatError(f"unknown KV dtype {kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
        kv_dtype = self.dtype_name if kv_dtype == "auto" else kv_dtype
        with self.lock:
            self.scheduler.requeue_running()
            for conv in self.conversations:
                self.blocks.free(conv.seq, keep_index=False)
            compute.run(lambda: self._build_pool(kv_dtype))
            for conv in self.conversations:
                conv.resize_table()

    # ---- conversations ---------------------------------------------------------------------
    def new_conversation(self, system_prompt: str | None = None, cap: int | None = None,
                         policy: str = "stop"):
        from .conversation import Conversation
        with self.lock:
            self._next_conversation += 1
            conv = Conversation(self, system_prompt=system_prompt, cap=cap, policy=policy,
                                conversation_id=self._next_conversation)
            self.conversations.append(conv)
            self.scheduler.attach(conv.seq)
        return conv

    def close_conversation(self, conv) -> None:
        """Stop its reply if one runs, and release its blocks (full ones stay cached)."""
        with self.lock:
            self.scheduler.detach(conv.seq)
            self.blocks.free(conv.seq, keep_index=True)
            if conv in self.conversations:
                self.conversations.remove(conv)

    # ---- steps -------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self.lock:
            self.scheduler.add(req)

    def abort(self, req: Request) -> None:
        with self.lock:
            self.scheduler.abort(req)

    def cut(self, req: Request, kept: int) -> None:
        with self.lock:
            self.scheduler.cut(req, kept)

    def step(self) -> StepRecord | None:
        """One step for every running request: schedule, run, postprocess. None when there
        was nothing to run."""
        with self.lock:
            return compute.run(self._step)

    def _step(self) -> StepRecord | None:
        # on the compute thread, while the thread that asked for the step holds the lock
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        try:
            logits, context, forwards = self.runner.run(plan)
        except Exception as err:  # noqa: BLE001  (the requests in the step carry it to their readers)
            self.scheduler.fail(plan, err)
            return None
        return self.scheduler.postprocess(plan, logits, t0, context, forwards)

    def drive(self, req: Request) -> None:
        """Give req something new to read: run a step unless another thread's step already did.
        The one way a reader waits, so whoever waits runs the step for everyone."""
        with self.lock:
            if req.events or req.finished:
                return
            if self.step() is None and not (req.events or req.finished):
                # nothing could run and req was not refused: a bug, not a wait
                req.error = KvchatError("the scheduler found nothing to run for a waiting request")
                self.scheduler.abort(req, "error")

    @contextmanager
    def requests(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 ignore_eos: bool = False) -> Iterator[list[Request]]:
        """Token ids in, a request per prompt, all queued at once, each on a sequence of its own
        that is dropped from the cache at the exit (nothing is left for a later call to reuse).
        The engine's lock is held throughout: for benches and tests that run the steps (step,
        hold) and read the requests themselves."""
        sp = sampling or SamplingParams()
        stops = frozenset() if ignore_eos else stop_ids(self.tokenizer, self.geometry.eos_token_ids)
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        reqs: list[Request] = []
        with self.lock:
            try:
                for ids in prompts:
                    seq = Sequence(self.spec.block_size, torch.zeros(self.spec.num_blocks, dtype=torch.int32,
                                                                     device=self.device))
                    self.scheduler.attach(seq)
                    reqs.append(Request(self.scheduler.next_id(), seq, list(ids), Sampler(sp, self.device, vocab),
                                        sp.max_tokens, stops, self.geometry.max_position, "max_position",
                                        time.perf_counter(), chunk_size=self.prefill_chunk))
                    self.scheduler.add(reqs[-1])
                yield reqs
            finally:
                for r in reqs:
                    self.scheduler.detach(r.seq)
                    self.blocks.free(r.seq, keep_index=False)

    def hold(self, reqs: list[Request], held: bool = True) -> None:
        """Held, a request past its prompt takes no decode row (its cache and place stay) until
        let go: a bench compares batch sizes over the same cached users, step by step."""
        with self.lock:
            for r in reqs:
                r.held = held

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 ignore_eos: bool = False) -> tuple[list[Generation], tuple[StepRecord, ...]]:
        """Token ids in, token ids out, every prompt at once through the scheduler (nano-vllm's
        LLM.generate; see requests()). Returns the generations in prompt order and the
        StepRecords of the steps they took."""
        with self.requests(prompts, sampling, ignore_eos) as reqs:
            first = self.scheduler.steps
            while not all(r.finished for r in reqs):
                if self.step() is None:
                    break
            errors = [r.error for r in reqs if r.error is not None]
            if errors:
                raise errors[0]
            taken = self.scheduler.steps - first
            records = tuple(self.scheduler.recent)[-taken:] if taken else ()
        return [Generation(len(r.prompt), tuple(r.tokens[len(r.prompt):]), r.ttft_ms or 0.0, tuple(r.decode_ms),
                           r.stop_reason or "") for r in reqs], records

    def steps(self) -> tuple[StepRecord, ...]:
        """The latest steps, oldest first."""
        with self.lock:
            return tuple(self.scheduler.recent)

    def scheduler_snapshot(self) -> SchedulerSnapshot:
        with self.lock:
            return self.scheduler.snapshot()

    # ---- telemetry ---------------------------------------------------------------------------
    def snapshot(self, focus=None) -> CacheSnapshot:
        with self.lock:
            spec, bm = self.spec, self.blocks
            tables = [c.seq.block_table for c in self.conversations]
            codes = bm.block_map(tables, focus.seq if focus is not None else None)
            owner = bytearray(spec.num_blocks)
            for i, table in enumerate(tables):
                mark = min(i + 1, 255)
                for block_id in table:
                    if not owner[block_id]:
                        owner[block_id] = mark
            shared = len({b for t in tables for b in t if codes[b] == SHARED})
            held = blocks = wasted = 0
            if focus is not None:
                held, blocks = len(focus.seq), focus.seq.num_blocks
                wasted = blocks * spec.block_size - held
            return CacheSnapshot(
                model=self.source.name, kv_dtype=spec.kv_dtype, block_size=spec.block_size,
                num_blocks=spec.num_blocks, bytes_per_token=self.bytes_per_token,
                scale_bytes_per_token=spec.scale_bytes_per_token, capacity_bytes=self.pool.nbytes,
                tokens_held=held, bytes_used=held * self.bytes_per_token,
                bytes_allocated=blocks * spec.block_size * self.bytes_per_token, blocks_used=blocks,
                wasted_slots=wasted, pool_free=bm.num_free, pool_active=bm.num_active,
                pool_cached=bm.num_cached, pool_shared=shared, block_map=bytes(codes),
                cap=focus.cap if focus is not None else None,
                policy=focus.policy.name if focus is not None else "",
                mode=focus.mode if focus is not None else "cache",
                evictions=bm.evictions, preemptions=self.preemptions,
                owners=tuple(c.id for c in self.conversations), block_owner=bytes(owner))

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template applied to `messages`, with the generation prompt: token ids."""
        return render_chat(self.tokenizer, messages)

    def describe(self) -> dict:
        g, spec = self.geometry, self.spec
        return {
            "model": self.source.name, "device": str(self.device), "dtype": self.dtype_name,
            "kv_dtype": spec.kv_dtype, "random_weights": self.source.random_weights,
            "n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
            "kv_bytes_per_token": self.bytes_per_token, "kv_scale_bytes_per_token": spec.scale_bytes_per_token,
            "block_size": spec.block_size,
            "num_blocks": spec.num_blocks, "capacity_tokens": spec.capacity_tokens,
            "capacity_bytes": self.pool.nbytes, "weight_bytes": self.model.weight_bytes,
            "step_tokens": self.scheduler.token_budget, "prefill_chunk": self.prefill_chunk,
        }
