"""kvchat: a terminal chat that shows, live, what the KV cache of a Llama model does."""
import os

# Idle OpenMP threads sleep instead of spinning (libgomp reads this once, when torch loads
# it, so it is set here, before anything imports torch; a user's own setting wins). Spinning
# pool threads took the cores a busy neighbour and our own main thread needed: see
# engine/threads.py for the measurement.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
