// Attention of query rows over two key/value segments (A then B), with an online softmax
// across both (flash-attention style). Bidirectional, or causal with an optional sliding
// window (p.causal, p.window): keys are numbered through A then B, and the row of unit u
// sits at key index p.query_start + u / p.group.
//
// A workgroup owns one kv head and 8 "query units"; a unit is a (query row, query head)
// pair of that kv head's GQA group, so grouped heads share every K/V read. Keys are walked
// in tiles of BK = 8 * WG, segment A's tiles first, then B's; the segment of a tile is the
// same for the whole workgroup, so no hot loop sits in divergent control flow.
//
// Both products are register-blocked 8 x 8: in phase 1 an invocation scores 8 keys against
// the 8 units, in phase 3 it accumulates 8 head dims of the 8 units; each value loaded
// feeds 8 FMAs. (Every load of every lane costs a bounds check, and on SIMD CPU
// implementations such as lavapipe a per-lane loop, so loads per FMA decide the speed.)
// The blocks are spelled out as named vec4 variables: private arrays indexed in loops
// become memory on such implementations.
//
// Per tile, two barriers:
//   phase 1: scores S = Q Kᵀ of keys 8 * lid + k -> ss
//   -- barrier --
//   phase 2: invocation u < 8: running max, probabilities -> ps, rescale factor -> alpha
//   -- barrier --
//   phase 3: O = O * alpha + P V for dims 8 * lid + r
// Phase 3 writes no workgroup memory, and what it reads is next written in phase 2 of the
// next tile, after that tile's first barrier; so no third barrier is needed.
//
// Scores are in the log2 domain (Q is pre-scaled by log2(e) times the scale) so exp2 can
// be used.
// Masks: a key tile no unit of the workgroup sees is skipped; one every unit sees whole
// (always, without a causal mask) is scored as before; only tiles across a mask boundary
// test each (key, unit). A masked score is MASKED, below the running max's floor NEG, so
// its probability is exactly 0 even while a unit has seen no visible key.
// Layouts, units in two groups of four (g): qs[d * 2 + g], ss / ps[j * 2 + g].
// A batch runs one dispatch per sequence: row0 offsets the query and output rows, and
// a_row0 / b_row0 the key rows of each segment within its buffer.
// Specialisation: HD (head dim, 1..=128), WG (>= 8 and >= HD / 8), VEC4 (HD % 4 == 0:
// K and V rows are read four dims per load), KV_PACKED (with VEC4: K/V stored as f16, four
// per vec2<u32>, unpacked as they are loaded; no shader-f16 needed).
// Workgroup memory: 8 * (HD + 2 * BK + 2) floats.

