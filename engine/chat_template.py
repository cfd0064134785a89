"""A model's chat template, checked when the tokenizer loads: a template that cannot render a
plain conversation (a syntax error, an undefined name, a sandbox violation, a
`raise_exception`) is refused in one line then, not mid-turn. A template that fails later,
on a conversation it does not accept (roles out of order, say), fails that turn in one line.

Templates run in a sandboxed Jinja environment (Jinja's ImmutableSandboxedEnvironment, set up
by tokenizer.py, or by transformers for a tokenizer without a tokenizer.json): they can raise,
but cannot reach Python objects or files. What no check here bounds is a template's running time.
"""
from __future__ import annotations

from .errors import KvchatError, ModelLoadError

# what a template must render; a system message is tried, and left out for templates
# (Mistral-style) that refuse one
SAMPLE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
          {"role": "user", "content": "How are you?"}]
WITH_SYSTEM = [{"role": "system", "content": "You are helpful."}] + SAMPLE


class TemplateFailed(KvchatError):
    """The chat template raised; str() is one line."""


def describe(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200] or "no message"
    return f"{type(err).__name__}: {text}"


def render(tok, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` with the generation prompt; TemplateFailed if the template raises."""
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:   # a template can raise any error its expressions do
        raise TemplateFailed(f"the model's chat template failed on this conversation ({describe(err)})") from None
    if hasattr(ids, "keys"):   # transformers 5's tokenizer returns a BatchEncoding (ours, a list)
        ids = ids["input_ids"]
    return list(ids)


def check_chat_template(tok, where: object) -> None:
    """ModelLoadError naming `where` if the tokenizer's template cannot render a plain chat
    (with a system message, or without one for templates that refuse it)."""
    template = getattr(tok, "chat_template", None)
    if not template:
        return
    if not isinstance(template, (str, dict)):
        raise ModelLoadError(f"{where}: chat_template is a {type(template).__name__}; expected Jinja text")
    failure = None
    for messages in (WITH_SYSTEM, SAMPLE):
        try:
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return
        except Exception as err:   # as in render(): any error a template's expressions raise
            failure = failure or describe(err)
    raise ModelLoadError(f"{where}: the chat template cannot render a plain conversation ({failure}); fix or "
                         "remove chat_template in tokenizer_config.json")
