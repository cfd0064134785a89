"""The peers `kvchat bench` measures in the same process, on the same token ids.

- transformers: `LlamaForCausalLM.from_pretrained` on the very safetensors directory the
  engine loads (same weights, device, dtype and torch threads), timed inside its own
  `generate` through a streamer: `generate` hands the streamer the prompt before the
  prefill and then each token as it is chosen, so the gaps between those calls are the
  prefill and the per-token decode steps of transformers' own loop with its DynamicCache.
  The next turn after a history is `generate` on the whole re-rendered chat: what a plain
  transformers user does, re-prefilling every token of the history.
- llama.cpp (optional, `pip install llama-cpp-python`): `Llama.generate`, timing each yielded
  token, on up to three files (--llama-cpp): F32 and BF16 GGUF exports of the very safetensors
  the engine loads (gguf_export.py: same weights, same precision as kvchat's run), and the
  GGUF those safetensors were converted from (the bundled Q4_1 file: 4-bit weights, about a
  seventh of the fp32 bytes). Never installed by kvchat or its CI.

This module touches torch because the peer does; kvchat's own engine is only driven
through its public API in `run.py`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvchat.engine import compute
from kvchat.engine.errors import KvchatError

from .report import Timing

LLAMA_CPP_MISSING = "llama-cpp-python is not installed (pip install llama-cpp-python); llama.cpp peer skipped"


class _Clock:
    """A transformers streamer that only records when each put() arrives."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.times: list[float] = []

    def put(self, value) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFPeer:
    """transformers' LlamaForCausalLM on the engine's weights, device and dtype."""

    name = "transformers"

    # It loads and runs on the engine's compute thread: one OpenMP pool in the process for both
    # (a peer on a thread of its own kept a second pool, and libgomp then let every pool's idle
    # workers sleep between regions, slowing whichever ran: engine/compute.py)
    def __init__(self, source, device, dtype) -> None:
        compute.run(lambda: self._load(source, device, dtype))

    def generate(self, ids: list[int], steps: int) -> Timing:
        """Greedy generate of steps + 1 tokens (EOS suppressed, so every step is timed)."""
        return compute.run(lambda: self._generate(ids, steps))

    def decode_batch(self, prompts: list[list[int]], steps: int) -> list[float]:
        """Greedy generate of steps + 1 tokens for all prompts at once, left-padded to the
        longest: the time of each decode step after the first token (ms)."""
        return compute.run(lambda: self._decode_batch(prompts, steps))

    def _load(self, source, device, dtype) -> None:
        import torch
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch, self.device = torch, device
        try:
            if source.path is not None:
                model = LlamaForCausalLM.from_pretrained(str(source.path), dtype=dtype, trust_remote_code=False)
            else:
                with torch.device(device):  # random weights: the geometry only, made on the device
                    model = LlamaForCausalLM._from_config(hf_config(source.geometry), dtype=dtype)
        except (OSError, ValueError, RuntimeError) as err:
            raise KvchatError(f"transformers peer: cannot load {source.name} ({type(err).__name__}: {err})") from None
        self.model = model.to(device).eval()
        self.eos = source.geometry.eos_token_ids[0] if source.geometry.eos_token_ids else 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _generate(self, ids: list[int], steps: int) -> Timing:
        torch = self.torch
        input_ids = torch.tensor([ids], device=self.device)
        clock = _Clock(self._sync)
        n = steps + 1
        self._sync()
        t0 = time.perf_counter()
        self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=self.eos, streamer=clock)
        # times[0]: the prompt, handed over just before the prefill; then one per token
        t = clock.times
        if len(t) < 2:
            raise KvchatError(f"transformers peer: generate produced no token for a {len(ids)}-token prompt")
        decode = tuple((b - a) * 1000 for a, b in zip(t[1:], t[2:]))
        return Timing(len(ids), (t[1] - t[0]) * 1000, (t[1] - t0) * 1000, decode)


    def _decode_batch(self, prompts: list[list[int]], steps: int) -> list[float]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.eos] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock = _Clock(self._sync)
        n = steps + 1
        self._sync()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=self.eos, streamer=clock)
        t = clock.times        # the prompts, then one call per step with every row's token
        if len(t) < 3:
            raise KvchatError(f"transformers peer: generate produced too few tokens for a batch of {len(prompts)}")
        return [(b - a) * 1000 for a, b in zip(t[1:], t[2:])]


