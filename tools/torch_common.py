"""PyTorch pieces shared by the LLaDA and Dream references.

tools/llada_torch.py and tools/dream_torch.py load Hugging Face-layout safetensors
checkpoints onto a device the same way, write logits as .npy files without needing
numpy, and print a generation the same way on the command line.  That lives here; the
models and samplers stay in their own files.  The standard-library checkpoint-file
helpers (index, shard checks, safetensors header) are in tools/llada_common.py.
"""

from __future__ import annotations

import array
import json
import math
import mmap
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llada_common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}

# safetensors dtype name -> torch dtype of the stored values
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}


# ---------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------


def read_safetensors(path, device, dtype, wanted=None):
    """Tensors of one .safetensors file, converted to `dtype` on `device`.

    The file is memory-mapped and read one tensor at a time, so host memory holds at
    most one tensor beyond what lands on the CPU.  `wanted` (a set of names) limits
    what is read.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors data is little-endian; this host is not")
    out = {}
    with open(path, "rb") as f:
        header, base = llada_common.read_safetensors_header(f)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            for name, stored, shape, begin, end in llada_common.safetensors_entries(path, header, wanted):
                st_dtype, count = _ST_DTYPES[stored], math.prod(shape)
                # one copy per tensor into a writable buffer (torch.frombuffer wants one)
                raw = bytearray(view[base + begin : base + end])
                if count:
                    t = torch.frombuffer(raw, dtype=st_dtype, count=count)
                else:
                    t = torch.empty(0, dtype=st_dtype)
                out[name] = t.reshape(shape).to(device=device, dtype=dtype)
    return out


def prepare_device(device, dtype):
    """(torch.device, torch dtype) for a load in `dtype` ("bf16"/"f32") on `device`.

    Refuses an unknown dtype and a CUDA device this PyTorch does not see, and switches
    TF32 off for float32 on CUDA.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: this PyTorch sees no CUDA device")
        if dtype == "f32":
            # true float32 products: TF32 would be a second source of error
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    return device, DTYPES[dtype]


def load_weights(directory, shapes, device, dtype):
    """The tensors named in `shapes` (name -> shape) of a checkpoint folder, single file or
    sharded by its index, as `dtype` on `device`; every one must be there with its shape."""
    files, index = llada_common.checkpoint_files(directory)
    weights = {}
    for name in files:
        part = read_safetensors(os.path.join(directory, name), device, dtype, set(shapes))
        llada_common.check_shard(weights, part, name, index)
        weights.update(part)
    llada_common.check_shapes(shapes, weights)
    return weights


# ---------------------------------------------------------------------------
# .npy output
# ---------------------------------------------------------------------------


def write_npy(path, t):
    """Write a tensor as a little-endian float32 .npy file (format 1.0); numpy is optional."""
    t = t.detach().to("cpu", torch.float32).contiguous()
    shape = tuple(t.shape)
    shape_text = f"({shape[0]},)" if len(shape) == 1 else "(" + ", ".join(str(d) for d in shape) + ")"
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }"
    pad = (-(10 + len(header) + 1)) % 64  # data starts on a 64-byte boundary
    header = header + " " * pad + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(_float32_bytes(t))


def _float32_bytes(t):
    """Raw little-endian bytes of a contiguous float32 CPU tensor."""
    try:
        return t.numpy().tobytes()  # fast path when numpy is installed
    except (RuntimeError, ImportError):
        if sys.byteorder != "little":
            raise NotImplementedError("writing .npy without numpy needs a little-endian host") from None
        return array.array("f", t.reshape(-1).tolist()).tobytes()


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def print_generation(result, model, dtype, as_json):
    """Print a generate() result: one JSON object (with the device and dtype added), or
    the generated ids separated by commas."""
    if as_json:
        result["device"], result["dtype"] = str(model.device), dtype
        print(json.dumps(result))
    else:
        print(",".join(str(t) for t in result["ids"]))
