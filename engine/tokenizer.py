"""A model's tokenizer from its tokenizer.json, without transformers.

Importing transformers and building an AutoTokenizer was most of an engine's start (5.4 s on
two cores; 0.5 s with this module), though the work itself is the `tokenizers` library's (Rust)
and a Jinja template's. This module does the same from the same files, with what kvchat uses of it:
encode, decode, len, the special tokens and their ids, and the chat template.

What it reads, as transformers 5 reads a directory with a tokenizer.json:
- tokenizer.json: the whole pipeline (normalizer, pre-tokenizer, model, post-processor,
  decoder) and its added tokens. Its post-processor is what `add_special_tokens=True` adds;
  tokenizer_config.json's add_bos_token/add_eos_token do not change it (transformers 5 drops
  them when a tokenizer.json is there). Truncation and padding saved in it are switched off,
  as transformers does for a call without truncation or padding.
- tokenizer_config.json: the named special tokens (a string, or {"content": ...}) and
  added_tokens_decoder; special_tokens_map.json overrides the named tokens where the config
  has no added_tokens_decoder (transformers' legacy reading). Every named special token ends
  up an added special token: added when missing, marked special when it was not, so
  decode(skip_special_tokens=True) drops it and encode never splits it.
- the chat template: chat_template.jinja if present, else tokenizer_config.json's
  "chat_template" (a string, or a list of {name, template} of which "default" is used).

A template runs in Jinja's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
loop controls, the helpers chat templates expect (raise_exception, strftime_now, a tojson
that keeps non-ASCII text, dict, a namespace that refuses underscore names, and the
{% generation %} block, rendered as its body), and the variables messages, tools, documents,
add_generation_prompt and the special tokens' strings. Its text is then encoded without the
post-processor's tokens. No file here runs code: auto_map (custom tokenizer code) is refused.
"""
from __future__ import annotations

import json
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from .chat_template import check_chat_template
from .errors import KvchatError
from .files import read_bytes, read_text

if TYPE_CHECKING:
    from .sources import ModelSource

JSON_LIMIT = 64 * 2**20            # tokenizer_config.json with templates: MBs at most
TEMPLATE_LIMIT = 16 * 2**20
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA = ("additional_special_tokens", "extra_special_tokens")
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# transformers' clean_up_tokenization, which it applies to non-BPE models whose config asks for it
CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class TokenizerFileError(ValueError):
    """A tokenizer file says something this loader cannot use; str() is one line."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_bytes(path, JSON_LIMIT))
    except ValueError as err:
        raise TokenizerFileError(f"{path.name} is not JSON ({err})") from None


def _token_text(value: Any, where: str) -> str | None:
    """A special token's string: the value itself, or the "content" of an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerFileError(f"{where} is a {type(value).__name__}; expected a string or {{\"content\": ...}}")


def _added_token(entry: Any, where: str) -> AddedToken:
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
        raise TokenizerFileError(f"{where} must be an object with a string \"content\"")
    fields = {k: bool(entry[k]) for k in ADDED_TOKEN_FIELDS[1:] if k in entry}
    return AddedToken(entry["content"], **fields)


