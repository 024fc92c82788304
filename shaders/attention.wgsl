// Bidirectional attention of query rows over two key/value segments (A then B), with an
// online softmax across both (flash-attention style).
//
// A workgroup owns one kv head and BQ "query units"; a unit is a (query row, query head)
// pair of that kv head's GQA group, so grouped heads share every K/V read. Keys are walked
// in tiles of BK = WG over the concatenation A ++ B (a tile may straddle the two segments).
//
// Invocations map to keys (scores) and to head dims (P·V); the loops over query units are
// the same for every invocation, so the Q and P reads from workgroup memory are broadcasts
// (one load for all lanes on SIMD CPU implementations, conflict-free on GPUs), while each
// K and V element is read once per workgroup. Per tile, two barriers:
//   phase 1: invocation j: scores of key j against every unit -> ss
//   -- barrier --
//   phase 2: invocation u < BQ: running max, probabilities -> ps, rescale factor -> alpha
//   -- barrier --
//   phase 3: invocation d: O[u][d] = O[u][d] * alpha[u] + sum_j ps[u][j] V[j][d]
// Phase 3 writes no workgroup memory, and what it reads is next written in phase 2 of the
// next tile, after that tile's first barrier; so no third barrier is needed.
//
// Scores are in the log2 domain (Q is pre-scaled by log2(e)/sqrt(HD)) so exp2 can be used.
// Specialisation: HD (head dim), BQ, WG. Workgroup memory: BQ*HD + 2*BQ*WG + 2*BQ floats.

struct Params {
    units: u32,        // m * group
    group: u32,        // n_heads / n_kv_heads
    q_stride: u32,
    q_col: u32,
    len_a: u32,
    len_b: u32,
    kv_stride: u32,    // n_kv_heads * HD
    out_stride: u32,   // n_heads * HD
    unit_blocks: u32,  // ceil(units / BQ)
    n_kv_heads: u32,
    scale_log2: f32,   // log2(e) / sqrt(HD)
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> ka: array<f32>;
@group(0) @binding(3) var<storage, read> va: array<f32>;
@group(0) @binding(4) var<storage, read> kb: array<f32>;
@group(0) @binding(5) var<storage, read> vb: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const HD: u32 = {{HD}}u;
const BQ: u32 = {{BQ}}u;
const WG: u32 = {{WG}}u;
const BK: u32 = WG;
// Head dims owned by one invocation in phase 3: d = lid + e * WG.
const DPT: u32 = (HD + WG - 1u) / WG;
// Finite "minus infinity": WGSL has no infinity literal, and exp2 of it is exactly 0.
const NEG: f32 = -1.0e30;

var<workgroup> qs: array<f32, {{QS_LEN}}>;
var<workgroup> ss: array<f32, {{PS_LEN}}>;
var<workgroup> ps: array<f32, {{PS_LEN}}>;
var<workgroup> alpha: array<f32, BQ>;
var<workgroup> total: array<f32, BQ>;

@compute @workgroup_size({{WG}})
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let gid = wid.x + wid.y * nwg.x;
    // Consecutive workgroups share a kv head, so its K/V stay in cache.
    let ublock = gid % p.unit_blocks;
    let kvh = gid / p.unit_blocks;
    if (kvh >= p.n_kv_heads) {
        return;
    }
    let u0 = ublock * BQ;
    let kv_col = kvh * HD;
    let n_keys = p.len_a + p.len_b;

    for (var i = lid; i < BQ * HD; i += WG) {
        let u = u0 + i / HD;
        var x = 0.0;
        if (u < p.units) {
            let row = u / p.group;
            let head = kvh * p.group + u % p.group;
            x = q[row * p.q_stride + p.q_col + head * HD + i % HD] * p.scale_log2;
        }
        qs[i] = x;
    }
    workgroupBarrier();

    // Phase 2 state of unit `lid` (lid < BQ).
    var run_max = NEG;
    var run_sum = 0.0;
    // Phase 3 accumulators: acc[e * BQ + u] for dim lid + e * WG of unit u.
    var acc: array<f32, {{ACC_LEN}}>;
    for (var i = 0u; i < DPT * BQ; i++) {
        acc[i] = 0.0;
    }

