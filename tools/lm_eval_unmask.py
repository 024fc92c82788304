"""lm-evaluation-harness's model "unmask": a running `unmask serve` (LLaDA or Dream) scored and
sampled over HTTP, so lm-eval's tasks run on this runtime as LLaDA's own evaluation runs them.

    unmask serve --model DIR &
    python3 tools/lm_eval_unmask.py --model unmask \
        --model_args base_url=http://127.0.0.1:8080,mc_num=128 --tasks arc_easy

(this file registers the model, then runs lm-eval's command line with the arguments given;
`import lm_eval_unmask` does the same for a script that calls `lm_eval.simple_evaluate`).

- loglikelihood: the requests of one context go to `POST /v1/loglikelihood` together (a
  multiple-choice item is one call): LLaDA's Monte Carlo estimate with `mc_num` samples in
  batches of `mc_batch`, `cfg_scale` and `seed`. `is_greedy` comes from the server decoding
  each continuation's length at temperature 0 (`greedy=true`, the default; `greedy=false`
  skips that work and reports False, for tasks that read the log-likelihoods alone).
- generate_until: `POST /v1/completions` at temperature 0 with `max_gen_toks` as the canvas
  (`max_tokens` by default) and `until` as stop strings; `steps` and `block_length` pass
  through when given.
- loglikelihood_rolling (perplexity tasks): one `/v1/loglikelihood` call per document with an
  empty prompt and `rolling: true`. The server scores a document that fits the model's
  positions whole (the masked model's bound on its log-likelihood) and a longer one in
  windows of half the positions, each after the tokens before it that fit, summing their
  estimates.
- `--apply_chat_template`: the history is sent as chat `messages`, so the server's own chat
  template frames it and the assistant's turn follows (typed special tokens in a text prompt
  stay text on this server).

Only the standard library and lm_eval (`pip install lm_eval`; no PyTorch) are needed.
"""

import json
import urllib.error
import urllib.request

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

# apply_chat_template's answer: the history, tagged so the request sends it as `messages`.
CHAT_TAG = "\x00unmask-chat\x00"

# The most continuations one /v1/loglikelihood call takes (the server's bound).
MOST_CONTINUATIONS = 64


def as_bool(v):
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("unmask")
class UnmaskLM(LM):
    def __init__(self, base_url="http://127.0.0.1:8080", api_key=None, mc_num=128, mc_batch=16,
                 cfg_scale=0.0, seed=0, greedy=True, max_tokens=256, steps=None,
                 block_length=None, timeout=3600, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"model_args: unknown {sorted(unknown)}; expected base_url, api_key, "
                             "mc_num, mc_batch, cfg_scale, seed, greedy, max_tokens, steps, "
                             "block_length, timeout")
        self.base_url = str(base_url).rstrip("/")
        self.api_key = api_key
        self.mc_num, self.mc_batch = int(mc_num), int(mc_batch)
        self.cfg_scale, self.seed = float(cfg_scale), int(seed)
        self.greedy = as_bool(greedy)
        self.max_tokens = int(max_tokens)
        self.steps = None if steps is None else int(steps)
        self.block_length = None if block_length is None else int(block_length)
        self.timeout = float(timeout)

    # -- HTTP ---------------------------------------------------------------------------------

    def post(self, path, body):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise RuntimeError(f"{path} answered {e.code}: {detail}") from None

    @staticmethod
    def prompt_fields(context):
        """The request's prompt: chat messages from apply_chat_template, else the text."""
        if context.startswith(CHAT_TAG):
            return {"messages": json.loads(context[len(CHAT_TAG):])}
        # An empty context is sent as it is: the server scores unconditionally where the
        # model allows it and names the prompt where it does not.
        return {"prompt": context}

    # -- lm-eval's interface ------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm=False):
        by_context = {}
        for i, req in enumerate(requests):
            context, continuation = req.args
            by_context.setdefault(context, []).append((i, continuation))
        out = [None] * len(requests)
        for context, items in by_context.items():
            for at in range(0, len(items), MOST_CONTINUATIONS):
                chunk = items[at:at + MOST_CONTINUATIONS]
                body = {**self.prompt_fields(context),
                        "continuations": [c for _, c in chunk],
                        "mc_num": self.mc_num, "mc_batch": min(self.mc_batch, self.mc_num),
                        "cfg_scale": self.cfg_scale, "seed": self.seed,
                        # No greedy decoding exists after an empty context: is_greedy is False.
                        "greedy": self.greedy and bool(context)}
                data = self.post("/v1/loglikelihood", body)["data"]
                for (i, continuation), d in zip(chunk, data):
                    out[i] = (float(d["log_likelihood"]), bool(d.get("is_greedy", False)))
                    self.cache_hook.add_partial("loglikelihood", (context, continuation), out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            (text,) = req.args
            body = {"prompt": "", "continuation": text, "rolling": True,
                    "mc_num": self.mc_num, "mc_batch": min(self.mc_batch, self.mc_num),
                    "seed": self.seed}
            ll = float(self.post("/v1/loglikelihood", body)["data"][0]["log_likelihood"])
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
            out.append(ll)
        return out

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            until = [u for u in until if u]
            max_tokens = int(gen_kwargs.pop("max_gen_toks", self.max_tokens))
            temperature = float(gen_kwargs.pop("temperature", 0.0))
            if not as_bool(gen_kwargs.pop("do_sample", temperature > 0)):
                temperature = 0.0
            fields = self.prompt_fields(context)
            body = {**fields, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": self.seed}
            if until:
                body["stop"] = until[:4]
            if self.steps is not None:
                body["steps"] = self.steps
            if self.block_length is not None:
                body["block_length"] = self.block_length
            if "messages" in fields:
                answer = self.post("/v1/chat/completions", body)
                text = answer["choices"][0]["message"]["content"]
            else:
                answer = self.post("/v1/completions", body)
                text = answer["choices"][0]["text"]
            # The server stops at the first four; any further stop string is cut here.
            for stop in until[4:]:
                text = text.split(stop, 1)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return out

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        if not add_generation_prompt:
            raise NotImplementedError(
                "a prefilled assistant turn: the server's chat prompt always ends with the "
                "assistant's header")
        return CHAT_TAG + json.dumps(chat_history)

    @property
    def tokenizer_name(self):
        return "unmask-server"

    def chat_template(self, chat_template=False):
        return "unmask-server" if chat_template else ""


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
