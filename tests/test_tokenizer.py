"""engine/tokenizer.py against transformers' AutoTokenizer on the same files: the bundled
model's converted directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) and
a Llama-3-style directory built here (a tokenizer.json whose post-processor adds a BOS, added
tokens declared only in tokenizer_config.json, a Llama-3.1-like template given as a string).
Every comparison is exact: same ids, same text. Inputs are seeded random strings of ASCII,
accents, CJK, emoji (incl. ZWJ sequences), whitespace runs, newlines and the special tokens'
own strings, so a failure names its seed and is reproducible."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from kvchat.engine import chat_template
from kvchat.engine.tokenizer import load_tokenizer
from kvchat.engine.errors import KvchatError, ModelLoadError
from kvchat.engine.geometry import KNOWN
from kvchat.engine.sources import ModelSource, bundled_dir
from kvchat.engine.template import END_OF_TURN
from kvchat.engine.tokenizer import Tokenizer

SEEDS = (1, 2, 3)
PIECES = ("the", " quick", "Hello", ",", ".", "?!", "'s", " n't", "42", "3.14", "x_y", "é", "café", "naïve", "Ångström",
          "ñ", "ü", "你好", "世界", "日本語", "한국어", "Ελλάδα", "привет", "🎉", "👍🏽", "👨‍👩‍👧", "🇫🇷", " ", "  ",
          "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start",
          "im_end|>", "<repo_name>", "<", "|>", "{{", "}}", "\\", "\"", "\u00a0", "\u200b")
SPECIAL_STRINGS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def random_text(rng: random.Random, n: int | None = None) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n if n is not None else rng.randint(0, 40)))


def random_chat(rng: random.Random) -> list[dict[str, str]]:
    turns = rng.randint(1, 6)
    chat = [{"role": "system", "content": random_text(rng)}] if rng.random() < 0.5 else []
    for i in range(turns):
        chat.append({"role": "user" if i % 2 == 0 else "assistant", "content": random_text(rng)})
    return chat


def hf_ids(tok, messages, add_generation_prompt) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def pair():
    """Ours and transformers', on the bundled model's converted directory."""
    from transformers import AutoTokenizer
    d = bundled_dir()
    return Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)


# ---- the bundled tokenizer ------------------------------------------------------------------------
def test_sizes_special_tokens_and_end_of_turn_ids_match(pair):
    ours, ref = pair
    assert len(ours) == len(ref) == 49152
    assert (ours.eos_token_id, ours.unk_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.unk_token_id,
                                                                         ref.bos_token_id)
    assert (ours.eos_token, ours.bos_token) == (ref.eos_token, ref.bos_token) == ("<|im_end|>", "<|im_start|>")
    for name in (*END_OF_TURN, *SPECIAL_STRINGS, "hello", "Ġthe", "no-such-token-anywhere"):
        assert ours.convert_tokens_to_ids(name) == ref.convert_tokens_to_ids(name), name
    assert ours.chat_template == ref.chat_template


@pytest.mark.parametrize("seed", SEEDS)
def test_encode_matches_with_and_without_special_tokens(pair, seed):
    ours, ref = pair
    rng = random.Random(seed)
    for _ in range(300):
        text = random_text(rng)
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special), \
                (seed, text, special)


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_matches_both_ways_including_ids_cut_mid_character(pair, seed):
    ours, ref = pair
    rng = random.Random(seed)
    for _ in range(60):
        ids = ours.encode(random_text(rng, 30), add_special_tokens=False)
        cuts = {0, len(ids)} | {rng.randint(0, len(ids)) for _ in range(6)}
        for a in cuts:                      # every prefix and some slices: many cut a character's bytes
            for b in sorted(cuts | set(range(len(ids) + 1)) if a == 0 else cuts):
                if a > b:
                    continue
                for skip in (True, False):
                    assert ours.decode(ids[a:b], skip_special_tokens=skip) == \
                        ref.decode(ids[a:b], skip_special_tokens=skip), (seed, ids[a:b], skip)
    # ids drawn from the whole vocabulary, special tokens among them
    for _ in range(200):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randint(1, 12))] + [rng.randrange(17)]
        rng.shuffle(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (seed, ids)


def test_a_cut_character_decodes_to_the_replacement_character_and_the_whole_to_the_text(pair):
    ours, _ = pair
    ids = ours.encode("👨‍👩‍👧", add_special_tokens=False)
    assert len(ids) > 1 and ours.decode(ids[:1]).endswith("\ufffd") and ours.decode(ids) == "👨‍👩‍👧"


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_template_ids_and_text_match(pair, seed):
    ours, ref = pair
    rng = random.Random(seed)
    for _ in range(80):
        chat = random_chat(rng)
        for gen in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == \
                hf_ids(ref, chat, gen), (seed, chat, gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False), (seed, chat, gen)


def test_render_and_the_engine_helpers_agree_with_transformers(pair):
    """chat_template.render and template.turn_overhead/stop_ids take either tokenizer alike."""
    from kvchat.engine.template import stop_ids, turn_overhead
    ours, ref = pair
    chat = [{"role": "user", "content": "Bonjour, ça va ? 🙂"}]
    assert chat_template.render(ours, chat) == chat_template.render(ref, chat)
    assert turn_overhead(ours) == turn_overhead(ref) == 11
    assert stop_ids(ours, (2,)) == stop_ids(ref, (2,)) == frozenset({2})


# ---- a Llama-3-style directory --------------------------------------------------------------------
LLAMA_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Conversation roles must be user or assistant, got " + message['role']) }}
    {%- endif %}
    {%- if loop.index0 >= 40 %}{% break %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message.name is defined %}{{ {'name': message.name} | tojson }}{% endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA_ADDED = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def llama_dir(tmp_path: Path, add_bos_token: bool | None) -> Path:
    """The bundled tokenizer.json with four Llama-3 special tokens added and a post-processor
    that puts <|begin_of_text|> first; tokenizer_config.json declares those and one more
    (<|reserved_special_token_0|>, in no tokenizer.json), the special tokens as strings and
    as AddedToken dicts, and the template as a string."""
    src, d = bundled_dir(), tmp_path / "llama3"
    d.mkdir()
    tj = json.loads((src / "tokenizer.json").read_text())
    base = len(tj["model"]["vocab"])
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    tj["added_tokens"] += [{"id": base + i, "content": t, **entry} for i, t in enumerate(LLAMA_ADDED)]
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [base], "tokens": ["<|begin_of_text|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    names = LLAMA_ADDED + ("<|reserved_special_token_0|>",)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": {"content": "<|eot_id|>", "lstrip": False, "rstrip": False, "normalized": False,
                         "single_word": False, "__type": "AddedToken"},
           "clean_up_tokenization_spaces": True, "model_max_length": 131072, "chat_template": LLAMA_TEMPLATE,
           "added_tokens_decoder": {str(base + i): {"content": t, **entry} for i, t in enumerate(names)}}
    if add_bos_token is not None:
        cfg["add_bos_token"] = add_bos_token
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "config.json", d / "config.json")
    return d


@pytest.mark.parametrize("add_bos_token", [None, True, False], ids=["no-add_bos_token", "add_bos_token", "no-bos"])
def test_a_llama3_style_directory_matches_transformers(tmp_path, add_bos_token):
    from transformers import AutoTokenizer
    d = llama_dir(tmp_path, add_bos_token)
    ours, ref = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    assert len(ours) == len(ref) == 49152 + 5
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                         ref.unk_token_id) == (49152, 49155, None)
    assert (ours.bos_token, ours.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    for name in (*END_OF_TURN, "<|reserved_special_token_0|>", "no-such-token"):
        assert ours.convert_tokens_to_ids(name) == ref.convert_tokens_to_ids(name), name
    rng = random.Random(7)
    for _ in range(100):
        text = random_text(rng) + rng.choice(LLAMA_ADDED + ("<|reserved_special_token_0|>", ""))
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.encode("hi")[0] == 49152            # the post-processor's BOS, whatever add_bos_token says
    for _ in range(40):
        chat = random_chat(rng)
        if rng.random() < 0.3:
            chat[-1]["name"] = "Zoë 😀"                 # tojson keeps non-ASCII text
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False), chat
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == hf_ids(ref, chat, gen), chat
    text = ours.apply_chat_template([{"role": "user", "content": "hi", "name": "Zoë"}], tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and '{"name": "Zoë"}' in text
    assert "Today Date: " in text


def test_a_bad_role_raises_the_templates_own_message_in_one_line(tmp_path):
    d = llama_dir(tmp_path, None)
    ours = Tokenizer.from_dir(d)
    with pytest.raises(chat_template.TemplateFailed) as info:
        chat_template.render(ours, [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])
    msg = str(info.value)
    assert "\n" not in msg and "Conversation roles must be user or assistant, got tool" in msg


# ---- load_tokenizer: its errors -------------------------------------------------------------------
def bundled_with(tmp_path: Path, template: str | None = None, config: dict | None = None) -> ModelSource:
    """The bundled tokenizer.json beside a tokenizer_config.json of our own."""
    src, d = bundled_dir(), tmp_path / "tok"
    d.mkdir(parents=True)
    (d / "tokenizer.json").symlink_to(src / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(config or {})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ModelSource("t", KNOWN["smollm2-135m"], None, d)


def one_line_load_error(src: ModelSource, *fragments: str) -> str:
    with pytest.raises(KvchatError) as info:
        load_tokenizer(src)
    msg = str(info.value)
    assert "\n" not in msg and str(src.tokenizer_path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_a_template_that_always_raises_is_refused_when_it_loads(tmp_path):
    src = bundled_with(tmp_path, "{{ raise_exception('this model takes no chats') }}")
    with pytest.raises(ModelLoadError):
        load_tokenizer(src)
    one_line_load_error(src, "chat template", "this model takes no chats")


@pytest.mark.parametrize("template", ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                      "{{ cycler.__init__.__globals__['os'] }}",
                                      "{% set ns = namespace(__class__=1) %}{{ ns }}"],
                         ids=["mro", "globals", "namespace-dunder"])
def test_a_sandbox_escape_is_refused(tmp_path, template):
    one_line_load_error(bundled_with(tmp_path, template), "chat template", "SecurityError")


def test_the_sandbox_gives_a_template_nothing_of_python(tmp_path):
    tok = load_tokenizer(bundled_with(tmp_path, "{{ messages.__class__ }}|{{ dict.__class__ }}|{{ ''.__class__ }}"
                                                "|{{ strftime_now.__globals__ }}|{% for m in messages %}x{% endfor %}"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "||||x"


def test_a_template_list_takes_its_default_and_one_without_a_default_is_one_line(tmp_path):
    listed = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    tok = load_tokenizer(bundled_with(tmp_path / "a", config={"chat_template": listed}))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
    one_line_load_error(bundled_with(tmp_path / "b", config={"chat_template": listed[:1]}), "none named 'default'")


def test_chat_template_jinja_wins_over_the_configs(tmp_path):
    src = bundled_with(tmp_path, "config's")
    (src.tokenizer_path / "chat_template.jinja").write_text("file's {{ bos_token }}")
    tok = load_tokenizer(src)
    assert tok.chat_template == "file's {{ bos_token }}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "file's <|im_start|>"


@pytest.mark.parametrize("config, fragments", [
    ({"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}, ("auto_map",)),
    ({"eos_token": ["<|im_end|>"]}, ("eos_token is a list",)),
    ({"added_tokens_decoder": {"x": {"content": "a"}}}, ("added_tokens_decoder",)),
], ids=["auto-map", "eos-a-list", "added-tokens-bad-id"])
def test_unusable_tokenizer_configs_are_one_line(tmp_path, config, fragments):
    one_line_load_error(bundled_with(tmp_path, config=config), "cannot load the tokenizer", *fragments)


def test_a_broken_tokenizer_json_is_one_line(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    one_line_load_error(ModelSource("t", KNOWN["smollm2-135m"], None, d), "cannot load the tokenizer")


def test_special_tokens_map_json_names_the_tokens_where_the_config_has_no_added_tokens_decoder(tmp_path):
    from transformers import AutoTokenizer
    src = bundled_with(tmp_path, config={"eos_token": "<|endoftext|>"})
    d = src.tokenizer_path
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"},
                                                           "pad_token": "<pad>"}))
    shutil.copy(bundled_dir() / "config.json", d / "config.json")
    ours, ref = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    assert (ours.eos_token, ours.eos_token_id) == (ref.eos_token, ref.eos_token_id) == ("<|im_end|>", 2)
    assert len(ours) == len(ref) == 49153                # "<pad>" joins as an added special token
    ids = ours.encode("a<pad>b")
    assert ids == ref.encode("a<pad>b") and ours.decode(ids, skip_special_tokens=True) == "ab"


def test_without_tokenizer_json_the_transformers_tokenizer_still_loads(tmp_path):
    """A vocab.json + merges.txt directory: the AutoTokenizer path, as before."""
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(bundled_dir()))
    d = tmp_path / "slow"
    d.mkdir()
    model = json.loads((bundled_dir() / "tokenizer.json").read_text())["model"]
    (d / "vocab.json").write_text(json.dumps(model["vocab"]))
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(m if isinstance(m, str) else " ".join(m)
                                                                 for m in model["merges"]) + "\n")
    cfg = json.loads((bundled_dir() / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(bundled_dir() / "chat_template.jinja", d / "chat_template.jinja")
    tok = load_tokenizer(ModelSource("t", KNOWN["smollm2-135m"], None, d))
    assert not isinstance(tok, Tokenizer)
    assert tok.encode("Hello world, café", add_special_tokens=False) == ref.encode("Hello world, café",
                                                                                  add_special_tokens=False)
    chat = [{"role": "user", "content": "hi"}]
    assert chat_template.render(tok, chat)[:3] == chat_template.render(ref, chat)[:3]
