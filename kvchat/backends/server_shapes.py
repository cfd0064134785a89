"""What a vLLM server's JSON answers must look like, checked field by field before kvchat uses
them: /v1/models, /tokenize and each streamed chat-completion chunk (the OpenAI shapes vLLM
documents, plus its `prompt_token_ids` / `token_ids` from `return_token_ids`).

A field of the wrong type or out of range raises ShapeError naming the field and what is
accepted, so a hostile or broken server ends in one line, never in a TypeError deep inside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvchat.engine.errors import KvchatError

MAX_COUNT = 2**31 - 1           # token counts and ids: int32, as every server keeps them
MAX_IDS = 2**24                 # ids in one event (a 16M-token prompt is past any model)
MAX_NAME = 512                  # a served model's id
FINISH_REASONS = ("stop", "length", "abort", "tool_calls", "content_filter", "function_call", "error")


class ShapeError(KvchatError):
    """An answer of the wrong shape; str() names the field."""


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def count(value: Any, field: str, optional: bool = True) -> int | None:
    """A whole number in [0, 2^31): a token count."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        shown = repr(value) if isinstance(value, (int, float)) else _type(value)
        raise ShapeError(f"{field} is {shown}; expected a whole number from 0 to {MAX_COUNT:,}")
    return value


def ids(value: Any, field: str) -> tuple[int, ...]:
    """A list of token ids."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ShapeError(f"{field} is {_type(value)}; expected a list of token ids")
    if len(value) > MAX_IDS:
        raise ShapeError(f"{field} has {len(value):,} ids; kvchat reads at most {MAX_IDS:,}")
    for i, tid in enumerate(value):
        count(tid, f"{field}[{i}]", optional=False)
    return tuple(value)


def _obj(value: Any, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ShapeError(f"{field} is {_type(value)}; expected an object")
    return value


# ---- /v1/models and /tokenize ---------------------------------------------------------------------
def served_model(data: Any) -> tuple[str, int | None]:
    """(the first model's id, its max_model_len) from GET /v1/models."""
    listed = data.get("data") if isinstance(data, dict) else None
    if not isinstance(listed, list) or not listed or not isinstance(listed[0], dict) or "id" not in listed[0]:
        raise ShapeError("/v1/models lists no model; is --server an OpenAI-compatible vLLM server?")
    first = listed[0]
    name = first["id"]
    if not isinstance(name, str):
        raise ShapeError(f"/v1/models data[0].id is {_type(name)}; expected a model name")
    if not name.strip() or len(name) > MAX_NAME:
        raise ShapeError(f"/v1/models data[0].id has {len(name):,} characters; expected 1 to {MAX_NAME}")
    limit = first.get("max_model_len")
    if limit is not None:
        count(limit, "/v1/models data[0].max_model_len")
        if limit == 0:
            raise ShapeError("/v1/models data[0].max_model_len is 0; expected a positive number of tokens")
    return name, limit


def token_count(data: Any) -> int:
    """The count of POST /tokenize."""
    if not isinstance(data, dict) or "count" not in data:
        raise ShapeError("/tokenize answered without a token count")
    return count(data["count"], "/tokenize count", optional=False)  # type: ignore[return-value]


# ---- the chat-completion stream ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None           # None: the server does not say (no --enable-prompt-tokens-details)


@dataclass(frozen=True, slots=True)
class Piece:
    """One choice of one chunk: the text it adds, its token ids, and why it finished."""
    text: str
    token_ids: tuple[int, ...]
    finish: str | None


@dataclass(frozen=True, slots=True)
class Chunk:
    prompt_ids: tuple[int, ...]
    usage: Usage | None
    pieces: tuple[Piece, ...]


def chunk(event: dict[str, Any]) -> Chunk:
    """A streamed chat-completion chunk, every field the client reads checked."""
    where = "the stream event's"
    usage = None
    if event.get("usage") is not None:
        u = _obj(event["usage"], f"{where} usage")
        details = _obj(u.get("prompt_tokens_details"), f"{where} usage.prompt_tokens_details")
        usage = Usage(count(u.get("prompt_tokens"), f"{where} usage.prompt_tokens"),
                      count(u.get("completion_tokens"), f"{where} usage.completion_tokens"),
                      count(details.get("cached_tokens"), f"{where} usage.prompt_tokens_details.cached_tokens"))
        if usage.cached_tokens is not None and usage.prompt_tokens is not None \
                and usage.cached_tokens > usage.prompt_tokens:
            raise ShapeError(f"{where} usage says {usage.cached_tokens:,} cached tokens of a "
                             f"{usage.prompt_tokens:,}-token prompt")
    choices = event.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise ShapeError(f"{where} choices is {_type(choices)}; expected a list")
    pieces = []
    for i, choice in enumerate(choices[:1]):      # kvchat asks for one choice (n=1)
        c = _obj(choice, f"{where} choices[{i}]")
        delta = _obj(c.get("delta"), f"{where} choices[{i}].delta")
        text = delta.get("content")
        if text is not None and not isinstance(text, str):
            raise ShapeError(f"{where} choices[{i}].delta.content is {_type(text)}; expected a string")
        finish = c.get("finish_reason")
        if finish is not None and finish not in FINISH_REASONS:
            shown = repr(finish[:40]) if isinstance(finish, str) else _type(finish)
            raise ShapeError(f"{where} choices[{i}].finish_reason is {shown}; accepted: {', '.join(FINISH_REASONS)}")
        pieces.append(Piece(text or "", ids(c.get("token_ids"), f"{where} choices[{i}].token_ids"), finish))
    return Chunk(ids(event.get("prompt_token_ids"), f"{where} prompt_token_ids"), usage, tuple(pieces))

