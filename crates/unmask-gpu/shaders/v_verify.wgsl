// dLLM-Cache's V-verify, on the GPU without a read-back: for each response row of a pass,
// the cosine between its new V (the V columns of its QKV row, before the arena is
// overwritten) and the V its arena row holds from the last refresh (`cosine_main`); the k
// rows of lowest cosine, ties to the lower row (`select_main`); and those rows as a list in
// row order (`compact_main`), the index buffer the layer's later dispatches read.
// KV_F16: the V arena holds f16, two per u32 word (element 2i in the low half of word i).

struct Params {
    rows: u32,
    kv_w: u32,        // n_kv_heads * head_dim
    qkv_stride: u32,  // columns of a QKV row
    v_col: u32,       // first V column of a QKV row
    k: u32,           // rows to select
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
//#if KV_F16
@group(0) @binding(2) var<storage, read> v_arena: array<u32>;
//#else
@group(0) @binding(2) var<storage, read> v_arena: array<f32>;
//#endif
@group(0) @binding(3) var<storage, read> arena_rows: array<u32>;
@group(0) @binding(4) var<storage, read_write> cosine: array<f32>;
@group(0) @binding(5) var<storage, read_write> selected: array<u32>;
@group(0) @binding(6) var<storage, read_write> list: array<u32>;

const WG: u32 = 64u;
var<workgroup> dots: array<vec3<f32>, 64>;

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
    // (new · cached, |new|², |cached|²) of this invocation's columns.
    var acc = vec3<f32>(0.0);
    if (live) {
        let src = row * p.qkv_stride + p.v_col;
        let old = arena_rows[row] * p.kv_w;
        for (var c = lid.x; c < p.kv_w; c += WG) {
            let a = qkv[src + c];
            let b = cached_v(old + c);
            acc += vec3<f32>(a * b, a * a, b * b);
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
        cosine[row] = d.x / max(sqrt(d.y * d.z), 1e-12);
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
    let mine = cosine[j];
    var rank = 0u;
    for (var i = 0u; i < p.rows; i++) {
        let other = cosine[i];
        if (other < mine || (other == mine && i < j)) {
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
    list[slot] = j;
}
