"""Sink-and-window eviction (StreamingLLM: Xiao et al., "Efficient Streaming Language Models
with Attention Sinks", 2023).

A conversation under the `sink-window` policy keeps its first block(s), the "attention
sinks", and the most recent tokens, and evicts whole blocks in between so that its cache
never holds more than the cap. Positions are assigned within the cache, as the paper does:
a token's RoPE position is its index in the cache, not in the text. Since keys are stored
after RoPE, evicting E tokens from the middle re-rotates every later key by -E positions in
place (R(p - E) = R(-E) R(p)), so the window stays contiguous in position. The kept K/V
are not recomputed: above the first layer they still carry what the evicted tokens
contributed when they were computed, as in the paper.
"""
from __future__ import annotations

import torch

from .attention import bits, quantize_fp8
from .errors import KvchatError
from .model import apply_rope

DEFAULT_SINK_TOKENS = 4
CHUNK = 2048


def sink_blocks(sink_tokens: int, block_size: int) -> int:
    """Sinks are kept in whole blocks: 4 sink tokens keep the first block."""
    return -(-sink_tokens // block_size) if sink_tokens > 0 else 0


def check_window_cap(cap: int, sink_tokens: int, block_size: int) -> None:
    """A sink-window cap must hold the sink block(s) and two more blocks: one filling while
    the oldest kept one waits to be evicted."""
    least = (sink_blocks(sink_tokens, block_size) + 2) * block_size
    if cap < least:
        raise KvchatError(f"sink-window needs a cap of at least {least} tokens (sink blocks plus two "
                          f"blocks of {block_size}), got {cap}")


@torch.inference_mode()
def rerotate_keys(model, pool, block_ids: list[int], delta: int) -> None:
    """Shift the RoPE position of every key in `block_ids` by `delta` (negative: earlier)."""
    if not block_ids or delta == 0:
        return
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.data.device)
    d = model.geom.head_dim
    angle = torch.tensor([float(delta)], device=pool.data.device)
    freqs = torch.outer(angle, model.inv_freq)                            # (1, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)                               # (1, d)
    cos, sin = emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]   # (1, 1, 1, d)
    for i in range(model.geom.n_layers):
        k_cache, _, k_scale, _ = pool.layer(i)
        keys = bits(k_cache).index_select(0, ids).view(k_cache.dtype).float()  # (n, bs, hk, d)
        if k_scale is not None:
            keys = keys * k_scale.index_select(0, ids).unsqueeze(-1)
        n, bs, hk, _ = keys.shape
        rotated = apply_rope(keys.view(n * bs, hk, d), cos[0], sin[0]).view(n, bs, hk, d)
        if k_scale is not None:
            q, s = quantize_fp8(rotated.view(n * bs, hk, d))
            bits(k_cache).index_copy_(0, ids, bits(q).view(n, bs, hk, d))
            k_scale.index_copy_(0, ids, s.view(n, bs, hk))
        else:
            k_cache.index_copy_(0, ids, rotated.to(k_cache.dtype))


def evict_middle(conv, n_blocks: int) -> int:
    """Evict the n oldest blocks after the sinks from `conv`, re-rotating the rest. Returns
    the number of tokens evicted."""
    eng, seq = conv.engine, conv.seq
    bs = seq.block_size
    first = sink_blocks(conv.sink_tokens, bs)
    n_blocks = min(n_blocks, max(len(seq) // bs - first, 0))
    if n_blocks <= 0:
        return 0
    # re-rotate first: if it fails, nothing is freed
    rerotate_keys(eng.model, eng.pool, seq.block_table[first + n_blocks:], -n_blocks * bs)
    eng.blocks.evict(seq, first, n_blocks)
    conv.evicted_tokens += n_blocks * bs
    return n_blocks * bs


def claim_window(conv, ids: list[int]) -> int:
    """Start a sink-window turn: keep what the cache holds of the text `ids` still begins
    with, drop any tail the new rendering changed, and return how many tokens are kept."""
    seq, bm = conv.seq, conv.engine.blocks
    if not seq.private:  # start from private, unindexed blocks: their keys will be rewritten
        bm.free(seq)
        seq.private = True
    common = 0
    for x, y in zip(seq.logical, ids[:-1]):
        if x != y:
            break
        common += 1
    drop = len(seq.logical) - common
    if drop > len(seq) - sink_blocks(conv.sink_tokens, seq.block_size) * seq.block_size:
        bm.free(seq, keep_index=False)  # the change reaches evicted text: start over
        seq.private, common = True, 0
    elif drop:
        bm.truncate(seq, drop)
    return common


def prefill_window(conv, new_ids: list[int], chunk_size: int = CHUNK, all_logits: bool = False,
                   steps: bool = False):
    """Prefill in chunks that fit the window (conv.limit: the cap, or the model's maximum),
    evicting middle blocks before each. Returns the last token's logits (vocab,), or every
    token's (T, vocab). With steps, a generator instead: yields the tokens done after each
    chunk and returns the logits."""
    chunks = _window_chunks(conv, new_ids, chunk_size, all_logits)
    if steps:
        return chunks
    while True:
        try:
            next(chunks)
        except StopIteration as end:
            return end.value


def _window_chunks(conv, new_ids: list[int], chunk_size: int, all_logits: bool):
    seq = conv.seq
    bs = seq.block_size
    size = min(conv.limit - (sink_blocks(conv.sink_tokens, bs) + 1) * bs, chunk_size)
    outs = []
    for c0 in range(0, len(new_ids), size):
        chunk = new_ids[c0:c0 + size]
        over = len(seq) + len(chunk) - conv.limit
        if over > 0:
            evict_middle(conv, -(-over // bs))
        p0 = len(seq)
        conv.reserve(p0 + len(chunk))
        outs.append(conv.prefill_chunk(chunk, p0, last_only=not all_logits))
        yield min(c0 + size, len(new_ids))
    return torch.cat(outs) if all_logits else outs[-1][0]
