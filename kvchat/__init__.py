"""kvchat: a terminal chat that shows, live, what the KV cache of a Llama model does."""
import os

# Idle OpenMP threads spin a moment, then sleep (libgomp reads these once, when torch loads
# it, so they are set here, before anything imports torch; a user's own setting of either
# wins). Threads spinning without end took the cores a busy neighbour and our own main thread
# needed; threads sleeping at once cost a wake-up at each of a decode step's ~150 parallel
# regions, a third of the step: see engine/threads.py for both measurements.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")   # about 0.1 ms, by libgomp's estimate

__version__ = "0.1.0"
