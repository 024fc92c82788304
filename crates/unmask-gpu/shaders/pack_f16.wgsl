// f32 rows rounded to f16 and stored two per u32 word (`pack2x16float`, no shader-f16
// needed): row r of `src` (its first `cols` values, rows `src_stride` apart) becomes row
// `dst_row + r` of `dst` (rows `dst_stride` f16 values apart). `cols` and `dst_stride` are
// even, so every row starts on a word. How a pass's K/V reach an f16 cache.

struct Params {
    rows: u32,
    cols: u32,
    src_stride: u32,
    dst_stride: u32,
    dst_row: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

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
    let s = row * p.src_stride;
    let d = ((p.dst_row + row) * p.dst_stride) / 2u;
    for (var w = lid.x; w < p.cols / 2u; w += 64u) {
        dst[d + w] = pack2x16float(vec2<f32>(src[s + 2u * w], src[s + 2u * w + 1u]));
    }
}