def hf_config(geom):
    """A LlamaConfig with the engine's geometry, for --random-weights."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=geom.vocab_size, hidden_size=geom.hidden, intermediate_size=geom.intermediate,
        num_hidden_layers=geom.n_layers, num_attention_heads=geom.n_heads, num_key_value_heads=geom.n_kv_heads,
        head_dim=geom.head_dim, max_position_embeddings=geom.max_position, rms_norm_eps=geom.norm_eps,
        rope_theta=geom.rope_theta, tie_word_embeddings=geom.tie_embeddings)


# --llama-cpp's choices -> the series each is reported as ("llama_cpp": the original file)
LLAMA_CPP_FILES = {"f32": "llama_cpp_f32", "bf16": "llama_cpp_bf16", "q4_1": "llama_cpp"}
SAME_PRECISION = {"fp32": "f32", "bf16": "bf16"}     # kvchat's --dtype -> the export of its precision
# kvchat's cache dtype -> ggml's type for llama.cpp's type_k/type_v (GGML_TYPE_F32, F16, BF16):
# the same-weights peers cache K and V as kvchat's run does; ggml has no fp8 cache type
GGML_CACHE_TYPES = {"fp32": (0, "F32"), "fp16": (1, "F16"), "bf16": (30, "BF16")}


class LlamaCppPeer:
    """llama-cpp-python on a GGUF file, with the same thread count as torch."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, n_ctx: int, threads: int, precision: str = "", cache_type: int | None = None
                 ) -> None:
        from llama_cpp import Llama  # ImportError: the caller notes the peer as skipped
        self.gguf, self.precision = gguf, precision
        if precision:
            self.name = f"llama.cpp {precision}"
        # cache_type: ggml's type for K and V (GGML_CACHE_TYPES); None: llama.cpp's default, F16
        cache: dict[str, Any] = {"type_k": cache_type, "type_v": cache_type} if cache_type is not None else {}
        with _plain_weight_layouts():
            self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, verbose=False, **cache)

    def generate(self, ids: list[int], steps: int) -> Timing:
        """Greedy; reset first, so llama.cpp's own prefix reuse never shortens the prefill."""
        self.llm.reset()
        times: list[float] = []
        t0 = time.perf_counter()
        for _ in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == steps + 1:
                break
        if not times:
            raise KvchatError(f"llama.cpp peer: no token for a {len(ids)}-token prompt")
        decode = tuple((b - a) * 1000 for a, b in zip(times, times[1:]))
        return Timing(len(ids), (times[0] - t0) * 1000, (times[0] - t0) * 1000, decode)


@contextmanager
def _plain_weight_layouts():
    """llama.cpp's weights in the file's own layout: no "extra buffer types" (llama.cpp's
    --no-repack). On a Xeon with AMX, llama-cpp-python 0.3.36 built for the machine moved the
    Q4_1 file's weights into its AMX layout and then crashed the process (SIGSEGV) in the first
    decode, taking the whole bench with it. Those layouts exist for quantized types only, so
    the F32 and BF16 rows are unchanged. Llama() takes no such argument: its model parameters
    start from llama_model_default_params(), which is wrapped while it runs."""
    import llama_cpp.llama_cpp as lib
    defaults = lib.llama_model_default_params

    def plain():
        params = defaults()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = plain
    try:
        yield
    finally:
        lib.llama_model_default_params = defaults


