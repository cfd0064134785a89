"""app/heap.settle: what is garbage when the model has loaded is collected, and the rest is
frozen out of the collector's walks (gc.freeze); the test gives its process's heap back."""
from __future__ import annotations

import gc
import weakref

from kvchat.app import heap


class Node:
    pass


def test_settle_collects_the_garbage_then_freezes_every_object_left():
    a, b = Node(), Node()
    a.other, b.other = b, a            # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    kept = Node()
    try:
        frozen = heap.settle()
        assert gone() is None          # collected before the freeze, not kept for good
        assert frozen == gc.get_freeze_count() > 10_000     # this process's modules, torch's among them
        assert not any(o is kept for o in gc.get_objects())    # out of every generation's walk
        made_after = Node()
        assert any(o is made_after for o in gc.get_objects())  # what comes later is collected as before
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
