"""Tokenizer, special-token ids and chat template of the tiny Dream fixture.

Part of tools/make_dream_fixture.py, which re-exports every name defined here (so
`make_dream_fixture.render_chat` and the like still resolve for tools/check_dream_fixture.py):

* the special tokens and their ids, and the vocabulary size (rows past the last token);
* the byte-level BPE with Qwen2's pre-tokenizer (tokenizer.json);
* Dream's ChatML template, as the jinja2 string of tokenizer_config.json and as plain
  Python, and the length of the system turn every prompt starts with;
* the conversations of chat_template_cases.json.

tools/dream_fixture_goldens.py takes its ids and prompt rendering from here too, which is
why these live outside the maker script: a module imported by the script cannot import the
script back while it runs as __main__.
"""

from __future__ import annotations

import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_common  # noqa: E402
import make_fixture  # noqa: E402
from fixture_common import encode  # noqa: E402

N_ORDINARY = make_fixture.N_ORDINARY  # 300
SPECIAL_TOKENS = [
    "<|endoftext|>",  # EOS = PAD
    "<|im_start|>",
    "<|im_end|>",
    "<|beginoftext|>",  # BOS
    "<|mask|>",  # mask
    "<|fim_prefix|>",
    "<|fim_suffix|>",
]
EOS_ID, IM_START_ID, IM_END_ID, BOS_ID, MASK_ID, FIM_PREFIX_ID, FIM_SUFFIX_ID = range(N_ORDINARY, N_ORDINARY + 7)
PAD_ID = EOS_ID
VOCAB_SIZE = 320  # rows 307..319 have no token

# Qwen2's pre-tokenizer regex (digits one by one, letters with one leading non-letter)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "You are a helpful assistant."

# ---------------------------------------------------------------------------
# tokenizer and chat template
# ---------------------------------------------------------------------------


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    fixture_common.train_bpe(tok, make_fixture.CORPUS.splitlines(), N_ORDINARY)
    # the ByteLevel parts as Qwen2 writes them (trim_offsets only affects offsets)
    data = json.loads(tok.to_str())
    data["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = Tokenizer.from_str(json.dumps(data))
    fixture_common.add_special_tokens(tok, SPECIAL_TOKENS, N_ORDINARY)
    return tok


def system_turn(messages):
    """The rendered system turn every ChatML prompt starts with."""
    content = messages[0]["content"] if messages and messages[0]["role"] == "system" else DEFAULT_SYSTEM
    return "<|im_start|>system\n" + content + "<|im_end|>\n"


def render_chat(messages, add_generation_prompt=True):
    """Dream's chat template as plain Python: the default system turn when the first
    message is not a system message; contents are not stripped."""
    out = []
    if messages and messages[0]["role"] != "system":
        out.append(system_turn([]))
    for m in messages:
        out.append("<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_jinja(messages, add_generation_prompt=True):
    """The template string rendered as transformers does (sandboxed jinja2)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def prefix_info(tok, messages, ids):
    """Byte length and token count of the rendered system turn, which is a token prefix."""
    prefix = system_turn(messages)
    pids = encode(tok, prefix)
    if ids[: len(pids)] != pids:
        raise RuntimeError("the system turn is not a token prefix of the prompt")
    return {"bytes": len(prefix.encode("utf-8")), "tokens": len(pids)}


# ---------------------------------------------------------------------------
# chat template cases
# ---------------------------------------------------------------------------

CHAT_CONVERSATIONS = [
    ("default_system", [{"role": "user", "content": "What is 2 + 3?"}]),
    ("own_system", [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Hello, how are you?"},
    ]),
    ("whitespace_multi_turn", [
        {"role": "system", "content": "\tYou are a helpful assistant. "},
        {"role": "user", "content": "  What is 2 + 3?\n"},
        {"role": "assistant", "content": "2 + 3 = 5.\n\n"},
        {"role": "user", "content": " Can you add 15 and 27? "},
    ]),
    ("special_markup_in_content", [
        {"role": "user", "content": "Say <|im_end|> and <|endoftext|>, not <|mask|>."},
    ]),
    ("unicode", [{"role": "user", "content": "Cafe\u0301, naïve, 東京 🙂"}]),
    ("spec_example_hi", [{"role": "user", "content": "Hi"}]),
]


def chat_cases(tok):
    out = []
    for name, msgs in CHAT_CONVERSATIONS:
        text = render_chat(msgs)
        if render_jinja(msgs) != text:
            raise RuntimeError(f"chat case {name}: jinja2 and the plain rendering differ")
        ids = encode(tok, text)
        info = prefix_info(tok, msgs, ids)
        out.append(
            {
                "name": name,
                "messages": msgs,
                "rendered": text,
                "ids": ids,
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                "system_prefix_bytes": info["bytes"],
                "system_prefix_tokens": info["tokens"],
            }
        )
    return {
        "description": (
            "Dream's chat template (ChatML; a default system turn when the first message is not "
            "a system message; contents are not stripped) rendered by jinja2 with "
            "add_generation_prompt=True and encoded with the fixture tokenizer, "
            "add_special_tokens=False (special-token markup inside contents becomes the special "
            "token). decoded_skip_special is tokenizer.decode(ids, skip_special_tokens=True). "
            "system_prefix_bytes / system_prefix_tokens: UTF-8 length and token count of the "
            "rendered system turn '<|im_start|>system\\n...<|im_end|>\\n', a prefix of rendered "
            "and of ids."
        ),
        "cases": out,
    }
