// Bidirectional attention of query rows over two key/value segments (A then B), with an
// online softmax across both (flash-attention style).
//
// A workgroup owns one kv head and BQ "query units"; a unit is a (query row, query head)
// pair of that kv head's GQA group, so grouped heads share every K/V read. Keys are walked
// in tiles of BK, segment A's tiles first, then B's; the segment of a tile is the same for
// the whole workgroup, so no hot loop sits in divergent control flow.
//
// Both products are register-blocked: an invocation computes an RQ x RK block of scores
// and an RU x RD block of the output, so every value it loads feeds several FMAs. (On SIMD
// CPU implementations such as lavapipe each invocation's load is a separate scalar access;
// the loads per FMA decide the speed. On GPUs the blocks keep the loads in L1.)
// Per tile, two barriers:
//   phase 1: scores S = Q Kᵀ * scale, block (RQ units x RK keys) per invocation -> ss
//   -- barrier --
//   phase 2: invocation u < BQ: running max, probabilities -> ps, rescale factor -> alpha
//   -- barrier --
//   phase 3: O = O * alpha + P V, block (RU units x RD dims) per invocation
// Phase 3 writes no workgroup memory, and what it reads is next written in phase 2 of the
// next tile, after that tile's first barrier; so no third barrier is needed.
//
// Scores are in the log2 domain (scale = log2(e)/sqrt(HD)) so exp2 can be used.
// Workgroup memory: 2 * BQ * BK + 2 * BQ floats.

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
// Phase 1: invocation lid owns units (lid / NKB) * RQ + i and keys (lid % NKB) * RK + k.
const RQ: u32 = {{RQ}}u;
const RK: u32 = {{RK}}u;
const NKB: u32 = BK / RK;
// Phase 3: invocation lid owns units (lid / NDB) * RU + i and dims lid % NDB + NDB * r.
const RU: u32 = {{RU}}u;
const NDB: u32 = WG / (BQ / RU);
const RD: u32 = (HD + NDB - 1u) / NDB;
// Finite "minus infinity": WGSL has no infinity literal, and exp2 of it is exactly 0.
const NEG: f32 = -1.0e30;

var<workgroup> ss: array<f32, {{PS_LEN}}>;
var<workgroup> ps: array<f32, {{PS_LEN}}>;
var<workgroup> alpha: array<f32, BQ>;
var<workgroup> total: array<f32, BQ>;

// Row offset of unit u's query / output head; units past the end stand in for unit u0
// (their results are never stored).
fn unit_offset(u: u32, u0: u32, kvh: u32, stride: u32, col: u32) -> u32 {
    let uc = select(u0, u, u < p.units);
    let row = uc / p.group;
    let head = kvh * p.group + uc % p.group;
    return row * stride + col + head * HD;
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

    // Phase 1 ownership.
    let q_unit0 = (lid / NKB) * RQ;
    let key0 = (lid % NKB) * RK;
    var qbase: array<u32, RQ>;
    for (var i = 0u; i < RQ; i++) {
        qbase[i] = unit_offset(u0 + q_unit0 + i, u0, kvh, p.q_stride, p.q_col);
    }
    // Phase 3 ownership and accumulators acc[i * RD + r].
    let o_unit0 = (lid / NDB) * RU;
    let dim0 = lid % NDB;
    var dcol: array<u32, RD>;
    for (var r = 0u; r < RD; r++) {
        dcol[r] = kv_col + min(dim0 + NDB * r, HD - 1u);
    }
    var acc: array<f32, {{ACC_LEN}}>;
    for (var x = 0u; x < RU * RD; x++) {
        acc[x] = 0.0;
    }
    // Phase 2 state of unit lid (lid < BQ).
    var run_max = NEG;
    var run_sum = 0.0;

    let tiles_a = (p.len_a + BK - 1u) / BK;
    let n_tiles = tiles_a + (p.len_b + BK - 1u) / BK;
    for (var t = 0u; t < n_tiles; t++) {
        let in_a = t < tiles_a;
        let t0 = select(t - tiles_a, t, in_a) * BK;
        let seg_len = select(p.len_b, p.len_a, in_a);

        // Phase 1. Keys past the segment read its last row; their scores are masked.
        var kbase: array<u32, RK>;
        for (var k = 0u; k < RK; k++) {
            kbase[k] = min(t0 + key0 + k, seg_len - 1u) * p.kv_stride + kv_col;
        }
        var s: array<f32, {{S_LEN}}>;
        for (var x = 0u; x < RQ * RK; x++) {
            s[x] = 0.0;
        }
        var qv: array<f32, RQ>;
        var kv: array<f32, RK>;
        for (var d = 0u; d < HD; d++) {
            for (var i = 0u; i < RQ; i++) {
                qv[i] = q[qbase[i] + d];
            }
            if (in_a) {
                for (var k = 0u; k < RK; k++) {
                    kv[k] = ka[kbase[k] + d];
                }
            } else {
                for (var k = 0u; k < RK; k++) {
                    kv[k] = kb[kbase[k] + d];
                }
            }
            for (var i = 0u; i < RQ; i++) {
                for (var k = 0u; k < RK; k++) {
                    s[i * RK + k] += qv[i] * kv[k];
                }
            }
        }
        for (var i = 0u; i < RQ; i++) {
            for (var k = 0u; k < RK; k++) {
                let valid = t0 + key0 + k < seg_len;
                ss[(q_unit0 + i) * BK + key0 + k] = select(NEG, s[i * RK + k] * p.scale_log2, valid);
            }
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

        // Phase 3: rescale, then accumulate P V over the keys of this tile.
        for (var i = 0u; i < RU; i++) {
            let a = alpha[o_unit0 + i];
            for (var r = 0u; r < RD; r++) {
                acc[i * RD + r] *= a;
            }
        }
        let keys_here = min(BK, seg_len - t0);
        var pv: array<f32, RU>;
        var vv: array<f32, RD>;
        for (var j = 0u; j < keys_here; j++) {
            for (var i = 0u; i < RU; i++) {
                pv[i] = ps[(o_unit0 + i) * BK + j];
            }
            let vrow = (t0 + j) * p.kv_stride;
            if (in_a) {
                for (var r = 0u; r < RD; r++) {
                    vv[r] = va[vrow + dcol[r]];
                }
            } else {
                for (var r = 0u; r < RD; r++) {
                    vv[r] = vb[vrow + dcol[r]];
                }
            }
            for (var i = 0u; i < RU; i++) {
                for (var r = 0u; r < RD; r++) {
                    acc[i * RD + r] += pv[i] * vv[r];
                }
            }
        }
    }

    if (lid < BQ) {
        total[lid] = run_sum;
    }
    workgroupBarrier();
    for (var i = 0u; i < RU; i++) {
        let u = u0 + o_unit0 + i;
        if (u < p.units) {
            let base = unit_offset(u, u0, kvh, p.out_stride, 0u);
            let inv = 1.0 / total[o_unit0 + i];
            for (var r = 0u; r < RD; r++) {
                let d = dim0 + NDB * r;
                if (d < HD) {
                    out[base + d] = acc[i * RD + r] * inv;
                }
            }
        }
    }
}
