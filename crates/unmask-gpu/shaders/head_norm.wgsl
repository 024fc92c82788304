// Per-head RMSNorm and rotate_half RoPE, in place, over `heads` heads of `head_dim` values
// at column `col_offset` of rows of `row_stride` floats: DiffusionGemma's q/k norms (weighted,
// then rotated) and its v norm (unit weight, not rotated). One workgroup per (row, head).
// The cos/sin table [max_pos, head_dim / 2] is built on the host; a partially rotated head
// (proportional RoPE) has cos 1, sin 0 in its unrotated pairs.

struct Params {
    rows: u32,
    heads: u32,
    head_dim: u32,
    row_stride: u32,
    col_offset: u32,
    max_pos: u32,
    eps: f32,
    rotate: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> positions: array<u32>;
@group(0) @binding(4) var<storage, read> table: array<vec2<f32>>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let unit = wid.x + wid.y * nwg.x;
    // Every invocation reaches the barriers; units past the end only skip the writes.
    let valid = unit < p.rows * p.heads;
    let row = unit / max(p.heads, 1u);
    let base = row * p.row_stride + p.col_offset + (unit % max(p.heads, 1u)) * p.head_dim;
    var sum = 0.0;
    if (valid) {
        for (var c = lid.x; c < p.head_dim; c += WG) {
            let v = x[base + c];
            sum += v * v;
        }
    }
    partial[lid.x] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            partial[lid.x] += partial[lid.x + s];
        }
        workgroupBarrier();
    }
    if (!valid) {
        return;
    }
    let inv = inverseSqrt(partial[0] / f32(p.head_dim) + p.eps);
    let half = p.head_dim / 2u;
    // Each invocation owns whole pairs (j, j + half): it reads and writes only them, after
    // the barrier that ended every read of the sum.
    let pos = min(positions[min(row, arrayLength(&positions) - 1u)], p.max_pos - 1u);
    for (var j = lid.x; j < half; j += WG) {
        let x1 = x[base + j] * inv * w[j];
        let x2 = x[base + j + half] * inv * w[j + half];
        if (p.rotate != 0u) {
            let cs = table[pos * half + j];
            x[base + j] = x1 * cs.x - x2 * cs.y;
            x[base + j + half] = x2 * cs.x + x1 * cs.y;
        } else {
            x[base + j] = x1;
            x[base + j + half] = x2;
        }
    }
}
