"""Every wording helper in one place: numbers, durations and figures as the words kvchat shows.

The app, the CLI and the saved Markdown say the same thing the same way: a turn's stats line,
a duration, a plural, the prefill progress line, the sizing sentence of `kvchat info --tokens`
and `/whatif` (the arithmetic is kvchat/engine/sizing.py; this only words it). And text that
kvchat did not write itself (a reply, a file, a server's words, a path) is shown through
`shown()`: inert to the terminal, with every secret kvchat knows of redacted.
"""
from __future__ import annotations

import base64
import os
import re
from typing import TYPE_CHECKING

from rich.cells import cell_len

from kvchat.engine.sizing import WhatIf, what_if
from kvchat.engine.units import human_bytes, parse_bytes

if TYPE_CHECKING:
    from kvchat.engine.telemetry import PrefillProgress, TurnSummary

RANDOM_WEIGHTS = ("random weights (--random-weights): the text is gibberish by design; the cache, its blocks "
                  "and the latency are real")
SLOW_MS = 10_000.0      # durations from here on read in seconds
BAR = 20        # the prefill bar's cells
NO_BUDGET = "give --kv-budget to compare it with a budget"


# ---- text from outside -------------------------------------------------------------------------
# C0 controls but tab and newline, DEL, the C1 controls (8-bit CSI and OSC to some terminals),
# and the bidirectional overrides that reorder what a reader sees
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
API_KEY_ENVS = ("KVCHAT_API_KEY", "OPENAI_API_KEY")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
_SECRETS: set[str] = set()
SECRET_MIN = 4          # shorter values would blank out ordinary words; the URL form is still caught
REDACTED = "***"


