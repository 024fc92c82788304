// Bidirectional attention of query rows over two key/value segments (A then B), with an
// online softmax across both (flash-attention style).
//
// A workgroup owns one kv head and BQ "query units"; a unit is a (query row, query head)
// pair of that kv head's GQA group, so grouped heads share every K/V read. Keys are walked
// in tiles of BK = WG * RK, segment A's tiles first, then B's; the segment of a tile is the
// same for the whole workgroup, so no hot loop sits in divergent control flow.
//
// Invocations map to keys (scores: RK keys each) and to head dims (P·V: RD dims each); the
// loops over query units are the same for every invocation, so Q and P come from workgroup
// memory as broadcast vec4 reads (four units each), while every K and V element is read
// once per workgroup and feeds BQ FMAs. Per tile, two barriers:
//   phase 1: scores S = Q Kᵀ of keys lid * RK + k -> ss
//   -- barrier --
//   phase 2: invocation u < BQ: running max, probabilities -> ps, rescale factor -> alpha
//   -- barrier --
//   phase 3: O = O * alpha + P V for dims lid * RD + r
// Phase 3 writes no workgroup memory, and what it reads is next written in phase 2 of the
// next tile, after that tile's first barrier; so no third barrier is needed.
//
// Scores are in the log2 domain (Q is pre-scaled by log2(e)/sqrt(HD)) so exp2 can be used.
// Layouts, with units in groups of four (g): qs[d * BQ4 + g], ss / ps[j * BQ4 + g].
// Workgroup memory: (HD + 2 * BK + 2) * BQ floats.

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
const BQ4: u32 = BQ / 4u;
const WG: u32 = {{WG}}u;
const RK: u32 = {{RK}}u;
const BK: u32 = WG * RK;
const RD: u32 = (HD + WG - 1u) / WG;
// Finite "minus infinity": WGSL has no infinity literal, and exp2 of it is exactly 0.
const NEG: f32 = -1.0e30;

var<workgroup> qs: array<vec4<f32>, {{QS_LEN}}>;
var<workgroup> ss: array<vec4<f32>, {{PS_LEN}}>;
var<workgroup> ps: array<vec4<f32>, {{PS_LEN}}>;
var<workgroup> alpha: array<vec4<f32>, BQ4>;
var<workgroup> total: array<vec4<f32>, BQ4>;

