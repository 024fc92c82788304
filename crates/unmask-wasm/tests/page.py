#!/usr/bin/env python3
"""The demo page in headless Chromium, driven over W3C WebDriver (standard library only).

Serves web/ (built by scripts/build-web.sh), opens the page, which loads the bundled model
(models/tiny). First it types settings the model cannot run (Steps 1e9, a Length past
2^32) and asks: each time the page must show the runtime's error, naming the setting, and
take the next request. Then it asks the first question of data/tasks/heldout-small.jsonl
with that item's system prompt and waits for the answer: the answer (text and token ids)
must equal what `unmask generate` prints for the same question with the same parameters.
Then, in a new chat, it asks the second question (same system prompt, so BiCache must hit)
and saves a screenshot while the canvas is half denoised. Last, it opens the page on the
DiffusionGemma fixture (`?model=tiny-dgemma&weights=f32`): the page must take the family from
its config.json (its settings, not the masked-diffusion ones), answer exactly as `unmask
generate` does for the same seed, and take the system turn from the prefix store the second
time.

    python3 crates/unmask-wasm/tests/page.py --unmask target/debug/unmask \
        --screenshot /tmp/web-demo.png
"""

import argparse
import base64
import functools
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# The page's parameters; the CLI gets the same ones.
GEN_LENGTH, STEPS, BLOCK_LENGTH, CACHE = 32, 16, 4, "bicache-dual"

CHROME_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--enable-unsafe-webgpu",
    "--enable-features=Vulkan,WebGPU",
    "--use-angle=swiftshader",
    "--use-webgpu-adapter=swiftshader",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-size=1280,1140",
    "--hide-scrollbars",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(directory):
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class WebDriver:
    def __init__(self, url):
        self.url = url
        self.session = None

    def call(self, method, path, body=None, timeout=60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}").get("value")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"WebDriver {method} {path}: {e.read().decode()[:2000]}") from e

    def start(self, binary):
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": binary, "args": CHROME_ARGS},
        }}}
        self.session = self.call("POST", "/session", caps, timeout=120)["sessionId"]

    def s(self, method, path, body=None, timeout=60):
        return self.call(method, f"/session/{self.session}{path}", body, timeout)

    def js(self, script, *args):
        return self.s("POST", "/execute/sync", {"script": script, "args": list(args)})

    def element(self, css):
        found = self.s("POST", "/element", {"using": "css selector", "value": css})
        return next(iter(found.values()))

    def wait_state(self, want, timeout):
        deadline = time.time() + timeout
        state = None
        while time.time() < deadline:
            state = self.js("return document.body.dataset.state || null;")
            if state in want:
                return state
            if state == "error" and "error" not in want:
                raise RuntimeError("the page failed: " + str(self.js("return window.unmask.error;")))
            time.sleep(0.25)
        raise RuntimeError(f"timed out after {timeout} s waiting for {want}; the page is {state!r}")


def retype(wd, css, text):
    """Empties a box and types `text` into it, as a person would."""
    box = wd.element(css)
    wd.s("POST", f"/element/{box}/clear", {})
    wd.s("POST", f"/element/{box}/value", {"text": text})


# Settings the model cannot run, typed into the page: (box, value, the field the error
# must name). Steps 1e9 once ran the wasm heap out (the promise never settled and the page
# stayed busy); 2^32 + 32 was read as 32 on wasm32.
BAD_SETTINGS = [("#steps", "1000000000", "steps"), ("#gen-length", str(2**32 + 32), "genLength")]


def refused(wd, question, timeout):
    """Each bad setting: the page shows the runtime's error naming it, leaves the chat
    without the refused turn, and stays usable (the Send button works again)."""
    for css, value, field in BAD_SETTINGS:
        retype(wd, css, value)
        box = wd.element("#question")
        wd.s("POST", f"/element/{box}/clear", {})
        wd.s("POST", f"/element/{box}/value", {"text": question})
        wd.s("POST", f"/element/{wd.element('#send')}/click", {})
        wd.wait_state({"error"}, timeout)
        shown = wd.js("""
            const line = document.getElementById('request-error');
            const msgs = document.querySelectorAll('#log .msg.error');
            return {line: line.hidden ? null : line.textContent,
                    msg: msgs.length ? msgs[msgs.length - 1].textContent : null,
                    send: !document.getElementById('send').disabled,
                    history: window.unmask.history.length};
        """)
        print(f"[page] {field} = {value}: {shown['line']!r}")
        if not (shown["line"] and f"{field}: expected" in shown["line"] and value in shown["line"]):
            sys.exit(f"the page should show why {field} = {value} was refused: {shown}")
        if not (shown["msg"] and f"{field}: expected" in shown["msg"]):
            sys.exit(f"the chat should show the refusal of {field} = {value}: {shown}")
        if not shown["send"] or shown["history"] != 0:
            sys.exit(f"the page should be usable and the chat unchanged: {shown}")
        # Back to a value it can run, before the next bad one.
        retype(wd, css, str(STEPS if css == "#steps" else GEN_LENGTH))


