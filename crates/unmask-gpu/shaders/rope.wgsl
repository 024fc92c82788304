// Rotary position embedding, half-split ("rotate_half"): for each head, dims j and j + half
// rotate by the angle of frequency j at the row's absolute position. In place.
// The cos/sin table [max_pos, half, 2] is computed on the host in f32 like the reference.

struct Params {
    rows: u32,
    n_heads: u32,
    head_dim: u32,
    row_stride: u32,
    col_offset: u32,
    max_pos: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read> table: array<vec2<f32>>;

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
    let half = p.head_dim / 2u;
    let pos = min(positions[row], p.max_pos - 1u);
    let pairs = p.n_heads * half;
    for (var i = lid.x; i < pairs; i += 64u) {
        let head = i / half;
        let j = i % half;
        let base = row * p.row_stride + p.col_offset + head * p.head_dim + j;
        let cs = table[pos * half + j];
        let x1 = x[base];
        let x2 = x[base + half];
        x[base] = x1 * cs.x - x2 * cs.y;
        x[base + half] = x2 * cs.x + x1 * cs.y;
    }
}
