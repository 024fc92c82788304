// The soft-embedding product of self-conditioning (DiffusionGemma, docs/models/diffusion-gemma.md
// §4.1): out[r, :] = scale * sum_v probs[r, v] * E[v, :], the probability-weighted mix of the
// token table's rows, over one chunk of the table per dispatch (accumulated across chunks).
// The table is read in any weight format through weight_load.wgsl. Each invocation owns one
// column for RB rows, so every table element is loaded once per RB rows.

struct Params {
    rows: u32,
    cols: u32,
    row_stride: u32,
    row_start: u32,
    chunk_rows: u32,
    s_off: u32,
    vocab: u32,
    accumulate: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> probs: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const RB: u32 = 8u;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x * 64u + lid.x;
    let r0 = wid.y * RB;
    if (c >= p.cols) {
        return;
    }
    var acc: array<f32, RB>;
    for (var v = 0u; v < p.chunk_rows; v++) {
        let e = load_w1(v * p.row_stride + c);
        let col = p.row_start + v;
        for (var i = 0u; i < RB; i++) {
            let r = min(r0 + i, p.rows - 1u);
            acc[i] += probs[r * p.vocab + col] * e;
        }
    }
    for (var i = 0u; i < RB; i++) {
        let r = r0 + i;
        if (r < p.rows) {
            let at = r * p.cols + c;
            var prev = 0.0;
            if (p.accumulate != 0u) {
                prev = out[at];
            }
            out[at] = prev + p.scale * acc[i];
        }
    }
}
