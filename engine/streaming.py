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


Shift = tuple[list[int], int]   # (block ids, delta): keys to re-rotate by delta positions


def evict_middle(blocks, seq, sink_tokens: int, n_blocks: int) -> Shift | None:
    """Cut the n oldest blocks after the sinks out of `seq` (a block manager's sequence).
    Returns the re-rotation the kept blocks after them need, (block ids, -evicted tokens),
    which must run (`rerotate_keys`) before the next forward reads or writes them; None
    when nothing was cut."""
    bs = seq.block_size
    first = sink_blocks(sink_tokens, bs)
    n_blocks = min(n_blocks, max(len(seq) // bs - first, 0))
    if n_blocks <= 0:
        return None
    moved = seq.block_table[first + n_blocks:]
    blocks.evict(seq, first, n_blocks)
    seq.evicted_tokens += n_blocks * bs
    return list(moved), -n_blocks * bs


def claim_window(blocks, seq, ids: list[int], sink_tokens: int) -> int:
    """Start a sink-window turn: keep what the cache holds of the text `ids` still begins
    with, drop any tail the new rendering changed, and return how many tokens are kept."""
    if not seq.private:  # start from private, unindexed blocks: their keys will be rewritten
        blocks.free(seq)
        seq.private = True
    common = 0
    for x, y in zip(seq.logical, ids[:-1]):
        if x != y:
            break
        common += 1
    drop = len(seq.logical) - common
    if drop > len(seq) - sink_blocks(sink_tokens, seq.block_size) * seq.block_size:
        blocks.free(seq, keep_index=False)  # the change reaches evicted text: start over
        seq.private, common = True, 0
    elif drop:
        blocks.truncate(seq, drop)
    return common


def window_chunk(limit: int, sink_tokens: int, block_size: int, chunk_size: int = CHUNK) -> int:
    """The most prompt tokens one window chunk may take: the window (the cap, or the model's
    maximum) less the sink blocks and one block, so a chunk always fits after an eviction."""
    return min(limit - (sink_blocks(sink_tokens, block_size) + 1) * block_size, chunk_size)


def make_window_room(blocks, seq, sink_tokens: int, limit: int, n_tokens: int) -> Shift | None:
    """Evict middle blocks so that n_tokens more fit under `limit`."""
    over = len(seq) + n_tokens - limit
    if over <= 0:
        return None
    return evict_middle(blocks, seq, sink_tokens, -(-over // seq.block_size))


@torch.inference_mode()
def prefill_window(model, pool, blocks, seq, ids: list[int], limit: int, sink_tokens: int,
                   chunk_size: int = CHUNK, all_logits: bool = False) -> torch.Tensor:
    """Feed `ids` to an empty private `seq` directly (no scheduler: an experiment's loop, e.g.
    perplexity under a window) in window chunks, evicting before each. Returns the last
    token's logits (vocab,), or every token's (T, vocab)."""
    from .model import Step
    size = window_chunk(limit, sink_tokens, seq.block_size, chunk_size)
    dev = pool.data.device
    outs = []
    for c0 in range(0, len(ids), size):
        chunk = ids[c0:c0 + size]
        shift = make_window_room(blocks, seq, sink_tokens, limit, len(chunk))
        if shift is not None:
            rerotate_keys(model, pool, *shift)
        p0 = len(seq)
        blocks.allocate(seq, seq.blocks_needed(p0 + len(chunk)))
        step = Step(seq.table, torch.tensor(seq.slots(p0, p0 + len(chunk)), device=dev), p0, decode=False,
                    runs=seq.runs)
        outs.append(model.forward(torch.tensor(chunk, device=dev), torch.arange(p0, p0 + len(chunk), device=dev),
                                  step, pool, last_only=not all_logits))
        blocks.append(seq, chunk)
    return torch.cat(outs) if all_logits else outs[-1][0]
