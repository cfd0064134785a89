"""Sampling: greedy, temperature, top-k, top-p, with a seeded generator per turn."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KvchatError


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0   # 0 means greedy
    top_k: int = 0             # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise KvchatError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise KvchatError(f"top-k must be >= 0 (0 is off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvchatError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise KvchatError(f"max tokens must be positive, got {self.max_tokens}")


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """(B, vocab) logits -> each row's first maximum (NaN counts as one). On the CPU numpy's
    argmax, on this thread: torch's woke its thread pool for 49k logits, 200 us a step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device, vocab_limit: int | None = None) -> None:
        self.p = params
        self.vocab_limit = vocab_limit
        self.gen = None
        if params.temperature > 0:
            self.gen = torch.Generator(device=device)
            if params.seed is not None:
                self.gen.manual_seed(params.seed)
            else:
                self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (vocab,) fp32 -> a 0-d token tensor (still on the device)."""
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits = logits[: self.vocab_limit]
        if self.p.temperature == 0:
            return logits.argmax()
        logits = logits / self.p.temperature
        if self.p.top_k:
            kth = torch.topk(logits, min(self.p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) > self.p.top_p  # keep the token that crosses p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(logits, -1)
        return torch.multinomial(probs, 1, generator=self.gen)[0]
