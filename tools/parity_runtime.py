"""The runtime side of tools/parity.py: running the `unmask` binary and reading its output.

Finds the binary (--unmask, else target/release/unmask, else target/debug/unmask), runs
`unmask logits` and `unmask generate --json` with the options parity.py was given, and reads
the logits' .npy file.  Standard library only, like parity.py's goldens mode: the .npy
reader uses `array` instead of numpy.

SetupError lives here because every part of the parity script raises it (this module, the
comparisons of tools/parity_compare.py and tools/parity_dgemma.py's cases) and parity.py's
main() turns it into exit status 2; parity.py re-exports it and the other names.
"""

from __future__ import annotations

import array
import ast
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SetupError(Exception):
    """The comparison could not run (missing binary, bad files); exit status 2."""


# ---------------------------------------------------------------------------
# .npy reading (standard library)
# ---------------------------------------------------------------------------


def read_npy(path):
    """(shape, flat array of floats) of a float32/float64 C-order .npy file."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:6] != b"\x93NUMPY":
        raise SetupError(f"{path}: not a .npy file")
    major = raw[6]
    if major == 1:
        hlen, start = int.from_bytes(raw[8:10], "little"), 10
    elif major in (2, 3):
        hlen, start = int.from_bytes(raw[8:12], "little"), 12
    else:
        raise SetupError(f"{path}: .npy version {major} is not supported")
    header = ast.literal_eval(raw[start : start + hlen].decode("latin1"))
    descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    codes = {"<f4": "f", "<f8": "d"}
    if descr not in codes or fortran:
        raise SetupError(f"{path}: expected a C-order <f4 or <f8 array, found {descr} fortran={fortran}")
    data = array.array(codes[descr])
    data.frombytes(raw[start + hlen :])
    if sys.byteorder != "little":
        data.byteswap()
    if len(data) != math.prod(shape):
        raise SetupError(f"{path}: {len(data)} values for shape {shape}")
    return shape, data


def rows_of(shape, flat):
    """Split a flat [T, V] array into T row slices."""
    if len(shape) != 2:
        raise SetupError(f"expected logits [T, V], found shape {shape}")
    T, V = shape
    return [flat[i * V : (i + 1) * V] for i in range(T)]


# ---------------------------------------------------------------------------
# the runtime
# ---------------------------------------------------------------------------


def find_unmask(given):
    """The runtime binary: --unmask, else target/release/unmask, else target/debug/unmask."""
    if given:
        if not os.path.isfile(given):
            raise SetupError(f"--unmask {given}: no such file (build it with `cargo build -p unmask-cli`)")
        return given
    for kind in ("release", "debug"):
        path = os.path.join(ROOT, "target", kind, "unmask")
        if os.path.isfile(path):
            return path
    raise SetupError(
        "no target/release/unmask or target/debug/unmask: "
        "build with `cargo build -p unmask-cli` or pass --unmask PATH"
    )


class Runtime:
    """Runs the `unmask` binary with the --backend / --dtype / --matmul / --tune / --kv given to
    this script."""

    def __init__(self, binary, model, backend, dtype, matmul=None, kv=None, tune=None):
        self.binary, self.model, self.backend, self.dtype = binary, model, backend, dtype
        self.matmul, self.kv, self.tune = matmul, kv, tune
        self.env = dict(os.environ)
        if not self.env.get("XDG_RUNTIME_DIR"):
            # Vulkan loaders and Mesa look for it; without one they print warnings
            self._xdg = tempfile.TemporaryDirectory(prefix="unmask-xdg-")
            self.env["XDG_RUNTIME_DIR"] = self._xdg.name

    def _run(self, args):
        cmd = [self.binary, *args, "--model", self.model]
        if self.backend:
            cmd += ["--backend", self.backend]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.matmul:
            cmd += ["--matmul", self.matmul]
        if self.kv:
            cmd += ["--kv", self.kv]
        if self.tune:
            cmd += ["--tune", self.tune]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        if proc.returncode != 0:
            command = " ".join(cmd)
            raise SetupError(f"`{command}` failed with status {proc.returncode}:\n{proc.stderr.strip()}")
        return proc.stdout

    def logits(self, ids, canvases=()):
        """Rows of float32 logits [T][V]; with DiffusionGemma canvases, the decoder's rows
        [L][V] of each canvas after the prompt `ids`."""
        args = ["logits", "--prompt-ids", join_ids(ids)]
        for canvas in canvases:
            args += ["--canvas-ids", join_ids(canvas)]
        with tempfile.TemporaryDirectory(prefix="unmask-parity-") as tmp:
            out = os.path.join(tmp, "logits.npy")
            self._run([*args, "--out", out])
            shape, flat = read_npy(out)
        if canvases:
            if shape[:2] != (len(canvases), len(canvases[0])) or len(shape) != 3:
                raise SetupError(f"unmask logits returned {shape} for {len(canvases)} canvases")
            size = shape[1] * shape[2]
            return [rows_of(shape[1:], flat[i * size : (i + 1) * size]) for i in range(shape[0])]
        if shape[0] != len(ids):
            raise SetupError(f"unmask logits returned {shape[0]} rows for {len(ids)} ids")
        return rows_of(shape, flat)

    def generate(self, prompt, params):
        """The `--json` object of one `unmask generate --prompt-ids` run over the whole
        canvas, as the reference runs it."""
        args = [
            "generate",
            "--full-canvas",
            "--prompt-ids",
            join_ids(prompt),
            "--gen-length",
            str(params["gen_length"]),
            "--steps",
            str(params["steps"]),
            "--block-length",
            str(params["block_length"]),
            "--json",
        ]
        if params.get("cfg_scale"):
            args += ["--cfg-scale", repr(float(params["cfg_scale"]))]
        if params.get("threshold") is not None:
            args += ["--threshold", repr(float(params["threshold"]))]
        if params.get("logits_eos_inf"):
            args.append("--logits-eos-inf")
        if params.get("confidence_eos_eot_inf"):
            args.append("--confidence-eos-eot-inf")
        if "alg" in params:  # a Dream case: its timestep schedule and alg
            args += ["--schedule", "dream", "--eps", repr(float(params["eps"])), "--remasking", params["alg"]]
            if params.get("alg_temp"):
                args += ["--alg-temp", repr(float(params["alg_temp"]))]
            if params.get("top_p") is not None:
                args += ["--top-p", repr(float(params["top_p"]))]
            # A case without a cut ran the reference with none; unmask's default for Dream is
            # the reference's own top_k 50 (diffusion_generate's), so "none" is asked for.
            args += ["--top-k", str(int(params["top_k"])) if params.get("top_k") is not None else "0"]
        args += ["--confidence-precision", params.get("confidence_precision", "f32")]
        out = self._run(args)
        lines = [line for line in out.splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError) as e:
            raise SetupError(f"unmask generate --json printed no JSON object: {e}") from None


def join_ids(ids):
    return ",".join(str(int(t)) for t in ids)