def inert(text: str) -> str:
    """`text` as it may reach a terminal: every control character but newline and tab shown as
    a visible escape (ESC as `\\x1b`, U+202E as `\\u202e`), so no sequence in a reply, a file
    or a server's answer can retitle the terminal, write the clipboard, clear the screen or
    leave the alternate screen. Idempotent; CRLF line ends are plain newlines."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(_visible, text.replace("\r\n", "\n"))


def _visible(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def keep_secret(value: str | None) -> None:
    """Remember a secret (an API key, a URL's password) so that `redact` hides it from every
    line kvchat prints or writes, whatever a server sends back."""
    if value and len(value) >= SECRET_MIN:
        _SECRETS.add(value)


def keep_url_secrets(username: str | None, password: str | None) -> None:
    """A URL's credentials in every form they travel in: as given, and as the Basic
    authorization header's base64 that a server may echo back."""
    if not (username or password):
        return
    pair = f"{username or ''}:{password or ''}"
    for value in (password, pair, base64.b64encode(pair.encode()).decode()):
        keep_secret(value)


def redact(text: str) -> str:
    """`text` without the secrets kvchat knows of: the API keys in its environment, those kept
    with `keep_secret`, and the user:password part of any URL."""
    return _USERINFO.sub(rf"\1{REDACTED}@", _replace_secrets(text))


class Redactor:
    """Redacts a text that arrives in pieces (a streamed reply): the tail that could be the
    start of a secret is held back until the next piece shows whether it is one."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        text = _replace_secrets(self._held + piece)
        keep = max((k for s in _known_secrets() for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _known_secrets() -> set[str]:
    return _SECRETS | {v for v in (os.environ.get(n) for n in API_KEY_ENVS) if v and len(v) >= SECRET_MIN}


def _replace_secrets(text: str) -> str:
    for secret in sorted(_known_secrets(), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def shown(text: object) -> str:
    """Outside text as kvchat shows it anywhere: secrets redacted, then made inert."""
    return inert(redact(str(text)))


# what the engine's cap refusal (engine/policy.py) offers, in the chat's words
_CHAT_REMEDIES = re.compile(r"(raise the cap \(/cap\), )?switch to /policy drop-oldest \(or sink-window\), or start "
                            r"a new conversation \(ctrl\+n\) with what matters")


def command_remedies(line: str, flags: bool) -> str:
    """A cap refusal as a command (ask, replay, crowd) words it: the engine offers the chat's
    remedies (/cap, /policy, a new conversation), which a command has none of. With `flags`
    (replay's --cap and --policy) they become flags; without, a shorter message is the way."""
    def words(m: re.Match) -> str:
        if not flags:
            return "send a shorter message"
        return f"{'raise --cap, ' if m.group(1) else ''}give --policy drop-oldest (or sink-window), or send less"
    return _CHAT_REMEDIES.sub(words, line)


def plural(n: int, word: str) -> str:
    """'1 turn', '2 turns', '1,024 tokens'."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def per_token(total: int, scales: int | None = 0) -> str:
    """A token's bytes as kvchat counts them everywhere, the data and (fp8) its scales, with
    the split: '46,080 B', or '12,240 B (11,520 B data + 720 B scales)'."""
    return f"{total:,} B ({total - scales:,} B data + {scales:,} B scales)" if scales else f"{total:,} B"


def duration(ms: float) -> str:
    """212 ms, 9,870 ms, then 10.2 s and 212.2 s: no one reads '212234 ms'."""
    return f"{ms / 1000:,.1f} s" if ms >= SLOW_MS else f"{ms:,.0f} ms"


def fit_segments(text: str, room: int, sep: str = " · ") -> str:
    """Drop whole trailing " · " segments until text fits in room columns, so a narrow
    terminal cuts the line between words, never inside one (the first segment stays)."""
    parts = text.split(sep)
    while len(parts) > 1 and cell_len(sep.join(parts)) > room:
        parts.pop()
    return sep.join(parts)


# ---- the stats line under a reply --------------------------------------------------------------
STOP_WORDS = {None: "", "eos": "", "max_tokens": "max tokens reached", "cap": "stopped at the cap",
              "cancelled": "stopped", "max_position": "stopped at the model's maximum context",
              "cut": "cut: the server's stream ended before the reply did",
              "timeout": "cut: the server stopped sending (a --timeouts deadline passed)"}


def stats_line(r: TurnSummary) -> str:
    """The line under a reply: tokens, TTFT, speed, prompt reuse."""
    line = (f"{plural(r.generated_tokens, 'token')} · TTFT {duration(r.ttft_ms)} · "
            f"{r.tokens_per_s:.1f} tok/s · prompt {r.prompt_tokens:,}: ")
    if r.reused_tokens is None or r.computed_tokens is None:     # a server that does not report it
        line += "reuse not reported"
    else:
        line += f"{r.reused_tokens:,} reused, {r.computed_tokens:,} computed"
    if r.mode == "off":
        line += " · cache off"
    if r.dropped_messages:
        line += f" · dropped {plural(r.dropped_messages, 'old message')}"
    if r.evicted_blocks:        # "evicted": sink-window's, from this conversation's middle
        n = r.evicted_blocks
        line += f" · evicted {n:,} block{'s' if n > 1 else ''} from the middle"
    if r.reclaimed_blocks:      # "reclaimed": other prefixes' cached blocks, taken for this turn
        n = r.reclaimed_blocks
        line += f" · reclaimed {n:,} cached block{'s' if n > 1 else ''}"
    if r.preempted:
        n = r.preempted
        line += f" · preempted {n:,} other conversation{'s' if n > 1 else ''}"
    if r.recomputed_tokens:
        line += f" · recomputed {r.recomputed_tokens:,} tokens lost to preemption"
    reason = STOP_WORDS.get(r.stop_reason, inert(r.stop_reason or ""))
    if reason:
        line += f" · {reason}"
    return line


# ---- a long message in the transcript -------------------------------------------------------------
PREVIEW_LINES = 4          # a /load shows its first lines, live and after --resume
PREVIEW_CHARS = 600
LONG_LINES, LONG_CHARS = 12, 4000    # a resumed message past either is one a /load sent, or like it


def message_preview(text: str, head: str) -> str:
    """'HEAD (12,345 characters)', the first lines, and how many more: a long message as the
    transcript shows it (the model and the log have all of it)."""
    lines = text.splitlines()
    shown = "\n".join(lines[:PREVIEW_LINES])
    if len(shown) > PREVIEW_CHARS:
        shown = shown[:PREVIEW_CHARS] + "…"
    more = f"\n… ({len(lines) - PREVIEW_LINES:,} more lines)" if len(lines) > PREVIEW_LINES else ""
    return f"{head} ({len(text):,} characters)\n{shown}{more}"


def collapsed(text: str) -> str:
    """A resumed message as its /load showed it live: a long one collapsed to its preview."""
    if text.count("\n") < LONG_LINES and len(text) <= LONG_CHARS:
        return text
    return message_preview(text, "a long message, collapsed")


def earlier_line(hidden: int, page: int) -> str:
    """The line above a resumed transcript's newest messages, standing for the older ones."""
    return (f"▸ {plural(hidden, 'earlier message')} not drawn yet (the conversation keeps them): "
            f"click or press Enter to show {'them' if page >= hidden else f'{page:,} more'}")


def reading_line(name: str, done: int, total: int) -> str:
    """Progress while a saved conversation is read back: `done` of `total` bytes."""
    return f"reading {name}: {done / 2**20:,.0f} of {total / 2**20:,.0f} MiB ({100 * done // max(total, 1)}%)"


# ---- the prefill progress line -------------------------------------------------------------------


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "ETA …"
    if seconds < 60:
        return f"ETA {seconds:.0f} s"
    return f"ETA {int(seconds // 60)} min {int(seconds % 60):02d} s"


def prefill_line(ev: PrefillProgress, width: int = BAR, eta_s: float | None = None) -> str:
    """'prefilling ████████░░░░ 1,024 / 8,073 tokens · 41 tok/s · ETA 2 min 52 s · esc stops'.
    `eta_s`: from the recent chunks (chat/prefill_eta.py); else the event's, at the rate so far."""
    share = ev.done / ev.total if ev.total else 1.0
    full = round(share * width)
    bar = "█" * full + "░" * (width - full)
    rate = f"{ev.tokens_per_s:,.0f} tok/s" if ev.done else "… tok/s"
    return (f"prefilling {bar} {ev.done:,} / {ev.total:,} tokens · {rate} · {eta_text(eta_s if eta_s is not None else ev.eta_s)} · "
            "esc stops")


# ---- sizing as sentences (`kvchat info --tokens`, /whatif) ----------------------------------------

def what_if_line(w: WhatIf, no_budget: str = NO_BUDGET) -> str:
    """One sentence: what `w.users` conversations of `w.tokens` tokens cost, and if they fit
    (without a budget, `no_budget` says how to give one)."""
    who = f"{w.users:,} conversations of {w.tokens:,} tokens" if w.users > 1 else f"{w.tokens:,} tokens"
    scales = f" + {w.scale_bytes_per_token:,} B of scales" if w.scale_bytes_per_token else ""
    line = (f"What if: {who} x {w.bytes_per_token:,} B{scales} per token = {w.bytes_needed / 1e9:,.2f} GB "
            f"({human_bytes(w.bytes_needed)}) in {w.kv_dtype}")
    if w.budget is None:
        return f"{line}; {no_budget}"
    fit = (f"{w.users_that_fit:,} such conversation{'s fit' if w.users_that_fit != 1 else ' fits'} at a time"
           if w.users_that_fit else "not even one such conversation fits")
    return line + f": {w.share:.0%} of the {w.budget / 1e9:,.2f} GB budget; {fit}"


def short_alias(model: str) -> str:
    """'70b' -> 'llama-3.1-70b', '7b' -> 'llama-2-7b': the one known alias ending in -MODEL
    (the text itself when it is an alias, a path, or ambiguous)."""
    from kvchat.engine.sources import KNOWN
    m = model.strip().lower()
    ends = [a for a in KNOWN if a.endswith("-" + m)]
    return ends[0] if m not in KNOWN and len(ends) == 1 else model


def what_if_command(model: str, tokens: int, budget: str | None = None, kv_dtype: str = "bf16",
                    users: int = 1) -> str:
    """The app's `/whatif MODEL TOKENS [BUDGET]`: the model's geometry from the known table
    (or a local folder; no weights read), each model in its serving dtype (bf16 unless
    given). Raises KvchatError naming a bad value."""
    from kvchat.engine.sources import resolve
    src = resolve(short_alias(model), geometry_only=True)
    w = what_if(src.geometry, kv_dtype, tokens, users, parse_bytes(budget) if budget else None)
    line = f"{src.name}: " + what_if_line(w, f"add a budget to compare, e.g. /whatif {model} {tokens} 15GB")
    return line if users == 1 else line + ". " + crowd_reads_line(src.geometry, kv_dtype, tokens, users)


def crowd_reads_line(geom, kv_dtype: str, tokens: int, users: int) -> str:
    """What one decode step of `users` such conversations reads: the weights once (in the
    KV dtype's serving dtype), every cache in full."""
    from kvchat.engine.sizing import step_reads
    dtype = kv_dtype if kv_dtype in ("bf16", "fp16", "fp32") else "bf16"
    r = step_reads(geom, dtype, kv_dtype, tokens * users)
    caches, weights = r.cache_bytes, r.weight_bytes
    verdict = "the caches read more than the weights" if caches > weights else "the weights still read more"
    return (f"One decode step of all {users:,}: {users:,} x {tokens:,} x {human_bytes(r.cache_bytes_per_token)} = "
            f"{human_bytes(caches)} of caches against {weights / 1e9:,.2f} GB of {dtype} weights read once: "
            f"{verdict} (they cross at {r.crossover_tokens:,} tokens in a step).")


def crossover_line(weight_bytes: int | None, cache_bytes: int | None, crossover_tokens: int | None) -> str:
    """The crowd panel's sentence on one step's reads: the weights once for every sequence,
    each sequence's own cache; named when the caches pass the weights."""
    if weight_bytes is None or cache_bytes is None:
        return "step reads: n/a (the backend does not report its steps)"
    split = f"weights {human_bytes(weight_bytes)} once + caches {human_bytes(cache_bytes)}"
    if cache_bytes > weight_bytes:
        return f"{split}: the caches now read more than the weights"
    where = f" at {crossover_tokens:,} tokens in a step" if crossover_tokens else ""
    return f"{split} ({100 * cache_bytes / weight_bytes:.0f}%); the caches pass the weights{where}"
