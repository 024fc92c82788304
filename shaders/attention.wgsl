// Bidirectional attention of query rows over two key/value segments (A then B), with an
// online softmax across both (flash-attention style).
//
// A workgroup owns one kv head and BQ "query units"; a unit is a (query row, query head)
// pair of that kv head's GQA group, so grouped heads share every K/V tile. Keys are walked
// in tiles of BK over the concatenation A ++ B (a tile may straddle the two segments).
//
// Per tile, two barriers:
//   phase 1: scores S = Q·Kᵀ (one or more (unit, key) pairs per invocation) -> ss
//   -- barrier --
//   phase 2: row max, probabilities -> ps, rescale factor -> alpha;
//            load the NEXT K tile and THIS V tile (ks is free, vs was last read before
//            the previous barrier)
//   -- barrier --
//   phase 3: O = O·alpha + P·V, each invocation owning DPT dims of one unit
// Phase 3 writes no workgroup memory, and every buffer it reads is next written in phase 2
// of the next tile, after that tile's first barrier; so no third barrier is needed.
//
// Scores are in the log2 domain (Q is pre-scaled by log2(e)/sqrt(HD)) so exp2 can be used.
//
// Specialisation: HD (head dim), BQ, BK, WG (invocations). Memory, in f32:
// BQ*HD + BK*(HD+1) + BK*HD + 2*BQ*BK + BQ, kept under 16 KiB by the host.

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
const BK: u32 = {{BK}}u;
const WG: u32 = {{WG}}u;
// Invocations per unit in phase 3, and the dims each owns (d = lane + e * TD).
const TD: u32 = WG / BQ;
const DPT: u32 = (HD + TD - 1u) / TD;
// (unit, key) pairs per invocation in phases 1 and 2.
const SPT: u32 = (BQ * BK + WG - 1u) / WG;
// Odd K row stride: keys read by neighbouring invocations fall in different banks.
const KS: u32 = HD + 1u;
// Finite "minus infinity": WGSL has no infinity literal and exp2 of it is exactly 0.
const NEG: f32 = -1.0e30;

var<workgroup> qs: array<f32, {{QS_LEN}}>;
var<workgroup> ks: array<f32, {{KS_LEN}}>;
var<workgroup> vs: array<f32, {{VS_LEN}}>;
var<workgroup> ss: array<f32, {{PS_LEN}}>;
var<workgroup> ps: array<f32, {{PS_LEN}}>;
var<workgroup> alpha: array<f32, BQ>;

fn load_k(lid: u32, t0: u32, kv_col: u32, n_keys: u32) {
    for (var i = lid; i < BK * HD; i += WG) {
        let j = i / HD;
        let d = i % HD;
        let key = t0 + j;
        var x = 0.0;
        if (key < p.len_a) {
            x = ka[key * p.kv_stride + kv_col + d];
        } else if (key < n_keys) {
            x = kb[(key - p.len_a) * p.kv_stride + kv_col + d];
        }
        ks[j * KS + d] = x;
    }
}

fn load_v(lid: u32, t0: u32, kv_col: u32, n_keys: u32) {
    for (var i = lid; i < BK * HD; i += WG) {
        let j = i / HD;
        let d = i % HD;
        let key = t0 + j;
        var x = 0.0;
        if (key < p.len_a) {
            x = va[key * p.kv_stride + kv_col + d];
        } else if (key < n_keys) {
            x = vb[(key - p.len_a) * p.kv_stride + kv_col + d];
        }
        vs[i] = x;
    }
}

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
    load_k(lid, 0u, kv_col, n_keys);
    workgroupBarrier();

    var run_max: array<f32, SPT>;
    for (var s = 0u; s < SPT; s++) {
        run_max[s] = NEG;
    }
    let unit = lid / TD;
    let lane = lid % TD;
    var acc: array<f32, DPT>;
    for (var e = 0u; e < DPT; e++) {
        acc[e] = 0.0;
    }
    var run_sum = 0.0;

    let n_tiles = (n_keys + BK - 1u) / BK;
    for (var t = 0u; t < n_tiles; t++) {
        let t0 = t * BK;
        // Phase 1: scores.
        for (var s = 0u; s < SPT; s++) {
            let pair = lid + s * WG;
            if (BQ * BK % WG == 0u || pair < BQ * BK) {
                let qi = pair / BK;
                let j = pair % BK;
                var score = NEG;
                if (t0 + j < n_keys) {
                    var dot = 0.0;
                    for (var d = 0u; d < HD; d++) {
                        dot += qs[qi * HD + d] * ks[j * KS + d];
                    }
                    score = dot;
                }
                ss[pair] = score;
            }
        }
        workgroupBarrier();
        // Phase 2: probabilities against the updated running max of each unit.
        for (var s = 0u; s < SPT; s++) {
            let pair = lid + s * WG;
            if (BQ * BK % WG == 0u || pair < BQ * BK) {
                let qi = pair / BK;
                var mx = run_max[s];
                for (var j = 0u; j < BK; j++) {
                    mx = max(mx, ss[qi * BK + j]);
                }
                ps[pair] = exp2(ss[pair] - mx);
                if (pair % BK == 0u) {
                    alpha[qi] = exp2(run_max[s] - mx);
                }
                run_max[s] = mx;
            }
        }
        load_k(lid, t0 + BK, kv_col, n_keys);
        load_v(lid, t0, kv_col, n_keys);
        workgroupBarrier();
        // Phase 3: rescale and accumulate P·V.
        let a = alpha[unit];
        var psum = 0.0;
        for (var e = 0u; e < DPT; e++) {
            acc[e] *= a;
        }
        for (var j = 0u; j < BK; j++) {
            let pj = ps[unit * BK + j];
            psum += pj;
            for (var e = 0u; e < DPT; e++) {
                let d = lane + e * TD;
                if (HD % TD == 0u || d < HD) {
                    acc[e] += pj * vs[j * HD + d];
                }
            }
        }
        run_sum = run_sum * a + psum;
    }

    let u = u0 + unit;
    if (u < p.units) {
        let row = u / p.group;
        let head = kvh * p.group + u % p.group;
        let inv = 1.0 / run_sum;
        for (var e = 0u; e < DPT; e++) {
            let d = lane + e * TD;
            if (HD % TD == 0u || d < HD) {
                out[row * p.out_stride + head * HD + d] = acc[e] * inv;
            }
        }
    }
}
