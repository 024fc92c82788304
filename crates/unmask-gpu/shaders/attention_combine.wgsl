// Combines the key slices of a split attention (attention_wide.wgsl with SPLIT): for each
// unit (query row, query head) and dim, out = sum_s w_s o_s / sum_s w_s l_s with
// w_s = exp2(m_s - max_s m_s), where slice s left its unnormalised output o_s, its max m_s
// (log2 domain) and its row sum l_s in `parts`. One invocation per output element.

struct Params {
    units: u32,      // query units per kv head (m * group)
    group: u32,      // n_heads / n_kv_heads
    n_kv_heads: u32,
    slices: u32,
    hd: u32,         // real head dim
    pitch: u32,      // head-dim class: the row pitch of the o part of `parts`
    out_stride: u32, // n_heads * hd
    row0: u32,       // first query row of out
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let n_units = p.n_kv_heads * p.units;
    let cell = i / p.hd;
    let d = i % p.hd;
    if (cell >= n_units) {
        return;
    }
    let stats = p.slices * n_units * p.pitch;
    var mx = -1.0e30;
    for (var s = 0u; s < p.slices; s++) {
        mx = max(mx, parts[stats + (s * n_units + cell) * 2u]);
    }
    var num = 0.0;
    var den = 0.0;
    for (var s = 0u; s < p.slices; s++) {
        let at = s * n_units + cell;
        let w = exp2(parts[stats + at * 2u] - mx);
        num += w * parts[at * p.pitch + d];
        den += w * parts[stats + at * 2u + 1u];
    }
    let kvh = cell / p.units;
    let u = cell % p.units;
    let row = p.row0 + u / p.group;
    let head = kvh * p.group + u % p.group;
    out[row * p.out_stride + head * p.hd + d] = num / den;
}
