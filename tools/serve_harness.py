"""Starting `unmask serve` on a loopback port and asking `unmask generate` for the same
request, for tools/serve_test.py and tools/serve_load.py (standard library only)."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = open(os.path.join(ROOT, "data/tasks/demo-system.txt")).read().strip()


class Server:
    """`unmask serve --port 0 ...`; the port is read from its first line on stdout."""

    def __init__(self, unmask, model, *extra, timeout=120):
        self.proc = subprocess.Popen(
            [unmask, "serve", "--model", model, "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + timeout
        line = ""
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
        self.proc.kill()
        raise RuntimeError(
            f"the server did not start: {line!r}\n{self.proc.stderr.read()}"
        )

    def stop(self):
        """SIGTERM: the server finishes what it accepted and exits 0."""
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError("the server did not stop within 60 s of SIGTERM")
        stderr = self.proc.stderr.read()
        if code != 0:
            raise RuntimeError(f"the server exited with {code}:\n{stderr}")
        return stderr

    def request(self, method, path, body=None, headers=None, raw=None):
        """(status, parsed JSON or text, headers) of one HTTP request."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status, text, hdrs = r.status, r.read().decode(), r.headers
        except urllib.error.HTTPError as e:
            status, text, hdrs = e.code, e.read().decode(), e.headers
        try:
            return status, json.loads(text), hdrs
        except ValueError:
            return status, text, hdrs

    def metrics(self, headers=None):
        """The Prometheus metrics as {name: value} (label sets folded into the name)."""
        status, text, _ = self.request("GET", "/metrics", headers=headers)
        assert status == 200, (status, text)
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
        return out


def generate(unmask, model, system, user, gen_length, steps, block_length, cache, *flags):
    """`unmask generate --json` for one chat request (and any further `flags`): its answer text."""
    cmd = [unmask, "generate", "--model", model, "--prompt", user, "--gen-length", str(gen_length),
           "--steps", str(steps), "--block-length", str(block_length), "--cache", cache, "--json",
           *flags]
    if system is not None:
        cmd[2:2] = ["--system", system]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"unmask generate failed ({out.returncode}): {out.stderr}")
    return json.loads(out.stdout)["text"]


def report(result, path=None):
    """Prints a load test's JSON result (and writes it to `path`); its exit status: 1 when
    the result lists failures."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return 1 if result.get("failures") else 0
