"""PyTorch reference of DiffusionGemma's logits: transformers' own model, called the way
`unmask logits` computes them.

It loads a DiffusionGemma folder with transformers (>= 5.23,
`DiffusionGemmaForBlockDiffusion`) on a device in float32 or bf16 and gives

* the encoder's logits over a prompt: the LM head and soft-cap applied to the encoder's final
  normed hidden states (docs/models/diffusion-gemma.md section 4.8), [T, V];
* the decoder's logits over a list of canvases after the prompt, [k, L, V]: the prompt is
  encoded once, then each canvas runs the decoder at positions P..P+L-1 with the cache read
  only.  Canvas i >= 1 is self-conditioned on canvas i-1's logits scaled by the temperature of
  step i-1 of the reference's loop (t = N - (i-1) steps left), through the reference's own
  temperature processor and cast to the embedding dtype as its `_denoising_step` does;
  canvas 0 runs without self-conditioning.

The passes are those tools/make_dgemma_fixture.py makes the goldens with (imported from there),
on the default DynamicCache: the path spec section 5 describes, not the static cache of the
compiled path.  tools/parity.py `--against torch` compares the runtime with this.

Numerics: `f32` runs the reference in float32 (the bf16 checkpoint widened exactly), the
goldens' numerics.  `bf16` is the published dtype: every activation is bf16 and the
embedding scale sqrt(D) is rounded to bf16 (section 4.1), the self-conditioning logits too;
the runtime keeps float32, so it differs from this by a few percent of the logits' scale.

Command line (needs torch, transformers, numpy):

    tools/.venv/bin/python tools/dgemma_torch.py --model tests/fixtures/tiny-dgemma \\
        --prompt-ids 2,5,7 [--canvas-ids C1 --canvas-ids C2] --out ref.npy [--dtype bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dgemma_common  # noqa: E402
import llada_common  # noqa: E402
import make_dgemma_fixture as passes  # noqa: E402  (encode_pass, decode_pass, new_cache)
import torch_common  # noqa: E402


class DgemmaTorch:
    """A loaded reference model and the sampler settings its temperature schedule reads."""

    def __init__(self, directory, device="cpu", dtype="f32"):
        from transformers import DiffusionGemmaForBlockDiffusion
        from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen
        from transformers.utils import logging

        device, torch_dtype = torch_common.prepare_device(device, dtype)
        self.cfg = dgemma_common.load_config(directory)  # refuses what the runtime does not run
        self.generation = dgemma_common.load_generation_config(directory)
        level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
        # a text-only folder has no vision tower: transformers reports it as newly initialised;
        # its loading bar would interleave with a parity report
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        try:
            model = DiffusionGemmaForBlockDiffusion.from_pretrained(directory, dtype=torch_dtype)
        finally:
            logging.set_verbosity(level)
            if bars:
                logging.enable_progress_bar()
        self.model = model.to(device).eval()
        self.device, self.dtype = device, dtype
        g = self.generation
        self.temperature = gen.LinearTemperatureScheduleLogitsProcessor(
            g["t_min"], g["t_max"], g["max_denoising_steps"]
        )

    def scaled(self, raw, step):
        """The reference's temperature-scaled logits of a step with `step` steps left."""
        cur = torch.tensor(step, device=raw.device, dtype=torch.int32)  # as _denoising_step makes it
        return self.temperature(None, raw, cur_step=cur)

    @torch.no_grad()
    def encoder_logits(self, prompt):
        """Soft-capped logits of the encoder over `prompt` from position 0, float32 [T, V]."""
        out = passes.encode_pass(self.model, list(prompt), passes.new_cache(self.model), 0)
        return out.float().cpu().numpy()

    @torch.no_grad()
    def decoder_logits(self, prompt, canvases):
        """Decoder logits of each canvas after `prompt`, self-conditioned along the list as the
        reference's denoising loop feeds one step into the next, float32 [k, L, V]."""
        import numpy as np

        if not canvases or any(len(c) != len(canvases[0]) or not c for c in canvases):
            raise ValueError("expected one or more canvases of the same non-zero length")
        cache = passes.new_cache(self.model)
        passes.encode_pass(self.model, list(prompt), cache, 0)
        start, n_steps = len(prompt), self.generation["max_denoising_steps"]
        embed_dtype = self.model.model.decoder.embed_tokens.weight.dtype
        sc, rows = None, []
        for i, canvas in enumerate(canvases):
            raw = passes.decode_pass(self.model, list(canvas), cache, start, sc)
            rows.append(raw.float().cpu().numpy())
            # more canvases than steps keep the last step's temperature, as `unmask logits` does
            sc = self.scaled(raw, max(n_steps - i, 1)).to(embed_dtype)
        return np.stack(rows)


def load(directory, device="cpu", dtype="f32"):
    return DgemmaTorch(directory, device, dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="DiffusionGemma folder (config.json, *.safetensors)")
    ap.add_argument("--prompt-ids", required=True, type=llada_common.parse_ids, help="prompt token ids, e.g. 2,5,7")
    ap.add_argument(
        "--canvas-ids",
        action="append",
        type=llada_common.parse_ids,
        help="a canvas for the decoder after the prompt (repeat for more steps); none: the encoder's logits",
    )
    ap.add_argument("--out", required=True, help="output .npy path (float32)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", choices=sorted(torch_common.DTYPES), default="f32", help="reference numerics")
    args = ap.parse_args(argv)

    model = load(args.model, args.device or torch_common.default_device(), args.dtype)
    if args.canvas_ids:
        logits = model.decoder_logits(args.prompt_ids, args.canvas_ids)
    else:
        logits = model.encoder_logits(args.prompt_ids)
    torch_common.write_npy(args.out, torch.from_numpy(logits))
    print(f"wrote {args.out}: float32 logits {list(logits.shape)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
