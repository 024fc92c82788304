"""The tokenizer and chat template of the tiny DiffusionGemma fixture.

A byte-level BPE (300 ordinary tokens, trained on the corpus of tools/make_fixture.py like
the other fixtures) laid out around Gemma 4's special-token ids, which keep their real
values: 0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>, 4 <mask>, 50 <|tool_response>, 98 <|think|>,
100 <|channel>, 101 <channel|>, 105 <|turn>, 106 <turn|>.  The ordinary tokens take the
other ids from 0 up in trained order; the rows after them have no token.

The real Gemma 4 tokenizer is a SentencePiece-style BPE ("▁" for spaces, byte fallback);
the runtime reads any tokenizer.json through the `tokenizers` crate, so the fixture keeps the
byte-level form of the other fixtures.  The chat template is the text-only part of Gemma 4's
(system turn, thinking switch, user/model turns with model turns' thinking stripped, the
closed thought channel after the generation prompt); tools and media are left out.

Used by tools/make_dgemma_fixture.py only (needs `tokenizers` and jinja2).
"""

from __future__ import annotations

import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_common  # noqa: E402
import make_fixture  # noqa: E402
from fixture_common import encode  # noqa: E402

N_ORDINARY = 300
SPECIAL = {
    "<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|tool_response>": 50,
    "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
}
PAD_ID, EOS_ID, BOS_ID, TOOL_RESPONSE_ID, TURN_END_ID = 0, 1, 2, 50, 106
EOS_IDS = [EOS_ID, TURN_END_ID, TOOL_RESPONSE_ID]  # generation_config.json of the -it model
LAST_TOKEN_ID = N_ORDINARY + len(SPECIAL) - 1  # 310; rows 311.. have no token

CHAT_TEMPLATE = (
    "{%- macro strip_thinking(text) -%}"
    "{%- set ns = namespace(result='') -%}"
    "{%- for part in text.split('<channel|>') -%}"
    "{%- if '<|channel>' in part -%}{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}"
    "{%- else -%}{%- set ns.result = ns.result + part -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ns.result | trim -}}"
    "{%- endmacro -%}"
    "{%- set loop_messages = messages -%}"
    "{{- bos_token -}}"
    "{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|turn>system\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- messages[0]['content'] | trim -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}"
    "{%- if role == 'model' -%}{{- strip_thinking(message['content']) -}}"
    "{%- else -%}{{- message['content'] | trim -}}{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|turn>model\\n' -}}"
    "{%- if not (enable_thinking is defined and enable_thinking) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def ordinary_ids():
    """The ids of the ordinary tokens, in trained order: every id not taken by a special."""
    taken = set(SPECIAL.values())
    return [i for i in range(LAST_TOKEN_ID + 1) if i not in taken]


def build_tokenizer():
    """Train the byte-level BPE, move its tokens to the ids around the specials, add them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fixture_common.train_bpe(tok, make_fixture.CORPUS.splitlines(), N_ORDINARY)
    data = json.loads(tok.to_str())
    slots = ordinary_ids()
    vocab = {t: slots[i] for t, i in data["model"]["vocab"].items()}
    vocab.update(SPECIAL)  # in the model's vocabulary too, or `tokenizers` renumbers them
    data["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    data["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t, i in sorted(SPECIAL.items(), key=lambda kv: kv[1])
    ]
    tok = Tokenizer.from_str(json.dumps(data))
    for t, i in SPECIAL.items():
        if tok.token_to_id(t) != i or encode(tok, t) != [i]:
            raise RuntimeError(f"{t} is not the single token {i}")
    return tok


def save_tokenizer(tok, out):
    path = os.path.join(out, "tokenizer.json")
    fixture_common.save_tokenizer(tok, path, make_fixture.CORPUS + "<bos><|turn>user\nx<turn|>")


def _added(t):
    return {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


def tokenizer_config():
    return {
        "added_tokens_decoder": {str(i): _added(t) for t, i in sorted(SPECIAL.items(), key=lambda kv: kv[1])},
        "bos_token": "<bos>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "eot_token": "<turn|>",
        "mask_token": "<mask>",
        "model_max_length": 1024,
        "pad_token": "<pad>",
        "padding_side": "left",
        "soc_token": "<|channel>",
        "eoc_token": "<channel|>",
        "sot_token": "<|turn>",
        "str_token": "<|tool_response>",
        "think_token": "<|think|>",
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
    }


def special_tokens_map():
    return {k: {"content": v, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
            for k, v in (("bos_token", "<bos>"), ("eos_token", "<eos>"), ("mask_token", "<mask>"),
                         ("pad_token", "<pad>"), ("unk_token", "<unk>"))}


def render_chat(messages, add_generation_prompt=True, enable_thinking=False):
    """CHAT_TEMPLATE as plain Python (the maker checks that jinja2 agrees)."""
    def strip_thinking(text):
        parts = [p.split("<|channel>")[0] if "<|channel>" in p else p for p in text.split("<channel|>")]
        return "".join(parts).strip()

    out, loop = ["<bos>"], messages
    if enable_thinking or messages[0]["role"] in ("system", "developer"):
        out.append("<|turn>system\n" + ("<|think|>\n" if enable_thinking else ""))
        if messages[0]["role"] in ("system", "developer"):
            out.append(messages[0]["content"].strip())
            loop = messages[1:]
        out.append("<turn|>\n")
    for m in loop:
        role = "model" if m["role"] == "assistant" else m["role"]
        body = strip_thinking(m["content"]) if role == "model" else m["content"].strip()
        out.append("<|turn>" + role + "\n" + body + "<turn|>\n")
    if add_generation_prompt:
        out.append("<|turn>model\n" + ("" if enable_thinking else "<|channel>thought\n<channel|>"))
    return "".join(out)


def render_jinja(messages, add_generation_prompt=True, enable_thinking=False):
    """CHAT_TEMPLATE rendered as transformers does (sandboxed jinja2)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    kw = {"enable_thinking": True} if enable_thinking else {}
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<bos>", **kw)


CHAT_CONVERSATIONS = [
    ("user_only", [{"role": "user", "content": "What is 2 + 3?"}], False),
    ("system_and_user", [{"role": "system", "content": "  Answer briefly. "},
                         {"role": "user", "content": "Name three fruits.\n"}], False),
    ("multi_turn_thinking_stripped", [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "<|channel>thought\nbe kind<channel|>Good, thank you."},
        {"role": "user", "content": "What do bees make?"}], False),
    ("thinking_enabled", [{"role": "user", "content": "What is 7 times 8?"}], True),
]


def chat_cases(tok):
    out = []
    for name, msgs, thinking in CHAT_CONVERSATIONS:
        text = render_chat(msgs, enable_thinking=thinking)
        if render_jinja(msgs, enable_thinking=thinking) != text:
            raise RuntimeError(f"chat case {name}: jinja2 and the plain rendering differ")
        out.append({"name": name, "messages": msgs, "enable_thinking": thinking, "rendered": text,
                     "ids": encode(tok, text)})
    return {
        "description": (
            "The fixture's chat template (the text-only part of Gemma 4's) rendered by jinja2 with "
            "add_generation_prompt=True (enable_thinking as given) and encoded with the fixture "
            "tokenizer, add_special_tokens=False."
        ),
        "cases": out,
    }
