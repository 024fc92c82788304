// Attention with a causal mask, an optional sliding window and a given scale, over two K/V
// segments read as one key sequence (A's rows, then B's): DiffusionGemma's encoder and commit
// passes (causal, window W on sliding layers) and its decoder (no mask, cached keys in A,
// canvas keys in B), both with scale 1 and head dims up to 512 (§4.4, §5 of
// docs/models/diffusion-gemma.md). One workgroup per (query row, head); keys in tiles of 64,
// one key per invocation for the scores, an online softmax across tiles, and each invocation
// accumulating head_dim / 64 output dims. Query row r sits at key index query_start + r:
// with `causal` it sees keys j <= query_start + r, with a window W also j > query_start + r - W.

struct Params {
    rows: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    q_col: u32,
    start_a: u32,
    len_a: u32,
    start_b: u32,
    len_b: u32,
    causal: u32,
    window: u32,
    query_start: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> ka: array<f32>;
@group(0) @binding(3) var<storage, read> va: array<f32>;
@group(0) @binding(4) var<storage, read> kb: array<f32>;
@group(0) @binding(5) var<storage, read> vb: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
const MAX_HD: u32 = 512u;
const PER: u32 = MAX_HD / WG;

var<workgroup> qs: array<f32, MAX_HD>;
var<workgroup> scores: array<f32, WG>;
var<workgroup> red: array<f32, WG>;

// Start of key j's row (in floats) within its segment's buffer, for kv head `kvh`.
fn key_at(j: u32, kvh: u32) -> u32 {
    let w = p.n_kv_heads * p.head_dim;
    if (j < p.len_a) {
        return (p.start_a + j) * w + kvh * p.head_dim;
    }
    return (p.start_b + j - p.len_a) * w + kvh * p.head_dim;
}

fn reduce(lid: u32, is_max: bool) -> f32 {
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            if (is_max) {
                red[lid] = max(red[lid], red[lid + s]);
            } else {
                red[lid] += red[lid + s];
            }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let lid = lid3.x;
    let unit = wid.x + wid.y * nwg.x;
    if (unit >= p.rows * p.n_heads) {
        return;
    }
    let row = unit / p.n_heads;
    let h = unit % p.n_heads;
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let hd = p.head_dim;
    let qbase = row * p.q_stride + p.q_col + h * hd;
    for (var c = lid; c < hd; c += WG) {
        qs[c] = q[qbase + c];
    }
    workgroupBarrier();
    let n_keys = p.len_a + p.len_b;
    let qpos = p.query_start + row;
    var lo = 0u;
    var hi = n_keys;
    if (p.causal != 0u) {
        hi = min(qpos + 1u, n_keys);
        if (p.window > 0u && qpos + 1u > p.window) {
            lo = qpos + 1u - p.window;
        }
    }
    var m_run = -3.0e38;
    var l_run = 0.0;
    var acc: array<f32, PER>;
    for (var t = lo; t < hi; t += WG) {
        let j = t + lid;
        var s = -3.0e38;
        if (j < hi) {
            let kbase = key_at(j, kvh);
            var dot = 0.0;
            if (j < p.len_a) {
                for (var c = 0u; c < hd; c++) {
                    dot += qs[c] * ka[kbase + c];
                }
            } else {
                for (var c = 0u; c < hd; c++) {
                    dot += qs[c] * kb[kbase + c];
                }
            }
            s = dot * p.scale;
        }
        red[lid] = s;
        workgroupBarrier();
        let m_new = max(m_run, reduce(lid, true));
        var e = 0.0;
        if (j < hi) {
            e = exp(s - m_new);
        }
        scores[lid] = e;
        red[lid] = e;
        workgroupBarrier();
        let alpha = exp(m_run - m_new);
        l_run = l_run * alpha + reduce(lid, false);
        m_run = m_new;
        let n = min(WG, hi - t);
        for (var i = 0u; i < PER; i++) {
            let c = lid + i * WG;
            if (c < hd) {
                var sum = acc[i] * alpha;
                for (var jj = 0u; jj < n; jj++) {
                    let vbase = key_at(t + jj, kvh);
                    if (t + jj < p.len_a) {
                        sum += scores[jj] * va[vbase + c];
                    } else {
                        sum += scores[jj] * vb[vbase + c];
                    }
                }
                acc[i] = sum;
            }
        }
        workgroupBarrier();
    }
    let obase = row * p.n_heads * hd + h * hd;
    for (var i = 0u; i < PER; i++) {
        let c = lid + i * WG;
        if (c < hd) {
            out[obase + c] = acc[i] / max(l_run, 1e-30);
        }
    }
}