def _template(directory: Path, config: dict) -> Any:
    """The chat template: chat_template.jinja wins over tokenizer_config.json's. A value of
    another type is returned as it is, for check_chat_template to refuse by name."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return read_text(jinja_file, TEMPLATE_LIMIT)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {}
        for entry in template:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerFileError("tokenizer_config.json's chat_template list must hold "
                                         "{\"name\": ..., \"template\": ...} objects")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise TokenizerFileError(f"tokenizer_config.json has chat templates {sorted(named)} and none named "
                                     "'default'")
        return named["default"]
    return template


class _Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's tokens with
    it; here it renders its body and nothing else."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:   # Namespace's own signature: `self` may be a kwarg
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._refuse(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._refuse(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _refuse(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """dict() for templates: builds dicts, and has no attributes a template could climb."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON as json.dumps writes it: non-ASCII text kept, no HTML escaping (Jinja's own escapes)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """What a template sees: JSON types only (a str subclass loses its methods), anything
    else a "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class Tokenizer:
    """A tokenizer.json tokenizer with its special tokens and chat template."""

    def __init__(self, backend: Backend, special: dict[str, str], chat_template: Any = None,
                 cleanup: bool = False) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.special_tokens_map = dict(special)        # name -> string, the set ones only
        self.chat_template = chat_template
        self._cleanup = cleanup
        self._compiled: jinja2.Template | None = None
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.unk_token = special.get("unk_token")
        self.pad_token = special.get("pad_token")
        self.unk_token_id = backend.token_to_id(self.unk_token) if self.unk_token is not None else None
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.pad_token)
        self._pieces = Pieces(backend)

    @classmethod
    def from_dir(cls, directory: Path) -> Tokenizer:
        """The tokenizer in `directory` (which has a tokenizer.json); TokenizerFileError or the
        library's own error when a file cannot be used."""
        cfg_path, map_path = directory / "tokenizer_config.json", directory / "special_tokens_map.json"
        config = _read_json(cfg_path) if cfg_path.exists() else {}
        if not isinstance(config, dict):
            raise TokenizerFileError(f"tokenizer_config.json must be a JSON object, got {type(config).__name__}")
        if "auto_map" in config:
            raise TokenizerFileError("tokenizer_config.json has auto_map (custom tokenizer code), which kvchat "
                                     "never runs; accepted: a tokenizer.json tokenizer")
        named = {k: config.get(k) for k in NAMED}
        extra = [config.get(k) for k in EXTRA]
        if "added_tokens_decoder" not in config and map_path.exists():
            overrides = _read_json(map_path)
            if not isinstance(overrides, dict):
                raise TokenizerFileError("special_tokens_map.json must be a JSON object")
            named.update({k: v for k, v in overrides.items() if k in NAMED})
            extra += [overrides.get(k) for k in EXTRA]
        special = {}
        for name, value in named.items():
            text = _token_text(value, f"tokenizer_config.json's {name}")
            if text is not None:
                special[name] = text
        extra_texts = []
        for group in extra:
            if isinstance(group, dict):
                group = list(group.values())
            for value in group or ():
                text = _token_text(value, "tokenizer_config.json's extra special tokens")
                if text is not None:
                    extra_texts.append(text)

        backend = Backend.from_file(str(directory / "tokenizer.json"))
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise TokenizerFileError("tokenizer_config.json's added_tokens_decoder must be an object")
        have = backend.get_added_tokens_decoder()
        declared = []
        if not all(str(index).isdigit() for index in decoder):
            raise TokenizerFileError("tokenizer_config.json's added_tokens_decoder keys must be token ids")
        for index, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            token = _added_token(entry, f"tokenizer_config.json's added_tokens_decoder[{index!r}]")
            known = have.get(int(index))
            if known is None or _fields(known) != _fields(token):
                declared.append(token)
        if declared:
            backend.add_tokens(declared)
        names = list(dict.fromkeys([*special.values(), *extra_texts]))
        if names:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])

        cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        cleanup = cleanup and type(backend.model).__name__ != "BPE"   # BPE text keeps its spaces, as in transformers
        return cls(backend, special, _template(directory, config), cleanup=cleanup)

    # ---- ids and text ----------------------------------------------------------------------------
    def __len__(self) -> int:
        """The whole vocabulary with the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._backend.token_to_id(token)
        return tid if tid is not None else self.unk_token_id

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        """The token's id; the unknown token's id (None without one) for a token not in the vocabulary."""
        return self._id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens and self._pieces.usable(text):
            return self._pieces.encode(text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._cleanup:
            for old, new in CLEANUP:
                text = text.replace(old, new)
        return text

    # ---- the chat template -----------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        """`messages` through the chat template: the token ids (no post-processor tokens), or
        the text with tokenize=False. Raises whatever the template raises."""
        if not isinstance(self.chat_template, str):
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("no messages to render")
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template)
        chat = []
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"a chat message must be a dict, got {type(m).__name__}")
            chat.append(_plain({k: v for k, v in m.items() if v is not None}))
        text = self._compiled.render(messages=chat, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class Pieces:
    """A rendered conversation's ids, a piece at a time: the text is cut before each special
    token (the chat template's turn markers), each piece encoded once and remembered. A new
    turn then encodes only its new pieces, not the whole history again (8k tokens took 16 ms on
    a 2-core EPYC and about 20 ms on the H200's host, where a turn after 8k then waits 11-18 ms
    for its first token: time the user waits before the engine's TTFT clock starts).

    The tokenizer splits its input at added tokens before anything else, so a piece encodes as
    in the whole text: each piece starts with its special token, which is what the text after it
    follows in the whole (a "first split" rule, like Metaspace's, sees the same). Only tokens
    that take no whitespace around them are cut at, and the cut is checked at load on probe
    texts: a tokenizer whose pieces disagree with its whole encoding is never cut."""

    MIN_CHARS = 2048            # shorter texts: one call costs less than the cutting
    MAX_IDS = 1 << 20           # ids remembered in all (about 40 MB at most), the oldest pieces forgotten first

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._memo: dict[str, list[int]] = {}
        self._held = 0
        self._lock = threading.Lock()   # the crowd's users render on threads of their own
        tokens = [t.content for t in backend.get_added_tokens_decoder().values()
                  if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized) and t.content]
        self._cut = re.compile("(?=" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")"
                               ) if tokens else None
        self.on = self._cut is not None and all(self._whole(t) == self.encode(t) for t in self._probes(tokens))

    @staticmethod
    def _probes(tokens: list[str]) -> list[str]:
        words = ["Hello, world.", " leading space", "\n\nnew lines\n", "été 東京 🙂", "end."]
        a, b = tokens[0], tokens[-1]
        return [f"{a}user\n{words[0]}{b}\n{a}assistant\n{words[1]}{b}", f"{words[2]}{a}{words[3]}{b}{words[4]}",
                f"{a}{a}{b} {words[1]}{b}{b}\n"]

    def usable(self, text: str) -> bool:
        return self.on and len(text) >= self.MIN_CHARS

    def _whole(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        assert self._cut is not None
        for piece in self._cut.split(text):
            if not piece:
                continue
            with self._lock:
                got = self._memo.pop(piece, None)   # popped and put back: the newest last
                if got is not None:
                    self._memo[piece] = got
            if got is None:
                got = self._whole(piece)
                with self._lock:
                    if piece not in self._memo and len(got) <= self.MAX_IDS:
                        while self._memo and self._held + len(got) > self.MAX_IDS:
                            self._held -= len(self._memo.pop(next(iter(self._memo))))
                        self._memo[piece] = got
                        self._held += len(got)
            ids += got
        return ids


def _fields(token: AddedToken) -> tuple:
    return tuple(getattr(token, f) for f in ADDED_TOKEN_FIELDS)


def load_tokenizer(src: ModelSource):
    """The model's tokenizer, never its own code, and no larger than the embedding table: a
    token id past the config's vocab_size would index out of it. A directory with a
    tokenizer.json gets kvchat's own Tokenizer (the `tokenizers` library and a sandboxed Jinja
    template, no transformers import: that import was most of an engine's start); one with only
    tokenizer.model or vocab.json and merges.txt, transformers' AutoTokenizer (trust_remote_code=False)."""
    path = src.tokenizer_path
    try:
        if (path / "tokenizer.json").exists():
            tok = Tokenizer.from_dir(path)
        else:
            tok = _auto_tokenizer(path)
    except Exception as err:  # tokenizers raises Exception; transformers OSError, ValueError, and more
        detail = " ".join(str(err).split())[:300]
        raise KvchatError(f"{path}: cannot load the tokenizer ({type(err).__name__}: {detail})") from None
    check_chat_template(tok, path)
    if len(tok) > src.geometry.vocab_size:
        raise KvchatError(f"{path}: the tokenizer has {len(tok):,} tokens but config.json's "
                          f"vocab_size is {src.geometry.vocab_size:,}; accepted: a tokenizer no larger than the "
                          "model's vocabulary")
    return tok


def _auto_tokenizer(path):
    """transformers' tokenizer for a directory without tokenizer.json (a SentencePiece
    tokenizer.model, or vocab.json and merges.txt), never running the directory's code."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