    // Segment A's tiles, then segment B's: the segment is the same for the whole workgroup,
    // so no loop below sits in divergent control flow (SIMD CPU implementations then turn
    // the Q and P reads into one scalar load each).
    let tiles_a = (p.len_a + BK - 1u) / BK;
    let n_tiles = tiles_a + (p.len_b + BK - 1u) / BK;
    for (var t = 0u; t < n_tiles; t++) {
        let in_a = t < tiles_a;
        let t0 = select(t - tiles_a, t, in_a) * BK;
        let seg_len = select(p.len_b, p.len_a, in_a);
        // Phase 1: scores of key t0 + lid (lanes past the segment read its last key).
        var s: array<f32, BQ>;
        for (var u = 0u; u < BQ; u++) {
            s[u] = 0.0;
        }
        let key = t0 + lid;
        let kbase = min(key, seg_len - 1u) * p.kv_stride + kv_col;
        if (in_a) {
            for (var d = 0u; d < {{P1HD}}u; d++) {
                let kd = ka[kbase + d];
                for (var u = 0u; u < BQ; u++) {
                    s[u] += qs[u * HD + d] * kd;
                }
            }
        } else {
            for (var d = 0u; d < {{P1HD}}u; d++) {
                let kd = kb[kbase + d];
                for (var u = 0u; u < BQ; u++) {
                    s[u] += qs[u * HD + d] * kd;
                }
            }
        }
        let valid = key < seg_len;
        for (var u = 0u; u < BQ; u++) {
            ss[u * BK + lid] = select(NEG, s[u], valid);
        }
        workgroupBarrier();
        // Phase 2: probabilities of unit lid against its updated running max.
        if (lid < BQ) {
            var mx = run_max;
            for (var j = 0u; j < BK; j++) {
                mx = max(mx, ss[lid * BK + j]);
            }
            var sum = 0.0;
            for (var j = 0u; j < BK; j++) {
                let pj = exp2(ss[lid * BK + j] - mx);
                ps[lid * BK + j] = pj;
                sum += pj;
            }
            let a = exp2(run_max - mx);
            alpha[lid] = a;
            run_sum = run_sum * a + sum;
            run_max = mx;
        }
        workgroupBarrier();
        // Phase 3: rescale and accumulate P·V for dims lid + e * WG (lanes past the head
        // dim work on its last column and write nothing).
        let keys_here = min(BK, seg_len - t0);
        for (var e = 0u; e < DPT; e++) {
            let col = kv_col + min(lid + e * WG, HD - 1u);
            for (var u = 0u; u < BQ; u++) {
                acc[e * BQ + u] *= alpha[u];
            }
            if (in_a) {
                for (var j = 0u; j < min(keys_here, {{P3J}}u); j++) {
                    let vd = va[(t0 + j) * p.kv_stride + col];
                    for (var u = 0u; u < BQ; u++) {
                        acc[e * BQ + u] += ps[u * BK + j] * vd;
                    }
                }
            } else {
                for (var j = 0u; j < min(keys_here, {{P3J}}u); j++) {
                    let vd = vb[(t0 + j) * p.kv_stride + col];
                    for (var u = 0u; u < BQ; u++) {
                        acc[e * BQ + u] += ps[u * BK + j] * vd;
                    }
                }
            }
        }
    }

    if (lid < BQ) {
        total[lid] = run_sum;
    }
    workgroupBarrier();
    for (var e = 0u; e < DPT; e++) {
        let d = lid + e * WG;
        if (d < HD) {
            for (var u = 0u; u < BQ; u++) {
                let unit = u0 + u;
                if (unit < p.units) {
                    let row = unit / p.group;
                    let head = kvh * p.group + unit % p.group;
                    out[row * p.out_stride + head * HD + d] = acc[e * BQ + u] / total[u];
                }
            }
        }
    }
}
