// The last step of a mixture-of-experts FFN: out[r] = Σ_j w[r, j] · expert_out[slot_pos[r, j]],
// summed in slot order (no float atomics: every run gives the same bits). One workgroup per
// token row.

struct Params {
    rows: u32,
    cols: u32,  // D
    top_k: u32, // K
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> expert_out: array<f32>;
@group(0) @binding(2) var<storage, read> slot_pos: array<u32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const NONE: u32 = 0xffffffffu;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if row >= p.rows {
        return;
    }
    for (var c = t; c < p.cols; c += 64u) {
        var acc = 0.0;
        for (var j = 0u; j < p.top_k; j++) {
            let a = row * p.top_k + j;
            let pos = slot_pos[a];
            if pos != NONE {
                acc += weights[a] * expert_out[pos * p.cols + c];
            }
        }
        out[row * p.cols + c] = acc;
    }
}
