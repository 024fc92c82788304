// RMSNorm over the last dimension: out = w * x / sqrt(mean(x^2) + eps), one workgroup per row.
// STATS: out[row] = 1 / sqrt(mean(x^2) + eps) alone, the row statistics a matmul that folds
// the norm into its loads reads (`matmul.wgsl` COOP with NORM), found once per row.

struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
//#if STATS
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#else
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//#endif

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    // Every invocation reaches the barriers; rows past the end only skip the writes.
    let valid = row < p.rows;
    let base = row * p.cols;
    var sum = 0.0;
    if (valid) {
        for (var c = lid.x; c < p.cols; c += WG) {
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
    let inv = inverseSqrt(partial[0] / f32(p.cols) + p.eps);
//#if STATS
    if (lid.x == 0u) {
        out[row] = inv;
    }
//#else
    for (var c = lid.x; c < p.cols; c += WG) {
        out[base + c] = w[c] * (x[base + c] * inv);
    }
//#endif
}
