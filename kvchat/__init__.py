"""kvchat: a terminal chat that shows, live, what the KV cache of a Llama model does."""
__version__ = "0.1.0"
