"""The history `kvchat bench` measures after: deterministic numbered notes that the system
prompt asks the model to repeat (so that it keeps talking for the timed steps), cut so that
the rendered first turn is exactly the requested number of tokens."""
from __future__ import annotations

import random

from ..cli.args import UsageError

SYSTEM = "Repeat the user's notes word for word."
FOLLOW_UP = "Thank you. Now repeat only the second note."
MIN_HISTORY = 8         # tokens of notes the shortest history holds

WHO = ("The ferryman", "A lantern maker", "The old clock", "Our neighbour", "The red kite", "A night train",
       "The baker", "The north wind", "A small boat", "The librarian", "The choir", "A grey cat")
DID = ("carried", "painted", "counted", "followed", "remembered", "mended", "watched", "sorted", "found", "lost")
WHAT = ("seven blue stones", "the morning letters", "a map of the harbour", "three copper keys", "the spring seeds",
        "an unfinished song", "the lighthouse log", "twelve paper boats", "a box of buttons", "the winter apples")
WHEN = ("before dawn", "near the bridge", "after the rain", "during the fair", "on the hill", "by the canal",
        "at noon", "under the station clock")


def notes(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    return "\n".join(f"Note {i}: {rng.choice(WHO)} {rng.choice(DID)} {rng.choice(WHAT)} {rng.choice(WHEN)}."
                     for i in range(1, lines + 1))


def history(render, tokenizer, context: int, seed: int) -> tuple[str, list[int]]:
    """A user message whose rendered first turn is `context` tokens (or a token or two
    short, where BPE merges across the cut), and those ids."""
    def ids_for(body: str) -> list[int]:
        return render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}])

    floor = len(ids_for(""))
    if context < floor + MIN_HISTORY:
        raise UsageError(f"--contexts {context} is shorter than the chat template around the history "
                         f"({floor} tokens); use at least {floor + MIN_HISTORY}")
    body = tokenizer.encode(notes(seed, context // 8 + 8), add_special_tokens=False)
    lo, hi = 0, min(len(body), context)
    while lo < hi:  # the longest cut of the notes whose rendering fits
        mid = (lo + hi + 1) // 2
        if len(ids_for(tokenizer.decode(body[:mid]))) <= context:
            lo = mid
        else:
            hi = mid - 1
    text = tokenizer.decode(body[:lo])
    return text, ids_for(text)