// Row offset of unit u's head in a [rows, stride] matrix at column col.
fn unit_offset(u: u32, kvh: u32, stride: u32, col: u32) -> u32 {
    let row = u / p.group;
    let head = kvh * p.group + u % p.group;
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

    for (var i = lid; i < BQ * HD; i += WG) {
        let ui = i / HD;
        let d = i % HD;
        var x = 0.0;
        if (u0 + ui < p.units) {
            x = q[unit_offset(u0 + ui, kvh, p.q_stride, p.q_col) + d] * p.scale_log2;
        }
        qs[d * BQ4 + ui / 4u][ui % 4u] = x;
    }
    workgroupBarrier();

    // Phase 3 ownership (dims past the head read its last column and are not stored) and
    // accumulators acc[r * BQ4 + g].
    var dcol: array<u32, RD>;
    for (var r = 0u; r < RD; r++) {
        dcol[r] = kv_col + min(lid * RD + r, HD - 1u);
    }
    var acc: array<vec4<f32>, {{ACC_LEN}}>;
    for (var x = 0u; x < RD * BQ4; x++) {
        acc[x] = vec4<f32>(0.0);
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
        let key0 = t0 + lid * RK;
        var kbase: array<u32, RK>;
        for (var k = 0u; k < RK; k++) {
            kbase[k] = min(key0 + k, seg_len - 1u) * p.kv_stride + kv_col;
        }
        var s: array<vec4<f32>, {{S_LEN}}>;
        for (var x = 0u; x < RK * BQ4; x++) {
            s[x] = vec4<f32>(0.0);
        }
        var kv: array<f32, RK>;
        if (in_a) {
            for (var d = 0u; d < HD; d++) {
                for (var k = 0u; k < RK; k++) {
                    kv[k] = ka[kbase[k] + d];
                }
                for (var g = 0u; g < BQ4; g++) {
                    let qg = qs[d * BQ4 + g];
                    for (var k = 0u; k < RK; k++) {
                        s[k * BQ4 + g] += qg * kv[k];
                    }
                }
            }
        } else {
            for (var d = 0u; d < HD; d++) {
                for (var k = 0u; k < RK; k++) {
                    kv[k] = kb[kbase[k] + d];
                }
                for (var g = 0u; g < BQ4; g++) {
                    let qg = qs[d * BQ4 + g];
                    for (var k = 0u; k < RK; k++) {
                        s[k * BQ4 + g] += qg * kv[k];
                    }
                }
            }
        }
        for (var k = 0u; k < RK; k++) {
            let valid = key0 + k < seg_len;
            for (var g = 0u; g < BQ4; g++) {
                ss[(lid * RK + k) * BQ4 + g] = select(vec4<f32>(NEG), s[k * BQ4 + g], valid);
            }
        }
        workgroupBarrier();

        // Phase 2: probabilities of unit lid against its updated running max.
        if (lid < BQ) {
            let g = lid / 4u;
            let c = lid % 4u;
            var mx = run_max;
            for (var j = 0u; j < BK; j++) {
                mx = max(mx, ss[j * BQ4 + g][c]);
            }
            var sum = 0.0;
            for (var j = 0u; j < BK; j++) {
                let pj = exp2(ss[j * BQ4 + g][c] - mx);
                ps[j * BQ4 + g][c] = pj;
                sum += pj;
            }
            let a = exp2(run_max - mx);
            alpha[g][c] = a;
            run_sum = run_sum * a + sum;
            run_max = mx;
        }
        workgroupBarrier();

        // Phase 3: rescale, then accumulate P V over the keys of this tile.
        for (var g = 0u; g < BQ4; g++) {
            let a = alpha[g];
            for (var r = 0u; r < RD; r++) {
                acc[r * BQ4 + g] *= a;
            }
        }
        let keys_here = min(BK, seg_len - t0);
        var vv: array<f32, RD>;
        if (in_a) {
            for (var j = 0u; j < keys_here; j++) {
                let vrow = (t0 + j) * p.kv_stride;
                for (var r = 0u; r < RD; r++) {
                    vv[r] = va[vrow + dcol[r]];
                }
                for (var g = 0u; g < BQ4; g++) {
                    let pg = ps[j * BQ4 + g];
                    for (var r = 0u; r < RD; r++) {
                        acc[r * BQ4 + g] += pg * vv[r];
                    }
                }
            }
        } else {
            for (var j = 0u; j < keys_here; j++) {
                let vrow = (t0 + j) * p.kv_stride;
                for (var r = 0u; r < RD; r++) {
                    vv[r] = vb[vrow + dcol[r]];
                }
                for (var g = 0u; g < BQ4; g++) {
                    let pg = ps[j * BQ4 + g];
                    for (var r = 0u; r < RD; r++) {
                        acc[r * BQ4 + g] += pg * vv[r];
                    }
                }
            }
        }
    }

    if (lid < BQ) {
        total[lid / 4u][lid % 4u] = run_sum;
    }
    workgroupBarrier();
    for (var r = 0u; r < RD; r++) {
        let d = lid * RD + r;
        if (d < HD) {
            for (var ui = 0u; ui < BQ; ui++) {
                if (u0 + ui < p.units) {
                    let g = ui / 4u;
                    let c = ui % 4u;
                    out[unit_offset(u0 + ui, kvh, p.out_stride, 0u) + d] = acc[r * BQ4 + g][c] / total[g][c];
                }
            }
        }
    }
}