def load_llama_cpp(source, model_arg: str | None, n_ctx: int, threads: int) -> tuple[LlamaCppPeer | None, str]:
    """(peer, "") or (None, why it is skipped): the optional peer never stops the run."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, LLAMA_CPP_MISSING
    gguf = gguf_for(source, model_arg)
    if gguf is None:
        return None, f"no GGUF file for {source.name}; llama.cpp runs on the bundled model or a --model *.gguf"
    try:
        return LlamaCppPeer(gguf, n_ctx, threads), ""
    except (OSError, ValueError, RuntimeError) as err:
        return None, f"llama.cpp could not load {gguf.name} ({type(err).__name__}: {err}); skipped"


def default_llama_cpp(dtype_name: str) -> tuple[str, ...]:
    """The export in kvchat's own precision (when there is one), and the original file."""
    same = SAME_PRECISION.get(dtype_name)
    return (same, "q4_1") if same else ("q4_1",)


def load_llama_cpp_files(source, model_arg: str | None, files: tuple[str, ...], n_ctx: int, threads: int,
                         kv_dtype: str = "fp32") -> tuple[dict[str, LlamaCppPeer], list[str]]:
    """({series key: peer}, notes): one peer per --llama-cpp choice that loads; a missing
    llama-cpp-python is one note, and nothing is exported for it. The exports of kvchat's own
    weights cache K and V in kvchat's `kv_dtype` (F16, llama.cpp's default, for fp8, which ggml
    has not); the original 4-bit file keeps llama.cpp's defaults."""
    from kvchat.engine.sources import BUNDLED

    from . import gguf_export
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}, [LLAMA_CPP_MISSING]
    peers: dict[str, LlamaCppPeer] = {}
    notes: list[str] = []
    for choice in files:
        key = LLAMA_CPP_FILES[choice]
        if choice == "q4_1":
            gguf = gguf_for(source, model_arg)
            if gguf is None:
                notes.append(f"no GGUF file for {source.name}; llama.cpp runs on the bundled model or a --model *.gguf")
                continue
        elif source.name != BUNDLED or source.random_weights:
            notes.append(f"llama.cpp {choice.upper()} skipped: the same-weights GGUF is exported for the bundled "
                         "model only")
            continue
        else:
            try:
                gguf = gguf_export.export(choice)
            except (KvchatError, OSError) as err:
                notes.append(f"llama.cpp {choice.upper()} skipped: {err}")
                continue
        precision = gguf_export.file_precision(gguf)
        cache_type, cache_name = (None, "") if choice == "q4_1" else GGML_CACHE_TYPES.get(kv_dtype, (None, ""))
        try:
            peers[key] = LlamaCppPeer(gguf, n_ctx, threads, precision, cache_type)
        except (OSError, ValueError, RuntimeError) as err:
            notes.append(f"llama.cpp could not load {gguf.name} ({type(err).__name__}: {err}); skipped")
            continue
        if choice == "q4_1":
            what = "the GGUF kvchat's weights were converted from: its own quantized weights, llama.cpp's default F16 cache"
        elif cache_type is None:
            what = (f"an export of the safetensors kvchat loads: the same weights; K and V cached in F16, llama.cpp's "
                    f"default, against kvchat's {kv_dtype} (ggml has no such cache type)")
        else:
            what = (f"an export of the safetensors kvchat loads: the same weights, K and V cached in "
                    f"{cache_name} like kvchat's {kv_dtype} cache")
        notes.append(f"llama.cpp {precision} runs {gguf} ({what}), {threads} threads")
    return peers, notes


def same_weights_key(dtype_name: str, peers: dict[str, LlamaCppPeer]) -> str | None:
    """The series of llama.cpp on the export in kvchat's own precision, when it was measured."""
    same = SAME_PRECISION.get(dtype_name)
    key = LLAMA_CPP_FILES[same] if same else None
    return key if key in peers else None


def gguf_for(source, model_arg: str | None) -> Path | None:
    """The GGUF the engine's weights were converted from, when there is one."""
    from kvchat.engine.sources import BUNDLED, bundled_gguf
    if source.random_weights:
        return None
    if model_arg and model_arg.strip().endswith(".gguf"):
        return Path(model_arg.strip()).expanduser()
    if source.name == BUNDLED:
        return bundled_gguf()
    return None
