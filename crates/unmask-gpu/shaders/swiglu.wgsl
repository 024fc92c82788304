// SwiGLU: out = silu(gate) * up, where gate and up are column windows of the same input rows
// (a fused gate|up projection) or of two separate tensors bound to the same slot.

struct Params {
    rows: u32,
    cols: u32,
    in_stride: u32,
    gate_col: u32,
    up_col: u32,
    out_stride: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.in_stride;
    for (var c = lid.x; c < p.cols; c += 64u) {
        let g = gate_up[base + p.gate_col + c];
        let u = gate_up[base + p.up_col + c];
        // g * sigmoid(g); exp(-g) may overflow to inf for very negative g, giving -0.
        out[row * p.out_stride + c] = g / (1.0 + exp(-g)) * u;
    }
}
