"""A Llama decoder in plain torch, reading and writing its K/V through the paged pool.

References: Touvron et al., "LLaMA" (2023) and "Llama 2" (2023) for RMSNorm, SwiGLU and
RoPE; Ainslie et al., "GQA" (2023); Meta's Llama 3.1 release for the "llama3" RoPE
frequency scaling. The layout follows transformers' LlamaForCausalLM weights (rotate-half
RoPE), so the same safetensors load into both and their logits can be compared.

Q, K and V share one fused projection and gate/up another: fewer, larger matmuls per
layer, which is what a batch-1 decode step on a CPU is bound by. One forward takes a
`Batch`: one decode row from each of several sequences and prompt chunks of others, so
every weight is read once per step for all of them (what continuous batching is for);
attention alone is per sequence, each reading its own cache through its own block table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native, native_step
from .attention import causal_attention, paged_decode, paged_prefill, write_kv
from .geometry import Geometry
from .kv_cache import KVPool
from .native_build import computes_bf16


Runs = tuple[tuple[int, int], ...]   # a block table as ((first id, blocks), ...): see Sequence.runs


@dataclass(slots=True)
class Step:
    """Where one forward pass over one sequence reads and writes the cache."""
    block_table: torch.Tensor  # (max_blocks,) int32 on the model's device
    slots: torch.Tensor        # (T,) int64: flat pool slots of the new tokens
    prefix_len: int            # tokens already cached before this pass
    decode: bool               # one new token against the cache
    # (1,) int32/int64 on the device: prefix_len + 1 for a decode step. Given, the step
    # reads its length from the device (a CUDA graph replays it with new values); left
    # None, forward makes it from prefix_len, and the CPU path reads that int directly.
    context_lens: torch.Tensor | None = None
    # The table as runs of consecutive block ids, ((first id, blocks), ...), when the caller
    # knows them (Sequence.runs): the CPU path reads each run as a view without reading the table.
    runs: Runs | None = None

    def batch(self, t: int) -> Batch:
        """The same pass as a Batch of t rows."""
        if self.decode:
            lens = self.context_lens
            known = None
            if lens is None:
                known = self.prefix_len + 1
                lens = torch.tensor([known], dtype=torch.int32, device=self.block_table.device)
            return Batch(self.slots, self.prefix_len + t, decode=1, block_tables=self.block_table[None],
                         context_lens=lens, max_context=known, runs=self.runs)
        return Batch(self.slots, self.prefix_len + t,
                     prefills=(Chunk(t, self.block_table, self.prefix_len, self.runs),))


@dataclass(frozen=True, slots=True)
class Chunk:
    """A run of consecutive prompt rows of one sequence in a Batch: its tokens at cache
    positions prefix_len .. prefix_len + length - 1, attending to the prefix and themselves."""
    length: int
    block_table: torch.Tensor   # (max_blocks,) int32 on the device
    prefix_len: int
    runs: Runs | None = None


@dataclass(slots=True)
class Batch:
    """Where one forward pass over several sequences reads and writes the cache: the weights
    are read once for every row. Rows 0 .. decode-1 are one token each of `decode` different
    sequences (each attends to its own cache through its own table and length); the rows
    after them are the `prefills` chunks, in order."""
    slots: torch.Tensor                       # (T,) int64: flat pool slots of every row
    max_position: int                         # 1 + the largest row position (the RoPE table covers it)
    decode: int = 0                           # B: the number of one-token decode rows, first
    block_tables: torch.Tensor | None = None  # (B, max_blocks) int32: the decode rows' tables
    context_lens: torch.Tensor | None = None  # (B,) int32: rows each attends to, itself included
    max_context: int | None = None            # max of context_lens when the host knows it (spares a read)
    runs: Runs | None = None                  # B = 1: its table as runs of consecutive ids
    prefills: tuple[Chunk, ...] = ()

    @property
    def rows(self) -> int:
        return self.decode + sum(c.length for c in self.prefills)


def rope_inv_freq(geom: Geometry) -> torch.Tensor:
    """(head_dim/2,) inverse frequencies, with Llama 3.1's "llama3" scaling when configured."""
    d = geom.head_dim
    inv = 1.0 / (geom.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = geom.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor = sc["factor"]
        low, high = sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif sc and sc.get("rope_type", sc.get("type")) not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {sc!r}; supported: default, llama3")
    return inv.float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if native.gemv_serves(x, w):  # a decode step's rows (1 to 16) in fp32 on CPU: one C call, not torch's eight ops
        return native.rms_norm(x, w, eps)
    if x.dtype == torch.float32 and native_step.chunk_serves(x, w):  # a prompt chunk's: threads over the rows
        return native_step.add_rms_norm_rows(x, None, w, eps)
    if x.dtype == torch.float32 and _FUSED_RMS_NORM:
        return F.rms_norm(x, w.shape, w, eps)  # one op instead of eight: decode is op-bound on CPU
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


_FUSED_RMS_NORM = hasattr(F, "rms_norm")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: (T, hidden), set to x + residual in place when residual is given (residual may be
    bf16 beside fp32 x: a bf16 prefill's product output); returns RMSNorm(x) * w in dtype
    (default x's: bf16 for a bf16 prefill's next product). fp32 CPU rows, a decode step's or a
    prompt chunk's, take one C call for both (native_step, threads over the rows)."""
    dtype = x.dtype if dtype is None else dtype
    if (x.dtype == torch.float32 and dtype in (torch.float32, torch.bfloat16) and native_step.chunk_serves(x, w)
            and (residual is None or (native_step.chunk_serves(residual) and residual.shape == x.shape))):
        return native_step.add_rms_norm_rows(x, residual, w, eps, dtype)
    if residual is not None:
        x.add_(residual)
    return rms_norm(x, w, eps).to(dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 inter), gate then up -> silu(gate) * up (T, inter): one C call for CPU
    rows (fp32, or a bf16 prefill's), two torch ops otherwise."""
    if native_step.chunk_serves(gate_up):
        return native_step.silu_mul_rows(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                    # (T, inter) each
    return F.silu(gate) * up


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None, n_heads: int) -> torch.Tensor:
    """qkv: (T, (hq + 2 hk) d); cos, sin: the whole tables (max_pos, 1, d). Writes RoPE(k) and
    v into their slots, returns RoPE(q) (T, hq, d): one C call (native_step.rope_write) where
    it serves, else apply_rope and write_kv."""
    t = qkv.shape[0]
    hk, d = k_cache.shape[2], k_cache.shape[3]
    qkv = qkv.to(cos.dtype)      # a bf16 prefill's product output: RoPE in the tables' dtype
    if native_step.rope_serves(qkv, cos, k_cache, positions, slots):
        return native_step.rope_write(qkv, cos, sin, positions, k_cache, v_cache, slots, k_scale, v_scale, n_heads)
    qk = apply_rope(qkv[:, :(n_heads + hk) * d].view(t, n_heads + hk, d), cos[positions], sin[positions])
    q, k = qk[:, :n_heads], qk[:, n_heads:]                                # (T, hq, d), (T, hk, d)
    write_kv(k_cache, v_cache, k, qkv[:, (n_heads + hk) * d:].view(t, hk, d), slots, k_scale, v_scale)
    return q


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T. A decode step's fp32 CPU rows (1 to native.max_rows(), one per sequence)
    take the C kernel (engine/native.py) where it compiled: each weight row read once for all.
    Otherwise one row splits w's rows across a batched matmul: a single-row product runs on
    one thread in MKL, a batch of S runs on S threads (the same dot products, so the same
    numbers; a decode step's weight reads went 45 ms -> 25 ms on 2 cores)."""
    if native.gemv_serves(x, w):
        return native.gemv(x, w)
    if native.amx_serves(x, w):   # a short bf16 prefill chunk: its rows widened (exactly), summed in fp32, rounded
        return native.gemv(x.float(), w).to(torch.bfloat16)
    if w.dtype != x.dtype:     # bf16 weights, fp32 rows (Llama.act_dtype): a prefill's GEMM
        if WIDEN_BF16 and x.device.type == "cpu" and x.shape[0] >= WIDEN_MIN_ROWS:
            return widened(x, w)
        return (x.to(w.dtype) @ w.T).to(x.dtype)   # in bf16 (AMX where present)
    s = torch.get_num_threads()
    if x.shape[0] != 1 or s < 2 or x.device.type != "cpu" or w.shape[0] % s:
        return x @ w.T
    n, k = w.shape
    return torch.bmm(x.expand(s, 1, k), w.view(s, n // s, k).transpose(1, 2)).reshape(1, n)  # (1, n)


# Many fp32 rows against bf16 weights on a CPU without bf16 arithmetic: torch's bf16 GEMM is
# emulated there (22 GFLOP/s for 128 rows against Llama 3.1 8B's 14336 x 4096 on the AVX2
# EPYC, where its fp32 GEMM gave 140), so the weights are widened to fp32 a slice at a time and
# the rows stay fp32 (no rounding of x to bf16 either). Llama 3.1 8B's prefill: 2 tokens/s
# before, 9 after. Fewer rows than WIDEN_MIN_ROWS keep the bf16 product (a decode step without
# the C kernels): on that matrix widening took 11 / 30 / 30 / 37 ms for 1 / 4 / 8 / 16 rows,
# the bf16 product 6 / 27 / 56 / 88 ms.
WIDEN_BF16 = not computes_bf16()
# A prefill chunk of at least this many rows, with bf16 weights on a CPU with bf16 arithmetic
# (Llama.prefill_dtype): its attention takes q and the gathered K/V rounded to bf16 (as the
# chunk's products round their rows) for torch's bf16 kernel, AMX or AVX512-BF16: 3x its fp32
# speed on the bundled model's heads (512 rows against 1,024 cached: 2.3 against 6.1 ms on a
# 2-core Xeon with AMX); the rows its products take and give stay bf16 from the norm to the
# residual add (Llama._rows_dtype). The residual stream stays fp32, and decode steps attend
# in fp32 (the C kernel).
PREFILL_BF16_MIN_ROWS = 16
WIDEN_MIN_ROWS = 8
WIDEN_SLICE_BYTES = 4 << 20      # fp32 bytes of weight rows widened at a time: L2 to L3-sized


def widened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, k) fp32 @ w.T for bf16 w (n, k): w's rows widened to fp32 WIDEN_SLICE_BYTES at a
    time into one reused buffer, each slice an fp32 GEMM into its columns of the output."""
    n, k = w.shape
    rows = max(1, min(n, WIDEN_SLICE_BYTES // (4 * k)))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    buf = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    for i in range(0, n, rows):
        part = buf[:min(rows, n - i)]
        part.copy_(w[i:i + rows])
        torch.mm(x, part.T, out=out[:, i:i + part.shape[0]])
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, d); cos, sin: (T, 1, d). Rotate-half RoPE, x cos + (-x2, x1) sin, computed
    half by half into one output (no negated copy, no concatenation): the same roundings, so
    the same bits as the plain formula and as the Triton rope_write kernel."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half].sub_(x2 * sin[..., :half])
    out[..., half:].add_(x1 * sin[..., half:])
    return out


class Layer:
    __slots__ = ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm")

    def __init__(self, wqkv, wo, w_gate_up, w_down, attn_norm, mlp_norm):
        self.wqkv, self.wo = wqkv, wo                 # (q+2kv, hidden), (hidden, q)
        self.w_gate_up, self.w_down = w_gate_up, w_down  # (2*inter, hidden), (hidden, inter)
        self.attn_norm, self.mlp_norm = attn_norm, mlp_norm


class Llama:
    """Weights plus a forward pass; the engine decides which blocks it uses."""

    def __init__(self, geom: Geometry, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.geom = geom
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.act_dtype = self.dtype     # the rows' dtype: see fp32_rows()
        # a prefill chunk's attention and gate/up/down rows in this dtype (fp32_rows())
        self.prefill_dtype = self.dtype
        self.scale = geom.head_dim ** -0.5
        self.inv_freq = rope_inv_freq(geom).to(self.device)
        self._cos = self._sin = torch.empty(0)
        self._extend_rope(min(geom.max_position, 8192))

    def fp32_rows(self) -> None:
        """bf16 weights on a CPU with the C kernels (the engine asks for this): only the
        matrices stay bf16 (half the bytes a decode step reads, native.gemv's bf16 path); the
        rows, norms, RoPE and K/V are fp32, so the fp32 cache kernels serve and nothing is
        rounded to bf16 between the products. A prefill's GEMM runs in bf16 (AMX where present)."""
        self.act_dtype = torch.float32
        if computes_bf16():
            self.prefill_dtype = torch.bfloat16
        self.norm = self.norm.float()
        for layer in self.layers:
            layer.attn_norm, layer.mlp_norm = layer.attn_norm.float(), layer.mlp_norm.float()
        self._extend_rope(self._cos.shape[0])

    # ---- rotary tables -----------------------------------------------------------------------
    def _extend_rope(self, n: int) -> None:
        t = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)                      # (n, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                    # (n, d)
        self._cos = emb.cos().to(self.act_dtype)[:, None, :]        # (n, 1, d)
        self._sin = emb.sin().to(self.act_dtype)[:, None, :]

    def rope_tables(self, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables, (positions, 1, head_dim) each, extended to n positions
        first if they cover fewer. A CUDA graph keeps reading the tensors it captured."""
        if n > self._cos.shape[0]:
            self._extend_rope(n)
        return self._cos, self._sin

    def rope(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope_cover(max_pos)
        return cos[positions], sin[positions]

    def rope_cover(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables, covering positions 0 .. max_pos at least (doubled when they grow,
        so that a conversation does not rebuild them every step)."""
        if max_pos >= self._cos.shape[0]:
            self._extend_rope(max(2 * self._cos.shape[0], max_pos + 1))
        return self._cos, self._sin

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: Step | Batch, pool: KVPool,
                last_only: bool = True) -> torch.Tensor:
        """ids, positions: (T,). Writes the T new K/V rows and returns fp32 logits: with
        last_only, one row per decode row and one per prefill chunk (its last token), in
        order; else (T, vocab).

        A batch of decode rows alone, on a CPU with the C kernels, runs as one C call
        (native_step.decode_step); otherwise layer by layer here, the residual add fused into
        the next norm, RoPE into the cache write, SiLU-and-multiply into one op (each one C
        call where the rows take the C products, torch ops otherwise)."""
        g = self.geom
        t = ids.shape[0]
        batch = step.batch(t) if isinstance(step, Step) else step
        hq, d = g.n_heads, g.head_dim
        x = self.embed[ids].to(self.act_dtype)                            # (T, hidden): a copy, the residual stream
        if native_step.step_serves(x, batch):
            logits = native_step.decode_step(self, x, positions, batch, pool)
            if logits is not None:
                return logits
        cos, sin = self.rope_cover(batch.max_position)                    # (max_pos, 1, d) each
        last = len(self.layers) - 1
        h = add_rms_norm(x, None, self.layers[0].attn_norm, g.norm_eps, self._rows_dtype(x))
        for i, layer in enumerate(self.layers):
            k_cache, v_cache, k_scale, v_scale = pool.layer(i)
            q = rope_write(linear(h, layer.wqkv), cos, sin, positions, k_cache, v_cache, batch.slots,
                           k_scale, v_scale, hq)                          # (T, hq, d); K/V written
            keep = last_only and i == last and t > batch.decode + len(batch.prefills)
            if keep:  # the last layer's K/V are written; only the rows with logits go on
                x, q = self._last_rows(x, batch), self._last_rows(q, batch)  # (R, hidden), (R, hq, d)
            rows = self._rows_dtype(x)
            o = self._attend(q, batch, (k_cache, v_cache, k_scale, v_scale), keep, rows)  # (T or R, hq, d)
            h = add_rms_norm(x, linear(o.reshape(x.shape[0], hq * d), layer.wo), layer.mlp_norm, g.norm_eps, rows)
            after = self.layers[i + 1].attn_norm if i < last else self.norm
            h = add_rms_norm(x, self._gate_up_down(h, layer), after, g.norm_eps, rows if i < last else None)
        return linear(h, self.lm_head).float()                            # (T or R, vocab)

    def _gate_up_down(self, h: torch.Tensor, layer: Layer) -> torch.Tensor:
        """down(silu(gate) * up) of h's rows. A prefill's rows against bf16 weights come in
        bf16 (_rows_dtype) and stay bf16 through both products: the widest rows are never
        copied to fp32 and back."""
        return linear(silu_mul(linear(h, layer.w_gate_up)), layer.w_down)

    def _narrow_prefill(self, rows: torch.Tensor) -> bool:
        """Whether these prefill rows go to prefill_dtype (PREFILL_BF16_MIN_ROWS)."""
        return self.prefill_dtype != rows.dtype and rows.shape[0] >= PREFILL_BF16_MIN_ROWS

    def _rows_dtype(self, rows: torch.Tensor) -> torch.dtype:
        """The dtype of the products' input and output rows for these rows: prefill_dtype for a
        bf16 prefill's (each product rounds its rows to bf16 and gives bf16 either way, so
        handing them on in bf16 changes no bit and saves a cast each way), else the rows' own."""
        return self.prefill_dtype if self._narrow_prefill(rows) else rows.dtype

    def _attend(self, q: torch.Tensor, batch: Batch, cache, last_rows: bool,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """q: (T, hq, d), or with last_rows (decode + chunks, hq, d): the decode rows, then
        each chunk's rows (its last row alone with last_rows). Returns the same shape, in
        dtype (default q's)."""
        dtype = q.dtype if dtype is None else dtype
        k_cache, v_cache, k_scale, v_scale = cache
        b = batch.decode
        out = []
        if b:
            out.append(paged_decode(q[:b], k_cache, v_cache, batch.block_tables, batch.context_lens, self.scale,
                                    k_scale, v_scale, max_context=batch.max_context,
                                    runs=batch.runs))                     # (B, hq, d)
        row = b
        for c in batch.prefills:
            if last_rows:   # its last row against the whole chunk's cached rows
                out.append(paged_prefill(q[row:row + 1], k_cache, v_cache, c.block_table, c.prefix_len + c.length - 1,
                                         self.scale, k_scale, v_scale, runs=c.runs))  # (1, hq, d)
                row += 1
            else:
                qc = q[row:row + c.length]
                if self._narrow_prefill(qc):
                    qc = qc.to(self.prefill_dtype)
                out.append(paged_prefill(qc, k_cache, v_cache, c.block_table, c.prefix_len,
                                         self.scale, k_scale, v_scale, runs=c.runs))  # (T_c, hq, d)
                row += c.length
        out = [o.to(dtype) for o in out]
        return out[0] if len(out) == 1 else torch.cat(out)

    @staticmethod
    def _last_rows(x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The decode rows and each chunk's last row: the rows whose logits are wanted."""
        if batch.decode == 0 and len(batch.prefills) == 1:
            return x[-1:]
        ends, row = list(range(batch.decode)), batch.decode
        for c in batch.prefills:
            row += c.length
            ends.append(row - 1)
        return x[torch.tensor(ends, device=x.device)]

    @torch.inference_mode()
    def forward_dense(self, ids: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """The whole sequence from scratch, no cache read or kept: what every decode step
        costs without a KV cache. ids: (T,) -> logits (T or 1, vocab) fp32."""
        g = self.geom
        t = ids.shape[0]
        hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
        positions = torch.arange(t, device=self.device)
        cos, sin = self.rope(positions, t)
        x = self.embed[ids].to(self.act_dtype)
        for layer in self.layers:
            h = rms_norm(x, layer.attn_norm, g.norm_eps)
            q, k, v = linear(h, layer.wqkv).split((hq * d, hk * d, hk * d), dim=-1)
            q = apply_rope(q.view(t, hq, d), cos, sin).transpose(0, 1)    # (hq, T, d)
            k = apply_rope(k.view(t, hk, d), cos, sin).transpose(0, 1)    # (hk, T, d)
            v = v.view(t, hk, d).transpose(0, 1)
            o = causal_attention(q, k, v, 0, self.scale).transpose(0, 1)  # (T, hq, d)
            x = x + linear(o.reshape(t, hq * d), layer.wo)
            x = x + self._mlp(x, layer)
        return self._logits(x[-1:] if last_only else x)

    def _mlp(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        h = rms_norm(x, layer.mlp_norm, self.geom.norm_eps)
        gate, up = linear(h, layer.w_gate_up).chunk(2, dim=-1)            # (T, inter) each
        return linear(F.silu(gate) * up, layer.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, self.norm, self.geom.norm_eps), self.lm_head).float()  # (T, vocab)

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads: every matrix and norm, but of an
        embedding table not shared with the output head only the rows it looks up (one)."""
        total = self.weight_bytes
        if self.lm_head is not self.embed:
            total -= self.embed.nbytes - self.embed[0].nbytes
        return total

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, layer.attn_norm, layer.mlp_norm]
        return sum(t.nbytes for t in tensors)
