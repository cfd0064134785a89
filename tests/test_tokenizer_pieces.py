"""A rendered conversation encoded a piece at a time (engine/tokenizer.py's Pieces) gives the
ids of the whole text, on the bundled tokenizer and on variants built to break the cutting:
whitespace-eating special tokens and a Metaspace pre-tokenizer that marks only the first split.
A variant the cut would get wrong must be found at load and never cut."""
from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path

import pytest

from kvchat.engine.sources import bundled_dir
from kvchat.engine.tokenizer import Pieces, Tokenizer

from test_tokenizer import PIECES, SPECIAL_STRINGS

SEEDS = range(12)


def long_text(rng: random.Random) -> str:
    """Past Pieces.MIN_CHARS: turns of random text between the template's markers, and markers
    inside the text too (a user may paste them)."""
    parts = []
    for i in range(rng.randint(3, 12)):
        parts += [rng.choice(SPECIAL_STRINGS), rng.choice(("user", "assistant", "system")), "\n"]
        parts += [rng.choice(PIECES) for _ in range(rng.randint(50, 400))]
        parts += ["<|im_end|>", rng.choice(("\n", "", " ", "\n\n"))]
    text = "".join(parts)
    return text if len(text) >= Pieces.MIN_CHARS else text + "x" * Pieces.MIN_CHARS


def whole(tok: Tokenizer, text: str) -> list[int]:
    return tok._backend.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def bundled():
    return Tokenizer.from_dir(bundled_dir())


@pytest.mark.parametrize("seed", SEEDS)
def test_pieces_give_the_whole_texts_ids_and_remember_them(bundled, seed):
    assert bundled._pieces.on
    rng = random.Random(seed)
    text = long_text(rng)
    assert bundled.encode(text, add_special_tokens=False) == whole(bundled, text)
    # again, as the next turn renders it: the history's pieces come from memory, the new one is encoded
    more = text + "<|im_start|>user\n" + "".join(rng.choice(PIECES) for _ in range(50)) + "<|im_end|>\n"
    assert bundled.encode(more, add_special_tokens=False) == whole(bundled, more)


def test_a_long_history_is_encoded_once(bundled):
    """The second render of a long conversation reads its pieces back: far faster than the first."""
    rng = random.Random(99)
    text = "<|im_start|>user\n" + "".join(rng.choice(PIECES[:12]) for _ in range(40_000)) + "<|im_end|>\n"
    t0 = time.perf_counter()
    first = bundled.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)
    t1 = time.perf_counter()
    second = bundled.encode(text + "<|im_start|>user\nmore<|im_end|>\n", add_special_tokens=False)
    t2 = time.perf_counter()
    assert first == whole(bundled, text + "<|im_start|>assistant\n")
    assert second[:len(first) - 3] == first[:-3]
    assert (t2 - t1) < (t1 - t0) / 5


def variant(tmp_path: Path, name: str, edit) -> Tokenizer:
    src, d = bundled_dir(), tmp_path / name
    d.mkdir()
    tj = json.loads((src / "tokenizer.json").read_text())
    edit(tj)
    (d / "tokenizer.json").write_text(json.dumps(tj))
    shutil.copy(src / "tokenizer_config.json", d / "tokenizer_config.json")
    return Tokenizer.from_dir(d)


def eats_space(tj: dict) -> None:
    for t in tj["added_tokens"]:
        if t["content"] == "<|im_end|>":
            t["rstrip"] = True      # the whitespace after it joins the token


@pytest.mark.parametrize("seed", SEEDS)
def test_a_whitespace_eating_token_is_not_cut_at(tmp_path, seed):
    tok = variant(tmp_path, "eats", eats_space)
    text = long_text(random.Random(seed))
    assert tok.encode(text, add_special_tokens=False) == whole(tok, text)


def test_a_pre_tokenizer_that_marks_the_first_split_alone_gets_the_whole_texts_ids():
    """Metaspace with prepend_scheme "first" marks only the text at the very start with "▁":
    text after a special token is not marked in the whole, but would be if it were encoded
    alone. Each piece starts with its special token, so it never is."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Metaspace
    words = ["user", "hello", "world", "\n"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}, **{"▁" + w: i + 10 for i, w in enumerate(words)}}
    backend = Backend(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Metaspace(replacement="▁", prepend_scheme="first", split=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    pieces = Pieces(backend)
    assert pieces.on
    rng = random.Random(5)
    text = "".join(rng.choice(["<s>", "</s>", "user", " hello", "world", " ", "\n"]) for _ in range(3000))
    ids = backend.encode(text, add_special_tokens=False).ids
    assert pieces.encode(text) == ids
    # the control: the same text cut with each special token a piece of its own differs
    naive = [i for part in re.split("(<s>|</s>)", text) if part for i in backend.encode(part, add_special_tokens=False).ids]
    assert naive != ids


@pytest.fixture(scope="module")
def transformers_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(bundled_dir()), trust_remote_code=False)


@pytest.mark.parametrize("seed", range(4))
def test_long_chats_render_to_transformers_ids_turn_after_turn(bundled, transformers_tokenizer, seed):
    """The chat template's ids for long conversations (past Pieces.MIN_CHARS, so cut into pieces
    and remembered), growing a turn at a time as a chat does, against transformers' own
    tokenizer on the same directory: an independent reference for the whole path."""
    ours, ref = bundled, transformers_tokenizer
    rng = random.Random(seed)
    chat = [{"role": "system", "content": "".join(rng.choice(PIECES) for _ in range(300))}]
    for turn in range(6):
        chat.append({"role": "user" if turn % 2 == 0 else "assistant",
                     "content": "".join(rng.choice(PIECES) for _ in range(rng.randint(20, 600)))})
        got = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert got == want, (seed, turn)
    assert len(ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)) >= Pieces.MIN_CHARS
