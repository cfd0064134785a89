"""The chat template: messages to token ids, and the ids that end a reply. Functions of the
tokenizer alone, so the bench (or anything else) renders a chat without a conversation."""
from __future__ import annotations

from . import chat_template

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def render_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """`messages` through the tokenizer's chat template with the generation prompt; a plain
    "role: content" rendering for a tokenizer without one."""
    if getattr(tokenizer, "chat_template", None):
        return chat_template.render(tokenizer, messages)   # a template that raises: one line, nothing changed
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tokenizer.encode(text))


# a probe conversation: one exchange, then the message whose cost is measured
PROBE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
         {"role": "user", "content": "How are you?"}]


def turn_overhead(tokenizer) -> int:
    """The tokens a prompt grows by for one more user message beyond the message's own and the
    reply before it: the end of that reply, the user turn's markers and the next reply's header
    (11 on SmolLM2's ChatML). Measured on PROBE as the prompt's growth from its first turn,
    less the reply's and the message's tokens, so it holds for any template that renders it."""
    first = render_chat(tokenizer, PROBE[:1])
    second = render_chat(tokenizer, PROBE)
    own = sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in PROBE[1:])
    return max(len(second) - len(first) - own, 0)


def stop_ids(tokenizer, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """Token ids that end a reply: the model's EOS ids, the tokenizer's, and the usual
    end-of-turn tokens this vocabulary has."""
    ids = set(eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for name in END_OF_TURN:
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return frozenset(ids)