struct Params {
    units: u32,        // m * group
    group: u32,        // n_heads / n_kv_heads
    q_stride: u32,
    q_col: u32,
    len_a: u32,
    len_b: u32,
    kv_stride: u32,    // n_kv_heads * HD
    out_stride: u32,   // n_heads * HD
    unit_blocks: u32,  // ceil(units / 8)
    n_kv_heads: u32,
    scale_log2: f32,   // log2(e) / sqrt(HD)
    row0: u32,         // first query row of q and out (one sequence of a batch)
    b_row0: u32,       // first key row of segment B in kb / vb
    a_row0: u32,       // first key row of segment A in ka / va
    causal: u32,       // 1: a row sees keys up to its own index (and the window)
    window: u32,       // with causal: keys a row sees, its own included; 0 = no window
    query_start: u32,  // key index of query row 0
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
//#if VEC4
//#if KV_PACKED
@group(0) @binding(2) var<storage, read> ka: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read> va: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read> kb: array<vec2<u32>>;
@group(0) @binding(5) var<storage, read> vb: array<vec2<u32>>;

fn unpack4(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
fn ka4(i: u32) -> vec4<f32> { return unpack4(ka[i]); }
fn va4(i: u32) -> vec4<f32> { return unpack4(va[i]); }
fn kb4(i: u32) -> vec4<f32> { return unpack4(kb[i]); }
fn vb4(i: u32) -> vec4<f32> { return unpack4(vb[i]); }
//#else
@group(0) @binding(2) var<storage, read> ka: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> va: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> kb: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> vb: array<vec4<f32>>;

fn ka4(i: u32) -> vec4<f32> { return ka[i]; }
fn va4(i: u32) -> vec4<f32> { return va[i]; }
fn kb4(i: u32) -> vec4<f32> { return kb[i]; }
fn vb4(i: u32) -> vec4<f32> { return vb[i]; }
//#endif
//#else
@group(0) @binding(2) var<storage, read> ka: array<f32>;
@group(0) @binding(3) var<storage, read> va: array<f32>;
@group(0) @binding(4) var<storage, read> kb: array<f32>;
@group(0) @binding(5) var<storage, read> vb: array<f32>;
//#endif
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const HD: u32 = {{HD}}u;
const WG: u32 = {{WG}}u;
const BQ: u32 = 8u;
const BK: u32 = 8u * WG;
// Finite "minus infinity": WGSL has no infinity literal, and exp2 of it is exactly 0.
const NEG: f32 = -1.0e30;
// A masked score (or a key past its segment): exp2(MASKED - m) is 0 for any max m >= NEG.
const MASKED: f32 = -2.0e30;

var<workgroup> qs: array<vec4<f32>, {{QS_LEN}}>;
var<workgroup> ss: array<vec4<f32>, {{PS_LEN}}>;
var<workgroup> ps: array<vec4<f32>, {{PS_LEN}}>;
var<workgroup> alpha: array<vec4<f32>, 2>;
var<workgroup> total: array<vec4<f32>, 2>;

// Row offset of unit u's head in a [rows, stride] matrix at column col.
fn unit_offset(u: u32, kvh: u32, stride: u32, col: u32) -> u32 {
    let row = p.row0 + u / p.group;
    let head = kvh * p.group + u % p.group;
    return row * stride + col + head * HD;
}

// Which of four units, whose rows see keys lo ..= hi (per unit), see key `key`; none if the
// key is past its segment (`in_seg` false).
fn sees4(key: u32, lo: vec4<u32>, hi: vec4<u32>, in_seg: bool) -> vec4<bool> {
    let k = vec4<u32>(key);
    return (k >= lo) & (k <= hi) & vec4<bool>(in_seg);
}

// Writes dims d0..d0+7 (those below HD) of unit u0 + ui, if that unit exists.
fn store_unit(u0: u32, ui: u32, kvh: u32, d0: u32, lo: vec4<f32>, hi: vec4<f32>) {
    let u = u0 + ui;
    if (u >= p.units) {
        return;
    }
    let base = unit_offset(u, kvh, p.out_stride, 0u) + d0;
    let inv = 1.0 / total[ui / 4u][ui % 4u];
    for (var r = 0u; r < 4u; r++) {
        if (d0 + r < HD) {
            out[base + r] = lo[r] * inv;
        }
        if (d0 + 4u + r < HD) {
            out[base + 4u + r] = hi[r] * inv;
        }
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

    for (var i = lid; i < BQ * HD; i += WG) {
        let ui = i / HD;
        let d = i % HD;
        var x = 0.0;
        if (u0 + ui < p.units) {
            x = q[unit_offset(u0 + ui, kvh, p.q_stride, p.q_col) + d] * p.scale_log2;
        }
        qs[d * 2u + ui / 4u][ui % 4u] = x;
    }
    workgroupBarrier();

    // Phase 3 ownership: dims 8 * lid + r; past the head they read its last columns and
    // are not stored. o<u>a / o<u>b hold the low / high four of those dims of unit u.
    let d0 = 8u * lid;
//#if VEC4
    let dlo = kv_col + min(d0, HD - 4u);
    let dhi = kv_col + min(d0 + 4u, HD - 4u);
//#else
    let dlo = vec4<u32>(kv_col) + min(vec4<u32>(d0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(HD - 1u));
    let dhi = vec4<u32>(kv_col) + min(vec4<u32>(d0) + vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(HD - 1u));
//#endif
    var o0a = vec4<f32>(0.0);
    var o0b = vec4<f32>(0.0);
    var o1a = vec4<f32>(0.0);
    var o1b = vec4<f32>(0.0);
    var o2a = vec4<f32>(0.0);
    var o2b = vec4<f32>(0.0);
    var o3a = vec4<f32>(0.0);
    var o3b = vec4<f32>(0.0);
    var o4a = vec4<f32>(0.0);
    var o4b = vec4<f32>(0.0);
    var o5a = vec4<f32>(0.0);
    var o5b = vec4<f32>(0.0);
    var o6a = vec4<f32>(0.0);
    var o6b = vec4<f32>(0.0);
    var o7a = vec4<f32>(0.0);
    var o7b = vec4<f32>(0.0);
    // Phase 2 state of unit lid (lid < 8).
    var run_max = NEG;
    var run_sum = 0.0;

    // Masks, in key indices (A then B). Units 4g..4g+3 see keys lo_g ..= hi_g; any unit of
    // the workgroup sees keys in lo ..= hi, every one of them those in all_lo ..= all_hi
    // (every key without a causal mask). Lets of uniform values only: the tile loop's
    // skip below sits before barriers.
    let causal = p.causal != 0u;
    let windowed = causal && p.window != 0u;
    let pos_first = p.query_start + u0 / p.group;
    let pos_last = p.query_start + (min(u0 + BQ, p.units) - 1u) / p.group;
    let lo = select(0u, max(pos_first + 1u, p.window) - p.window, windowed);
    let all_lo = select(0u, max(pos_last + 1u, p.window) - p.window, windowed);
    let hi = select(0xffffffffu, pos_last, causal);
    let all_hi = select(0xffffffffu, pos_first, causal);
    let units_lo = vec4<u32>(u0) + vec4<u32>(0u, 1u, 2u, 3u);
    let win = vec4<u32>(p.window);
    let hi_0 = vec4<u32>(p.query_start) + units_lo / vec4<u32>(p.group);
    let hi_1 = vec4<u32>(p.query_start) + (units_lo + vec4<u32>(4u)) / vec4<u32>(p.group);
    let lo_0 = select(vec4<u32>(0u), max(hi_0 + vec4<u32>(1u), win) - win, windowed);
    let lo_1 = select(vec4<u32>(0u), max(hi_1 + vec4<u32>(1u), win) - win, windowed);

    let tiles_a = (p.len_a + BK - 1u) / BK;
    let n_tiles = tiles_a + (p.len_b + BK - 1u) / BK;
    for (var t = 0u; t < n_tiles; t++) {
        let in_a = t < tiles_a;
        let t0 = select(t - tiles_a, t, in_a) * BK;
        let seg_len = select(p.len_b, p.len_a, in_a);
        // First buffer row of the segment: B may start inside a larger (batched) arena.
        let seg_row0 = select(p.b_row0, p.a_row0, in_a);
        // Key index of the tile's first key, and of its last.
        let k_first = select(p.len_a, 0u, in_a) + t0;
        let k_last = k_first + min(BK, seg_len - t0) - 1u;
        if (k_first > hi || k_last < lo) {
            continue;
        }
        let whole = k_first >= all_lo && k_last <= all_hi;

        // Phase 1: keys key0 + k; past the segment they read its last row and are masked.
        // s<k><g>: key k, units 4g..4g+3.
        let key0 = t0 + 8u * lid;
        let last = vec4<u32>(seg_len - 1u);
        let row0 = vec4<u32>(seg_row0);
        let rlo = (row0 + min(vec4<u32>(key0) + vec4<u32>(0u, 1u, 2u, 3u), last)) * p.kv_stride + vec4<u32>(kv_col);
        let rhi = (row0 + min(vec4<u32>(key0) + vec4<u32>(4u, 5u, 6u, 7u), last)) * p.kv_stride + vec4<u32>(kv_col);
        var s00 = vec4<f32>(0.0);
        var s01 = vec4<f32>(0.0);
        var s10 = vec4<f32>(0.0);
        var s11 = vec4<f32>(0.0);
        var s20 = vec4<f32>(0.0);
        var s21 = vec4<f32>(0.0);
        var s30 = vec4<f32>(0.0);
        var s31 = vec4<f32>(0.0);
        var s40 = vec4<f32>(0.0);
        var s41 = vec4<f32>(0.0);
        var s50 = vec4<f32>(0.0);
        var s51 = vec4<f32>(0.0);
        var s60 = vec4<f32>(0.0);
        var s61 = vec4<f32>(0.0);
        var s70 = vec4<f32>(0.0);
        var s71 = vec4<f32>(0.0);
//#if VEC4
        let rlo4 = rlo / 4u;
        let rhi4 = rhi / 4u;
        for (var d = 0u; d < HD; d += 4u) {
            // Dims d..d+3 of the eight keys, then one dim of all of them at a time.
            let d4 = d / 4u;
            var k0: vec4<f32>;
            var k1: vec4<f32>;
            var k2: vec4<f32>;
            var k3: vec4<f32>;
            var k4: vec4<f32>;
            var k5: vec4<f32>;
            var k6: vec4<f32>;
            var k7: vec4<f32>;
            if (in_a) {
                k0 = ka4(rlo4.x + d4);
                k1 = ka4(rlo4.y + d4);
                k2 = ka4(rlo4.z + d4);
                k3 = ka4(rlo4.w + d4);
                k4 = ka4(rhi4.x + d4);
                k5 = ka4(rhi4.y + d4);
                k6 = ka4(rhi4.z + d4);
                k7 = ka4(rhi4.w + d4);
            } else {
                k0 = kb4(rlo4.x + d4);
                k1 = kb4(rlo4.y + d4);
                k2 = kb4(rlo4.z + d4);
                k3 = kb4(rlo4.w + d4);
                k4 = kb4(rhi4.x + d4);
                k5 = kb4(rhi4.y + d4);
                k6 = kb4(rhi4.z + d4);
                k7 = kb4(rhi4.w + d4);
            }
            var q0: vec4<f32>;
            var q1: vec4<f32>;
            let c0lo = vec4<f32>(k0.x, k1.x, k2.x, k3.x);
            let c0hi = vec4<f32>(k4.x, k5.x, k6.x, k7.x);
            q0 = qs[2u * d + 0u];
            q1 = qs[2u * d + 1u];
            s00 += q0 * c0lo.x;
            s01 += q1 * c0lo.x;
            s10 += q0 * c0lo.y;
            s11 += q1 * c0lo.y;
            s20 += q0 * c0lo.z;
            s21 += q1 * c0lo.z;
            s30 += q0 * c0lo.w;
            s31 += q1 * c0lo.w;
            s40 += q0 * c0hi.x;
            s41 += q1 * c0hi.x;
            s50 += q0 * c0hi.y;
            s51 += q1 * c0hi.y;
            s60 += q0 * c0hi.z;
            s61 += q1 * c0hi.z;
            s70 += q0 * c0hi.w;
            s71 += q1 * c0hi.w;
            let c1lo = vec4<f32>(k0.y, k1.y, k2.y, k3.y);
            let c1hi = vec4<f32>(k4.y, k5.y, k6.y, k7.y);
            q0 = qs[2u * d + 2u];
            q1 = qs[2u * d + 3u];
            s00 += q0 * c1lo.x;
            s01 += q1 * c1lo.x;
            s10 += q0 * c1lo.y;
            s11 += q1 * c1lo.y;
            s20 += q0 * c1lo.z;
            s21 += q1 * c1lo.z;
            s30 += q0 * c1lo.w;
            s31 += q1 * c1lo.w;
            s40 += q0 * c1hi.x;
            s41 += q1 * c1hi.x;
            s50 += q0 * c1hi.y;
            s51 += q1 * c1hi.y;
            s60 += q0 * c1hi.z;
            s61 += q1 * c1hi.z;
            s70 += q0 * c1hi.w;
            s71 += q1 * c1hi.w;
            let c2lo = vec4<f32>(k0.z, k1.z, k2.z, k3.z);
            let c2hi = vec4<f32>(k4.z, k5.z, k6.z, k7.z);
            q0 = qs[2u * d + 4u];
            q1 = qs[2u * d + 5u];
            s00 += q0 * c2lo.x;
            s01 += q1 * c2lo.x;
            s10 += q0 * c2lo.y;
            s11 += q1 * c2lo.y;
            s20 += q0 * c2lo.z;
            s21 += q1 * c2lo.z;
            s30 += q0 * c2lo.w;
            s31 += q1 * c2lo.w;
            s40 += q0 * c2hi.x;
            s41 += q1 * c2hi.x;
            s50 += q0 * c2hi.y;
            s51 += q1 * c2hi.y;
            s60 += q0 * c2hi.z;
            s61 += q1 * c2hi.z;
            s70 += q0 * c2hi.w;
            s71 += q1 * c2hi.w;
            let c3lo = vec4<f32>(k0.w, k1.w, k2.w, k3.w);
            let c3hi = vec4<f32>(k4.w, k5.w, k6.w, k7.w);
            q0 = qs[2u * d + 6u];
            q1 = qs[2u * d + 7u];
            s00 += q0 * c3lo.x;
            s01 += q1 * c3lo.x;
            s10 += q0 * c3lo.y;
            s11 += q1 * c3lo.y;
            s20 += q0 * c3lo.z;
            s21 += q1 * c3lo.z;
            s30 += q0 * c3lo.w;
            s31 += q1 * c3lo.w;
            s40 += q0 * c3hi.x;
            s41 += q1 * c3hi.x;
            s50 += q0 * c3hi.y;
            s51 += q1 * c3hi.y;
            s60 += q0 * c3hi.z;
            s61 += q1 * c3hi.z;
            s70 += q0 * c3hi.w;
            s71 += q1 * c3hi.w;
        }
//#else
        for (var d = 0u; d < HD; d++) {
            var klo: vec4<f32>;
            var khi: vec4<f32>;
            if (in_a) {
                klo = vec4<f32>(ka[rlo.x + d], ka[rlo.y + d], ka[rlo.z + d], ka[rlo.w + d]);
                khi = vec4<f32>(ka[rhi.x + d], ka[rhi.y + d], ka[rhi.z + d], ka[rhi.w + d]);
            } else {
                klo = vec4<f32>(kb[rlo.x + d], kb[rlo.y + d], kb[rlo.z + d], kb[rlo.w + d]);
                khi = vec4<f32>(kb[rhi.x + d], kb[rhi.y + d], kb[rhi.z + d], kb[rhi.w + d]);
            }
            var q0: vec4<f32>;
            var q1: vec4<f32>;
            q0 = qs[2u * d + 0u];
            q1 = qs[2u * d + 1u];
            s00 += q0 * klo.x;
            s01 += q1 * klo.x;
            s10 += q0 * klo.y;
            s11 += q1 * klo.y;
            s20 += q0 * klo.z;
            s21 += q1 * klo.z;
            s30 += q0 * klo.w;
            s31 += q1 * klo.w;
            s40 += q0 * khi.x;
            s41 += q1 * khi.x;
            s50 += q0 * khi.y;
            s51 += q1 * khi.y;
            s60 += q0 * khi.z;
            s61 += q1 * khi.z;
            s70 += q0 * khi.w;
            s71 += q1 * khi.w;
        }
//#endif
        let neg = vec4<f32>(MASKED);
        let j0 = 16u * lid;
        if (whole) {
            ss[j0 + 0u] = select(neg, s00, key0 + 0u < seg_len);
            ss[j0 + 1u] = select(neg, s01, key0 + 0u < seg_len);
            ss[j0 + 2u] = select(neg, s10, key0 + 1u < seg_len);
            ss[j0 + 3u] = select(neg, s11, key0 + 1u < seg_len);
            ss[j0 + 4u] = select(neg, s20, key0 + 2u < seg_len);
            ss[j0 + 5u] = select(neg, s21, key0 + 2u < seg_len);
            ss[j0 + 6u] = select(neg, s30, key0 + 3u < seg_len);
            ss[j0 + 7u] = select(neg, s31, key0 + 3u < seg_len);
            ss[j0 + 8u] = select(neg, s40, key0 + 4u < seg_len);
            ss[j0 + 9u] = select(neg, s41, key0 + 4u < seg_len);
            ss[j0 + 10u] = select(neg, s50, key0 + 5u < seg_len);
            ss[j0 + 11u] = select(neg, s51, key0 + 5u < seg_len);
            ss[j0 + 12u] = select(neg, s60, key0 + 6u < seg_len);
            ss[j0 + 13u] = select(neg, s61, key0 + 6u < seg_len);
            ss[j0 + 14u] = select(neg, s70, key0 + 7u < seg_len);
            ss[j0 + 15u] = select(neg, s71, key0 + 7u < seg_len);
        } else {
            // Key key0 + k of the segment is key index kk + k.
            let kk = k_first + 8u * lid;
            ss[j0 + 0u] = select(neg, s00, sees4(kk + 0u, lo_0, hi_0, key0 + 0u < seg_len));
            ss[j0 + 1u] = select(neg, s01, sees4(kk + 0u, lo_1, hi_1, key0 + 0u < seg_len));
            ss[j0 + 2u] = select(neg, s10, sees4(kk + 1u, lo_0, hi_0, key0 + 1u < seg_len));
            ss[j0 + 3u] = select(neg, s11, sees4(kk + 1u, lo_1, hi_1, key0 + 1u < seg_len));
            ss[j0 + 4u] = select(neg, s20, sees4(kk + 2u, lo_0, hi_0, key0 + 2u < seg_len));
            ss[j0 + 5u] = select(neg, s21, sees4(kk + 2u, lo_1, hi_1, key0 + 2u < seg_len));
            ss[j0 + 6u] = select(neg, s30, sees4(kk + 3u, lo_0, hi_0, key0 + 3u < seg_len));
            ss[j0 + 7u] = select(neg, s31, sees4(kk + 3u, lo_1, hi_1, key0 + 3u < seg_len));
            ss[j0 + 8u] = select(neg, s40, sees4(kk + 4u, lo_0, hi_0, key0 + 4u < seg_len));
            ss[j0 + 9u] = select(neg, s41, sees4(kk + 4u, lo_1, hi_1, key0 + 4u < seg_len));
            ss[j0 + 10u] = select(neg, s50, sees4(kk + 5u, lo_0, hi_0, key0 + 5u < seg_len));
            ss[j0 + 11u] = select(neg, s51, sees4(kk + 5u, lo_1, hi_1, key0 + 5u < seg_len));
            ss[j0 + 12u] = select(neg, s60, sees4(kk + 6u, lo_0, hi_0, key0 + 6u < seg_len));
            ss[j0 + 13u] = select(neg, s61, sees4(kk + 6u, lo_1, hi_1, key0 + 6u < seg_len));
            ss[j0 + 14u] = select(neg, s70, sees4(kk + 7u, lo_0, hi_0, key0 + 7u < seg_len));
            ss[j0 + 15u] = select(neg, s71, sees4(kk + 7u, lo_1, hi_1, key0 + 7u < seg_len));
        }
        workgroupBarrier();

        // Phase 2: probabilities of unit lid against its updated running max.
        if (lid < BQ) {
            let g = lid / 4u;
            let c = lid % 4u;
            var mx = run_max;
            for (var j = 0u; j < BK; j++) {
                mx = max(mx, ss[2u * j + g][c]);
            }
            var sum = 0.0;
            for (var j = 0u; j < BK; j++) {
                let pj = exp2(ss[2u * j + g][c] - mx);
                ps[2u * j + g][c] = pj;
                sum += pj;
            }
            let a = exp2(run_max - mx);
            alpha[g][c] = a;
            run_sum = run_sum * a + sum;
            run_max = mx;
        }
        workgroupBarrier();

        // Phase 3: rescale, then accumulate P V over the keys of this tile.
        let a0 = alpha[0];
        let a1 = alpha[1];
        o0a *= a0.x;
        o0b *= a0.x;
        o1a *= a0.y;
        o1b *= a0.y;
        o2a *= a0.z;
        o2b *= a0.z;
        o3a *= a0.w;
        o3b *= a0.w;
        o4a *= a1.x;
        o4b *= a1.x;
        o5a *= a1.y;
        o5b *= a1.y;
        o6a *= a1.z;
        o6b *= a1.z;
        o7a *= a1.w;
        o7b *= a1.w;
        let keys_here = min(BK, seg_len - t0);
        for (var j = 0u; j < keys_here; j++) {
            let vrow = (seg_row0 + t0 + j) * p.kv_stride;
            var vlo: vec4<f32>;
            var vhi: vec4<f32>;
//#if VEC4
            if (in_a) {
                vlo = va4((vrow + dlo) / 4u);
                vhi = va4((vrow + dhi) / 4u);
            } else {
                vlo = vb4((vrow + dlo) / 4u);
                vhi = vb4((vrow + dhi) / 4u);
            }
//#else
            let rl = vec4<u32>(vrow) + dlo;
            let rh = vec4<u32>(vrow) + dhi;
            if (in_a) {
                vlo = vec4<f32>(va[rl.x], va[rl.y], va[rl.z], va[rl.w]);
                vhi = vec4<f32>(va[rh.x], va[rh.y], va[rh.z], va[rh.w]);
            } else {
                vlo = vec4<f32>(vb[rl.x], vb[rl.y], vb[rl.z], vb[rl.w]);
                vhi = vec4<f32>(vb[rh.x], vb[rh.y], vb[rh.z], vb[rh.w]);
            }
//#endif
            let p0 = ps[2u * j];
            let p1 = ps[2u * j + 1u];
            o0a += p0.x * vlo;
            o0b += p0.x * vhi;
            o1a += p0.y * vlo;
            o1b += p0.y * vhi;
            o2a += p0.z * vlo;
            o2b += p0.z * vhi;
            o3a += p0.w * vlo;
            o3b += p0.w * vhi;
            o4a += p1.x * vlo;
            o4b += p1.x * vhi;
            o5a += p1.y * vlo;
            o5b += p1.y * vhi;
            o6a += p1.z * vlo;
            o6b += p1.z * vhi;
            o7a += p1.w * vlo;
            o7b += p1.w * vhi;
        }
    }

    if (lid < BQ) {
        total[lid / 4u][lid % 4u] = run_sum;
    }
    workgroupBarrier();
    if (d0 < HD) {
        store_unit(u0, 0u, kvh, d0, o0a, o0b);
        store_unit(u0, 1u, kvh, d0, o1a, o1b);
        store_unit(u0, 2u, kvh, d0, o2a, o2b);
        store_unit(u0, 3u, kvh, d0, o3a, o3b);
        store_unit(u0, 4u, kvh, d0, o4a, o4b);
        store_unit(u0, 5u, kvh, d0, o5a, o5b);
        store_unit(u0, 6u, kvh, d0, o6a, o6b);
        store_unit(u0, 7u, kvh, d0, o7a, o7b);
    }
}
