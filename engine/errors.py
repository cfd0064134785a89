"""Errors that reach a user: each carries one line naming the problem and what is accepted."""


class KvchatError(Exception):
    """Bad input or an unusable model; the CLI prints str(err) on one line and exits 2."""


class ModelLoadError(KvchatError):
    """The model could not be resolved or read."""


class PoolExhausted(KvchatError):
    """The KV pool has no free or evictable block left for a request."""


class CapExceeded(KvchatError):
    """A turn would take the conversation past its context cap under the `stop` policy."""


class TurnCancelled(KvchatError):
    """The user stopped a turn during its prefill, before its first token: nothing of it
    entered the conversation (the chunks already computed stay cached for prefix reuse)."""
