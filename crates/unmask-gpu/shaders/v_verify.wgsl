// dLLM-Cache's V-verify, on the GPU without a read-back: for each response row of a pass,
// the cosine between its new V (the V columns of its QKV row, before the arena is
// overwritten) and the V its arena row holds from the last refresh (`cosine_main`); the k
// rows of lowest cosine outside the skipped rows, ties to the lower row (`select_main`); and those rows as a list in
// row order (`compact_main`), the index buffer the layer's later dispatches read; then
// every row's new V into its arena row (`store_main`: the V cache takes every new V).
// The rows are `row0..row0 + rows` of the pass (one sequence's response); the list gets
// their pass rows from slot `list_base`.
// KV_F16: the V arena holds f16, two per u32 word (element 2i in the low half of word i).
// BIAS (Qwen2/Dream): the projection's bias is added to the new V, as `rope_qkv` adds it.
// MOST_SIMILAR: the k rows of highest cosine instead (a deliberately wrong cache).

struct Params {
    rows: u32,
    kv_w: u32,        // n_kv_heads * head_dim
    qkv_stride: u32,  // columns of a QKV row
    v_col: u32,       // first V column of a QKV row
    k: u32,           // rows to select
    row0: u32,        // first pass row
    list_base: u32,   // first list slot
    skip_start: u32,  // rows skip_start..skip_end are never picked (computed anyway)
    skip_end: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
//#if KV_F16
@group(0) @binding(2) var<storage, read_write> v_arena: array<u32>;
//#else
@group(0) @binding(2) var<storage, read_write> v_arena: array<f32>;
//#endif
@group(0) @binding(3) var<storage, read> arena_rows: array<u32>;
@group(0) @binding(4) var<storage, read_write> cosine: array<f32>;
@group(0) @binding(5) var<storage, read_write> selected: array<u32>;
@group(0) @binding(6) var<storage, read_write> list: array<u32>;
//#if BIAS
@group(0) @binding(7) var<storage, read> bias: array<f32>;
//#endif

const WG: u32 = 64u;
var<workgroup> dots: array<vec4<f32>, 64>;

// Column c of pass row `row`'s new V.
fn new_v(row: u32, c: u32) -> f32 {
    let v = qkv[row * p.qkv_stride + p.v_col + c];
//#if BIAS
    return v + bias[p.v_col + c];
//#else
    return v;
//#endif
}

// A new value as the arena would store it.
fn stored(v: f32) -> f32 {
//#if KV_F16
    return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;
//#else
    return v;
//#endif
}

fn cached_v(e: u32) -> f32 {
//#if KV_F16
    let w = unpack2x16float(v_arena[e / 2u]);
    return select(w.x, w.y, (e & 1u) == 1u);
//#else
    return v_arena[e];
//#endif
}

@compute @workgroup_size(64)
fn cosine_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    let live = row < p.rows;
    // (new · cached, |new|², |cached|², columns that differ as stored) of this
    // invocation's columns.
    var acc = vec4<f32>(0.0);
    if (live) {
        let old = arena_rows[p.row0 + row] * p.kv_w;
        for (var c = lid.x; c < p.kv_w; c += WG) {
            let a = new_v(p.row0 + row, c);
            let b = cached_v(old + c);
            acc += vec4<f32>(a * b, a * a, b * b, select(0.0, 1.0, stored(a) != b));
        }
    }
    dots[lid.x] = acc;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w /= 2u) {
        if (lid.x < w) {
            dots[lid.x] += dots[lid.x + w];
        }
        workgroupBarrier();
    }
    if (live && lid.x == 0u) {
        let d = dots[0];
        // A V that has not moved is exactly 1, whatever the rounding of the quotient, so
        // unmoved rows tie and go by position as in the reference.
        cosine[row] = select(d.x / max(sqrt(d.y * d.z), 1e-12), 1.0, d.w == 0.0);
    }
}

@compute @workgroup_size(64)
fn select_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let j = (wid.x + wid.y * nwg.x) * WG + lid.x;
    if (j >= p.rows) {
        return;
    }
    if (j >= p.skip_start && j < p.skip_end) {
        selected[j] = 0u;
        return;
    }
    let mine = cosine[j];
    var rank = 0u;
    for (var i = 0u; i < p.rows; i++) {
        if (i >= p.skip_start && i < p.skip_end) {
            continue;
        }
        let other = cosine[i];
//#if MOST_SIMILAR
        let before = other > mine;
//#else
        let before = other < mine;
//#endif
        if (before || (other == mine && i < j)) {
            rank += 1u;
        }
    }
    selected[j] = select(0u, 1u, rank < p.k);
}

@compute @workgroup_size(64)
fn compact_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let j = (wid.x + wid.y * nwg.x) * WG + lid.x;
    if (j >= p.rows || selected[j] == 0u) {
        return;
    }
    var slot = 0u;
    for (var i = 0u; i < j; i++) {
        slot += selected[i];
    }
    list[p.list_base + slot] = p.row0 + j;
}

@compute @workgroup_size(64)
fn store_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let r = p.row0 + row;
    let dst = arena_rows[r] * p.kv_w;
//#if KV_F16
    for (var w = lid.x; w < p.kv_w / 2u; w += WG) {
        let pair = vec2<f32>(new_v(r, 2u * w), new_v(r, 2u * w + 1u));
        v_arena[dst / 2u + w] = pack2x16float(pair);
    }
//#else
    for (var c = lid.x; c < p.kv_w; c += WG) {
        v_arena[dst + c] = new_v(r, c);
    }
//#endif
}