def cli_answer(unmask, model, system, question):
    cmd = [unmask, "generate", "--model", str(model), "--system", system, "--prompt", question,
           "--gen-length", str(GEN_LENGTH), "--steps", str(STEPS),
           "--block-length", str(BLOCK_LENGTH), "--cache", CACHE, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)


# The DiffusionGemma part: a random tiny model (its text is noise), compared token for token.
GEMMA_SYSTEM, GEMMA_STEPS, GEMMA_LENGTH = "You answer in one word.", 8, 16
GEMMA_QUESTIONS = ["Name a colour.", "Name an animal."]


def gemma_page(wd, server, unmask, timeout):
    model = ROOT / "tests/fixtures/tiny-dgemma"
    cmd = [unmask, "generate", "--model", str(model), "--system", GEMMA_SYSTEM,
           "--prompt", GEMMA_QUESTIONS[0], "--gen-length", str(GEMMA_LENGTH),
           "--steps", str(GEMMA_STEPS), "--seed", "0", "--weights", "f32", "--json"]
    want = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                     cwd=ROOT).stdout)
    page = (f"http://127.0.0.1:{server.server_address[1]}/index.html"
            "?model=tiny-dgemma&weights=f32")
    wd.s("POST", "/url", {"url": page}, timeout=120)
    wd.wait_state({"ready"}, timeout)
    family = wd.js("return document.body.dataset.family;")
    shown = wd.js("return [...document.querySelectorAll('#cache, #block-length, #seed')]"
                  ".map(e => e.offsetParent !== null);")
    status = wd.js("return document.getElementById('model-status').textContent;")
    print(f"[page] {status}")
    if family != "diffusion_gemma" or shown != [False, False, True]:
        sys.exit(f"the page should pick DiffusionGemma and its settings: family {family!r}, "
                 f"cache/block/seed shown {shown}")
    wd.js("""
        const [system, gen, steps] = arguments;
        document.getElementById('system').value = system;
        document.getElementById('gen-length').value = gen;
        document.getElementById('steps').value = steps;
        document.getElementById('seed').value = '0';
    """, GEMMA_SYSTEM, GEMMA_LENGTH, GEMMA_STEPS)
    results = []
    for question in GEMMA_QUESTIONS:
        wd.s("POST", f"/element/{wd.element('#new-chat')}/click", {})
        wd.s("POST", f"/element/{wd.element('#question')}/value", {"text": question})
        wd.s("POST", f"/element/{wd.element('#send')}/click", {})
        wd.wait_state({"done"}, timeout)
        results.append(wd.js("return window.unmask.last;"))
    first, second = results
    print(f"[page] DiffusionGemma: {len(first['ids'])} tokens in "
          f"{first['timings']['total_s']:.2f} s, steps {[c['steps'] for c in first['canvases']]}, "
          f"system turn {first['prefix']} then {second['prefix']}")
    if first["ids"] != want["ids"]:
        sys.exit(f"DiffusionGemma: page {first['ids']}, CLI {want['ids']}")
    print("[page] DiffusionGemma: the page's tokens equal `unmask generate`'s")
    if (first["prefix"] or {}).get("use") != "stored" or (second["prefix"] or {}).get("use") != "hit":
        sys.exit(f"DiffusionGemma: the system turn should be stored, then reused: "
                 f"{first['prefix']}, {second['prefix']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unmask", default=str(ROOT / "target/debug/unmask"))
    ap.add_argument("--chromedriver", default=os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    ap.add_argument("--screenshot", default=str(ROOT / "target/web-demo.png"))
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()

    web = ROOT / "web"
    if not (web / "pkg" / "unmask_wasm.js").exists():
        sys.exit("web/pkg is missing: run scripts/build-web.sh first")
    tasks = (ROOT / "data/tasks/heldout-small.jsonl").read_text().splitlines()
    item = json.loads(tasks[0])
    system, question = item["system"], item["user"]

    began = time.time()
    want = cli_answer(args.unmask, ROOT / "models/tiny", system, question)
    print(f"[cli] {want['text']!r} ({time.time() - began:.1f} s)")

    server = serve(web)
    port = free_port()
    # Its own process group, so stopping it also stops the Chromium it started.
    driver = subprocess.Popen([args.chromedriver, f"--port={port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    wd = WebDriver(f"http://127.0.0.1:{port}")
    try:
        for _ in range(100):
            try:
                if wd.call("GET", "/status", timeout=2).get("ready"):
                    break
            except (OSError, RuntimeError):
                pass
            time.sleep(0.1)
        wd.start(args.chromium)
        page = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        began = time.time()
        wd.s("POST", "/url", {"url": page}, timeout=120)
        wd.wait_state({"ready"}, args.timeout)
        print(f"[page] model loaded ({time.time() - began:.1f} s): "
              + wd.js("return document.getElementById('model-status').textContent;"))
        # The settings the CLI gets; the system prompt is set whole (it is long), the
        # question is typed.
        wd.js("""
            const [system, cache, gen, steps, block] = arguments;
            document.getElementById('system').value = system;
            document.getElementById('cache').value = cache;
            document.getElementById('gen-length').value = gen;
            document.getElementById('steps').value = steps;
            document.getElementById('block-length').value = block;
            document.getElementById('threshold').value = '';
            document.getElementById('temperature').value = '0';
        """, system, CACHE, GEN_LENGTH, STEPS, BLOCK_LENGTH)
        refused(wd, question, args.timeout)
        # The settings back to the CLI's, typed; the question box is emptied (the page
        # kept the refused question in it).
        for css, value in (("#steps", STEPS), ("#gen-length", GEN_LENGTH)):
            retype(wd, css, str(value))
        box = wd.element("#question")
        wd.s("POST", f"/element/{box}/clear", {})
        wd.s("POST", f"/element/{box}/value", {"text": question})
        began = time.time()
        wd.s("POST", f"/element/{wd.element('#send')}/click", {})
        wd.wait_state({"done"}, args.timeout)
        got_text = wd.js("const m = document.querySelectorAll('.msg.assistant'); "
                         "return m[m.length - 1].textContent;")
        result = wd.js("return window.unmask.last;")
        print(f"[page] {got_text!r} ({time.time() - began:.1f} s, "
              f"{result['timings']['throughput_canvas']:.1f} tokens/s, BiCache {result['bicache']})")
        failures = []
        if got_text != want["text"]:
            failures.append(f"answer text: page {got_text!r}, CLI {want['text']!r}")
        if result["ids"] != want["ids"]:
            failures.append(f"token ids: page {result['ids']}, CLI {want['ids']}")
        if failures:
            sys.exit("the page and `unmask generate` differ:\n  " + "\n  ".join(failures))
        print("[page] the page's answer equals `unmask generate`'s")
        # ... and it is the right answer (the bundled model reads its system prompt)
        if got_text.rsplit("####", 1)[-1].strip() != item["answer"]:
            sys.exit(f"the bundled model's answer {got_text!r} is not {item['answer']!r}")
        print(f"[page] the answer is right: {item['answer']!r}")
        # The page asks for each token's log-probability and shows the answer's.
        answer_lps = result["logprobs"][:result["timings"]["answer_tokens"]]
        stats = wd.js("return document.getElementById('stats').textContent;")
        if not answer_lps or any(lp is None or lp > 0 for lp in answer_lps) or "p at commit" not in stats:
            sys.exit(f"the page should show the answer's probabilities: {answer_lps}, stats {stats!r}")
        print(f"[page] answer tokens' log-probabilities shown: {[round(lp, 3) for lp in answer_lps]}")
        # Each committed cell names its step's most likely tokens, the committed one first.
        titles = wd.js("return [...document.querySelectorAll('#canvas .cell')].map((c) => c.title);")
        spelled = [t for t in titles[:result["timings"]["answer_tokens"]] if "most likely: " in t]
        # Greedy decoding committed the most likely token: the first alternative's p is its p.
        firsts = [re.search(r"p ([0-9.]+) at commit · most likely: (\".*?\") ([0-9.]+)", t) for t in spelled]
        if len(spelled) != len(answer_lps) or not all(m and m[1] == m[3] for m in firsts):
            sys.exit(f"the page should name each answer token's alternatives: {spelled}")
        print(f"[page] alternatives shown: {spelled[-1].split('most likely: ')[1]!r}")

        # A new chat with the same system prompt: the shared prefix entry is reused.
        second = json.loads(tasks[1])
        assert second["system"] == system, "the first two items share a system prompt"
        wd.s("POST", f"/element/{wd.element('#new-chat')}/click", {})
        wd.s("POST", f"/element/{wd.element('#question')}/value", {"text": second["user"]})
        wd.s("POST", f"/element/{wd.element('#send')}/click", {})
        deadline = time.time() + args.timeout
        shot = None
        while time.time() < deadline and shot is None:
            # Half the canvas committed: masks and committed tokens side by side.
            left = wd.js("return document.querySelectorAll('#canvas .cell.masked').length;")
            if wd.js("return document.body.dataset.state;") != "generating" or 0 < left <= GEN_LENGTH // 2:
                shot = base64.b64decode(wd.s("GET", "/screenshot"))
            else:
                time.sleep(0.05)
        wd.wait_state({"done"}, args.timeout)
        Path(args.screenshot).write_bytes(shot)
        print(f"[page] screenshot: {args.screenshot}")
        again = wd.js("return window.unmask.last;")
        print(f"[page] second question {second['user']!r}: "
              f"{wd.js('return window.unmask.last.text;')!r}, BiCache {again['bicache']}")
        if not (again["bicache"] and again["bicache"]["hit"]):
            sys.exit(f"the second request should reuse the shared prefix: {again['bicache']}")
        gemma_page(wd, server, args.unmask, args.timeout)
    finally:
        try:
            if wd.session:
                wd.s("DELETE", "", timeout=20)
        except (OSError, RuntimeError):
            pass
        try:
            os.killpg(driver.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        driver.wait(timeout=20)
        server.shutdown()


if __name__ == "__main__":
    main()
