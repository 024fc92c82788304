// ACache's anchor importance and choice (one probe pass per request).
// `stats`: per (query row, head), the maximum and the sum of exp over the span's keys of
//   scale * q·k: the softmax over the span's keys alone.
// `accumulate`: per span key, the attention weights it gets from every query row and head
//   of this layer, added to its importance (a pass over the layers sums them).
// `select`: per span key, its rank by importance (ties to the lower position); the first
//   k are the anchors (selected = 1).
// q: the rotated q heads of the pass's QKV rows; the span's keys are arena rows
// span_start.., f32 or (KV_F16) f16 two per u32 word. GQA: q head h reads kv head
// h / (n_heads / n_kv_heads).

struct Params {
    n_queries: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
    span_start: u32,
    span_len: u32,
    k: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
//#if KV_F16
@group(0) @binding(2) var<storage, read> keys: array<u32>;
//#else
@group(0) @binding(2) var<storage, read> keys: array<f32>;
//#endif
@group(0) @binding(3) var<storage, read> query_rows: array<u32>;
@group(0) @binding(4) var<storage, read_write> stats: array<f32>;
@group(0) @binding(5) var<storage, read_write> importance: array<f32>;
@group(0) @binding(6) var<storage, read_write> selected: array<u32>;

const WG: u32 = 64u;
var<workgroup> red_a: array<f32, 64>;
var<workgroup> red_b: array<f32, 64>;

fn key_at(e: u32) -> f32 {
//#if KV_F16
    let w = unpack2x16float(keys[e / 2u]);
    return select(w.x, w.y, (e & 1u) == 1u);
//#else
    return keys[e];
//#endif
}

// scale * q·k for query i, head h and span key j.
fn score(i: u32, h: u32, j: u32) -> f32 {
    let q0 = query_rows[i] * p.qkv_stride + h * p.head_dim;
    let g = h / (p.n_heads / p.n_kv_heads);
    let k0 = (p.span_start + j) * p.n_kv_heads * p.head_dim + g * p.head_dim;
    var s = 0.0;
    for (var d = 0u; d < p.head_dim; d++) {
        s += qkv[q0 + d] * key_at(k0 + d);
    }
    return s * p.scale;
}

@compute @workgroup_size(64)
fn stats_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let pair = wid.x + wid.y * nwg.x;
    let live = pair < p.n_queries * p.n_heads;
    let i = pair / p.n_heads;
    let h = pair % p.n_heads;
    // Online softmax over this invocation's keys.
    var m = -3.0e38;
    var l = 0.0;
    if (live) {
        for (var j = lid.x; j < p.span_len; j += WG) {
            let s = score(i, h, j);
            let m2 = max(m, s);
            l = l * exp(m - m2) + exp(s - m2);
            m = m2;
        }
    }
    red_a[lid.x] = m;
    red_b[lid.x] = l;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w /= 2u) {
        if (lid.x < w) {
            let ma = red_a[lid.x];
            let mb = red_a[lid.x + w];
            let m2 = max(ma, mb);
            red_b[lid.x] = red_b[lid.x] * exp(ma - m2) + red_b[lid.x + w] * exp(mb - m2);
            red_a[lid.x] = m2;
        }
        workgroupBarrier();
    }
    if (live && lid.x == 0u) {
        stats[2u * pair] = red_a[0];
        stats[2u * pair + 1u] = red_b[0];
    }
}

@compute @workgroup_size(64)
fn accumulate_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let j = wid.x + wid.y * nwg.x;
    let live = j < p.span_len;
    var acc = 0.0;
    if (live) {
        for (var pair = lid.x; pair < p.n_queries * p.n_heads; pair += WG) {
            let s = score(pair / p.n_heads, pair % p.n_heads, j);
            acc += exp(s - stats[2u * pair]) / stats[2u * pair + 1u];
        }
    }
    red_a[lid.x] = acc;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w /= 2u) {
        if (lid.x < w) {
            red_a[lid.x] += red_a[lid.x + w];
        }
        workgroupBarrier();
    }
    if (live && lid.x == 0u) {
        importance[j] += red_a[0];
    }
}

@compute @workgroup_size(64)
fn select_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let j = (wid.x + wid.y * nwg.x) * WG + lid.x;
    if (j >= p.span_len) {
        return;
    }
    let mine = importance[j];
    var rank = 0u;
    for (var i = 0u; i < p.span_len; i++) {
        let other = importance[i];
        if (other > mine || (other == mine && i < j)) {
            rank += 1u;
        }
    }
    selected[j] = select(0u, 1u, rank < p.k);
}
