"""The Python heap, settled once the model is loaded, so that the collector stops pausing the chat.

Loading the model leaves about a million objects that live as long as the process (torch's,
transformers' and Textual's modules, the tokenizer's tables, the engine). CPython's collector
walks all of them in each full (generation 2) collection, and the chat's rendering makes
cyclic garbage (Textual's discarded lines) fast enough to start one every second or less. In
a real terminal on 2 Zen 4 cores (bf16, 512-token replies) each took 140-180 ms of the UI
thread, and a decode step that met one took as long: 4 of 5 first replies had a step of
150-180 ms (10-11 ms otherwise). Frozen (gc.freeze: moved to a generation the collector never
walks), those objects cost nothing: the full collections then took 17-42 ms; with the panel
column's redraw loop also gone (widgets/panel_switcher.py) there were 2-5 in a reply, at most
22 ms. What the chat makes after the freeze is collected as before.
"""
from __future__ import annotations

import gc


def settle() -> int:
    """Collect what is garbage now, then freeze every object left; returns how many were frozen.
    Called once, when the model has loaded (the App does it outside tests: a test's app leaves
    its process's collector alone)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
