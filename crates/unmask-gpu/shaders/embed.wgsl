// Embedding gather over one chunk of the table: out[r, :] = table[ids[r], :] for the ids that
// fall in this chunk's rows. The table is split over vocabulary rows when it is larger than a
// storage binding; one dispatch per chunk covers every row of the batch.

struct Params {
    rows: u32,
    cols: u32,
    row_stride: u32,
    row_start: u32,
    chunk_rows: u32,
    s_off: u32, // W_QUANT: word of the chunk where the scales start
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
//#if W_F32
@group(0) @binding(2) var<storage, read> table: array<f32>;
fn load(i: u32) -> f32 { return table[i]; }
//#endif
//#if W_PACKED
@group(0) @binding(2) var<storage, read> table: array<u32>;
fn load(i: u32) -> f32 { return unpack2x16float(table[i >> 1u])[i & 1u]; }
//#endif
//#if F16
@group(0) @binding(2) var<storage, read> table: array<f16>;
fn load(i: u32) -> f32 { return f32(table[i]); }
//#endif
//#if W_QUANT
// A quantized chunk (tensor.rs, `Weight`): codes of all rows, then the f16 scales from word
// s_off; element i has scale i / 32.
@group(0) @binding(2) var<storage, read> table: array<u32>;
fn scale_of(block: u32) -> f32 { return unpack2x16float(table[p.s_off + (block >> 1u)])[block & 1u]; }
//#endif
//#if W_Q8
fn load(i: u32) -> f32 {
    let b = table[i >> 2u] << (24u - 8u * (i & 3u));
    return f32(bitcast<i32>(b) >> 24u) * scale_of(i >> 5u);
}
//#endif
//#if W_Q4
fn load(i: u32) -> f32 {
    let q = (table[i >> 3u] >> (4u * (i & 7u))) & 15u;
    return (f32(q) - 8.0) * scale_of(i >> 5u);
}
//#endif
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

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
    let id = ids[row];
    if (id < p.row_start || id >= p.row_start + p.chunk_rows) {
        return;
    }
    let src = (id - p.row_start) * p.row_stride;
    let dst = row * p.cols;
    for (var c = lid.x; c < p.cols; c += 64u) {
        out[dst + c] = load(src + c);
    }
}
