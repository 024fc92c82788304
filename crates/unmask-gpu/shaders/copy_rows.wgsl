// Row copies through an index list: `gather` reads rows idx[r] into row r, `scatter` writes
// row r to row idx[r]. Both take a column window of a wider row, so K/V columns of a fused
// QKV output can be written into a layer's KV arena at the rows' absolute positions.
// U32: the rows are u32 words (positions, arena rows), copied bit for bit.

struct Params {
    rows: u32,
    cols: u32,
    src_stride: u32,
    src_col: u32,
    dst_stride: u32,
    dst_col: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if U32
@group(0) @binding(1) var<storage, read> src: array<u32>;
//#else
@group(0) @binding(1) var<storage, read> src: array<f32>;
//#endif
@group(0) @binding(2) var<storage, read> idx: array<u32>;
//#if U32
@group(0) @binding(3) var<storage, read_write> dst: array<u32>;
//#else
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
//#endif

@compute @workgroup_size(64)
fn gather(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let s = idx[row] * p.src_stride + p.src_col;
    let d = row * p.dst_stride + p.dst_col;
    for (var c = lid.x; c < p.cols; c += 64u) {
        dst[d + c] = src[s + c];
    }
}

@compute @workgroup_size(64)
fn scatter(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let s = row * p.src_stride + p.src_col;
    let d = idx[row] * p.dst_stride + p.dst_col;
    for (var c = lid.x; c < p.cols; c += 64u) {
        dst[d + c] = src[s + c];
    }
}
