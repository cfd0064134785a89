"""Counting the calls that reach a module's functions, so that a test knows which path ran
(and did not silently compare a path with itself)."""
from __future__ import annotations


def count_calls(monkeypatch, module, *names: str) -> dict[str, int]:
    """Wrap module.name for each name with a counter; returns {name: calls so far}."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls
