// Attention over two key/value segments (A then B) for hardware GPUs: a wide workgroup
// (WG = 128 invocations), K and V tiles staged through workgroup memory with coalesced
// loads, and optionally a split over keys (flash-decoding). Bidirectional, or causal with
// an optional sliding window (p.causal, p.window): keys are numbered through A then B, and
// the row of unit u sits at key index p.query_start + u / p.group.
//
// A workgroup owns one kv head, BQ query units (a unit is a (query row, query head) pair
// of that head's GQA group, so grouped heads share every K/V read) and, with SPLIT, one
// slice of the key tiles. Keys are walked in tiles of BK: segment A's tiles first, then
// B's; the segment of a tile is the same for the whole workgroup.
//
// Per tile:
//   stage K: invocation i loads the 4-element spans i, i + WG, ... of the [BK, HC]
//            tile, so consecutive invocations read consecutive addresses of a key row
//   -- barrier --
//   phase 1: scores of key lid % BK against units lid / BK + UB * r (one vec4 of K
//            from workgroup memory feeds 4 * R1 FMAs) -> ss
//   -- barrier --
//   stage V into the same tile memory; each unit's TPU invocations take the max of
//   their share of its scores -> red
//   -- barrier --
//   phase 2: row max, probabilities in place in ss, rescale factor -> alpha; each
//            invocation keeps a partial row sum of its own keys (summed once at the end)
//   -- barrier --
//   phase 3: O = O * alpha + P V: dim lid % HC of units lid / HC + (WG / HC) * r
//   -- barrier -- (the next tile overwrites the tile memory phase 3 reads)
//
// HD is the head-dim class (16, 32, 64, 128, 256 or 512); the real head dim p.hd may be
// smaller: dims past it are zero in q, K and V, and are not stored. Q and K/V are staged
// HC = min(HD, 128) dims at a time, NCH = HD / HC chunks: with one chunk Q is staged once
// for all tiles and the tile runs as above; with more, phase 1 sums the scores over the
// chunks (restaging Q's chunk with K's, a barrier before each) and phase 3 walks V chunk by
// chunk (staging the next after a barrier). The large classes so take the workgroup memory
// and tiles of HD = 128; only the accumulators (R3 per invocation) grow.
// K/V storage (one flag): KV_F32, KV_PACKED (f16 pairs in u32 words, no shader-f16
// needed) or F16 (native f16). Workgroup memory holds f32 either way. KV_VEC: the head dim
// is HD, so K/V are read four elements per load.
// Scores are in the log2 domain (q is pre-scaled by log2(e) times the scale) so exp2 can
// be used.
// Masks: a key tile no unit of the workgroup sees is skipped; one every unit sees whole
// (always, without a causal mask) is scored as before; only tiles across a mask boundary
// test each (key, unit). A masked score is MASKED, below the running max's floor NEG, so its
// probability is exactly 0 even while a unit has seen no visible key (a slice of a split
// may see none: its max stays NEG and its sum 0, which the combine pass weighs 0).
// SPLIT: instead of normalised rows, a slice writes its unnormalised output, running max
// and row sum per unit into `out` (the scratch of attention_combine.wgsl):
//   o:     [slices, n_kv_heads * units, HD] from 0
//   stats: [slices, n_kv_heads * units, 2] (max, sum) after the o part.

struct Params {
    units: u32,           // m * group
    group: u32,           // n_heads / n_kv_heads
    q_stride: u32,
    q_col: u32,
    len_a: u32,
    len_b: u32,
    kv_stride: u32,       // n_kv_heads * hd
    out_stride: u32,      // n_heads * hd
    unit_blocks: u32,     // ceil(units / BQ)
    n_kv_heads: u32,
    scale_log2: f32,      // log2(e) times the scale (default 1 / sqrt(hd))
    row0: u32,            // first query row of q and out (one sequence of a batch)
    b_row0: u32,          // first key row of segment B in kb / vb
    a_row0: u32,          // first key row of segment A in ka / va
    causal: u32,          // 1: a row sees keys up to its own index (and the window)
    window: u32,          // with causal: keys a row sees, its own included; 0 = no window
    query_start: u32,     // key index of query row 0
    slices: u32,          // 1 without SPLIT
    tiles_per_slice: u32, // key tiles per slice (all of them without SPLIT)
    hd: u32,              // real head dim, <= HD
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
// One load's worth of K/V: with KV_VEC (the head dim is the class HD, so every row is
// whole 4-element spans) four elements, else one (a u32 word holds two halves).
//#if KV_VEC
//#if KV_F32
alias KvWord = vec4<f32>;
//#endif
//#if KV_PACKED
alias KvWord = vec2<u32>;
//#endif
//#if F16
alias KvWord = vec4<f16>;
//#endif
//#else
//#if KV_F32
alias KvWord = f32;
//#endif
//#if KV_PACKED
alias KvWord = u32;
//#endif
//#if F16
alias KvWord = f16;
//#endif
//#endif
@group(0) @binding(2) var<storage, read> ka: array<KvWord>;
@group(0) @binding(3) var<storage, read> va: array<KvWord>;
@group(0) @binding(4) var<storage, read> kb: array<KvWord>;
@group(0) @binding(5) var<storage, read> vb: array<KvWord>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

//#if !COOP
const HD: u32 = {{HD}}u;
const HC: u32 = {{HC}}u;    // head dims staged at once
const NCH: u32 = HD / HC;   // chunks of a head
const H4: u32 = HC / 4u;    // vec4s per staged row
// Tile row pitch in vec4s: one vec4 of padding, so the 16-byte reads of 8 consecutive
// keys (phase 1) start 4 banks apart and cover all 32 banks without conflict.
const P4: u32 = H4 + 1u;
const WG: u32 = {{WG}}u;
const BQ: u32 = {{BQ}}u;
const BK: u32 = {{BK}}u;
const UB: u32 = WG / BK;   // phase 1: unit stride between an invocation's scores
const R1: u32 = BQ * BK / WG;
const TPU: u32 = WG / BQ;  // phase 2: invocations per unit
const DU: u32 = WG / HC;   // phase 3: unit stride between an invocation's outputs
const R3C: u32 = BQ * HC / WG; // phase 3: outputs per invocation and chunk
const R3: u32 = NCH * R3C; // [chunk, unit] of an invocation's outputs
// Finite "minus infinity": WGSL has no infinity literal, and exp2 of it is exactly 0.
const NEG: f32 = -1.0e30;
// A masked score (or a key past its segment): exp2(MASKED - m) is 0 for any max m >= NEG.
const MASKED: f32 = -2.0e30;

// vec4s: phase 1 reads four dims per load (one load feeds 4 * R1 FMAs).
var<workgroup> qs: array<vec4<f32>, {{QS_LEN}}>;   // [BQ, H4], one chunk of Q
var<workgroup> kvs: array<vec4<f32>, {{KV_LEN}}>;  // [BK, P4], K then V of the tile
// [BQ, BK] scores, then probabilities; vec4s of 4 keys, so phase 3 reads four
// probabilities of a unit per load.
var<workgroup> ss: array<vec4<f32>, {{SS_LEN}}>;
var<workgroup> red: array<f32, WG>;          // [BQ, TPU] partial maxima, then sums
var<workgroup> alpha: array<f32, BQ>;

//#endif

// Word j of segment A's or B's keys (`values`: of its values). Branches, not `select`:
// select evaluates (loads) both operands.
fn load_word(in_a: bool, values: bool, j: u32) -> KvWord {
    var x: KvWord;
    if (in_a) {
        if (values) {
            x = va[j];
        } else {
            x = ka[j];
        }
    } else {
        if (values) {
            x = vb[j];
        } else {
            x = kb[j];
        }
    }
    return x;
}

//#if KV_VEC
// Elements 4 * i4 .. 4 * i4 + 3, as f32.
fn load_kv4(in_a: bool, values: bool, i4: u32) -> vec4<f32> {
    let w = load_word(in_a, values, i4);
//#if KV_PACKED
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
//#else
    return vec4<f32>(w);
//#endif
}
//#else
// Element i, as f32.
fn load_kv(in_a: bool, values: bool, i: u32) -> f32 {
//#if KV_PACKED
    return unpack2x16float(load_word(in_a, values, i >> 1u))[i & 1u];
//#else
    return f32(load_word(in_a, values, i));
//#endif
}
//#endif

// Elements d .. d + 3 of key (or value) `j` of a tile starting at buffer row `row`, as
// f32: zero for j past `keys` and for dims past p.hd.
fn kv_quad(in_a: bool, values: bool, row: u32, j: u32, keys: u32, kv_col: u32, d: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    if (j < keys) {
        let base = (row + j) * p.kv_stride + kv_col + d;
//#if KV_VEC
        x = load_kv4(in_a, values, base / 4u);
//#else
        for (var c = 0u; c < 4u; c++) {
            if (d + c < p.hd) {
                x[c] = load_kv(in_a, values, base + c);
            }
        }
//#endif
    }
    return x;
}

// Index of element 0 of query unit u (of kv head kvh) in q, and in out.
fn q_at(u: u32, kvh: u32) -> u32 {
    return (p.row0 + u / p.group) * p.q_stride + p.q_col + (kvh * p.group + u % p.group) * p.hd;
}

fn out_at(u: u32, kvh: u32) -> u32 {
    return (p.row0 + u / p.group) * p.out_stride + (kvh * p.group + u % p.group) * p.hd;
}

// Whether the row of query unit u sees key `key` (an index into A ++ B).
fn sees(u: u32, key: u32) -> bool {
    let pos = p.query_start + u / p.group;
    return p.causal == 0u || (key <= pos && (p.window == 0u || pos - key < p.window));
}

//#if !COOP
// Stages dims d0 .. d0 + HC of the [BK, HD] tile of keys (or values) starting at buffer row
// `row` into kvs; rows past `keys` and dims past p.hd are zero. Invocation i takes the
// vec4s i, i + WG, ... of the tile, so consecutive invocations read consecutive 16-byte
// spans of a row.
fn stage(lid: u32, in_a: bool, values: bool, row: u32, keys: u32, kv_col: u32, d0: u32) {
    for (var i = lid; i < BK * H4; i += WG) {
        let j = i / H4;
        kvs[j * P4 + i % H4] = kv_quad(in_a, values, row, j, keys, kv_col, d0 + (i % H4) * 4u);
    }
}

// Stages dims d0 .. d0 + HC of the workgroup's query units into qs, in the log2 domain;
// units past p.units and dims past p.hd are zero.
fn stage_q(lid: u32, u0: u32, kvh: u32, d0: u32) {
    for (var i = lid; i < BQ * H4; i += WG) {
        let ui = i / H4;
        let d = d0 + (i % H4) * 4u;
        var x = vec4<f32>(0.0);
        let u = u0 + ui;
        if (u < p.units) {
            let base = q_at(u, kvh) + d;
            for (var c = 0u; c < 4u; c++) {
                if (d + c < p.hd) {
                    x[c] = q[base + c] * p.scale_log2;
                }
            }
        }
        qs[i] = x;
    }
}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let gid = wid.x + wid.y * nwg.x;
    // Unit blocks innermost: consecutive workgroups read the same keys, which stay in cache.
    let ublock = gid % p.unit_blocks;
    let rest = gid / p.unit_blocks;
    let slice = rest % p.slices;
    let kvh = rest / p.slices;
    if (kvh >= p.n_kv_heads) {
        return;
    }
    let u0 = ublock * BQ;
    let kv_col = kvh * p.hd;
    if (NCH == 1u) {
        stage_q(lid, u0, kvh, 0u);
    }

    let kk = lid % BK;        // phase 1 key
    let ub1 = lid / BK;       // phase 1 first unit
    let u2 = lid / TPU;       // phase 2 unit
    let l2 = lid % TPU;       // phase 2 share of that unit's keys
    let d3 = lid % HC;        // phase 3 dim (of each chunk)
    let ub3 = lid / HC;       // phase 3 first unit
    var acc: array<f32, R3>;
    var run_max = NEG;        // of unit u2, the same in all its TPU invocations
    var run_sum = 0.0;        // of unit u2, over this invocation's keys only

    // Masks, in key indices (A then B): any unit of the workgroup sees keys in lo ..= hi,
    // every one of them those in all_lo ..= all_hi (every key without a causal mask). Lets
    // of uniform values only: the tile loop's skip below sits before barriers.
    let causal = p.causal != 0u;
    let windowed = causal && p.window != 0u;
    let pos_first = p.query_start + u0 / p.group;
    let pos_last = p.query_start + (min(u0 + BQ, p.units) - 1u) / p.group;
    let lo = select(0u, max(pos_first + 1u, p.window) - p.window, windowed);
    let all_lo = select(0u, max(pos_last + 1u, p.window) - p.window, windowed);
    let hi = select(0xffffffffu, pos_last, causal);
    let all_hi = select(0xffffffffu, pos_first, causal);

    let tiles_a = (p.len_a + BK - 1u) / BK;
    let n_tiles = tiles_a + (p.len_b + BK - 1u) / BK;
    let t_begin = slice * p.tiles_per_slice;
    let t_end = min(t_begin + p.tiles_per_slice, n_tiles);
    for (var t = t_begin; t < t_end; t++) {
        let in_a = t < tiles_a;
        let t0 = select(t - tiles_a, t, in_a) * BK;
        let seg_len = select(p.len_b, p.len_a, in_a);
        // First buffer row of the segment: B may start inside a larger (batched) arena.
        let seg_row0 = select(p.b_row0, p.a_row0, in_a);
        let keys = min(BK, seg_len - t0);
        // Key index of the tile's first key, and of its last.
        let k_first = select(p.len_a, 0u, in_a) + t0;
        let k_last = k_first + keys - 1u;
        if (k_first > hi || k_last < lo) {
            continue;
        }
        let whole = k_first >= all_lo && k_last <= all_hi;

        var s: array<f32, R1>;
        for (var c = 0u; c < NCH; c++) {
            if (NCH > 1u) {
                // The previous chunk's reads of qs and kvs are done.
                workgroupBarrier();
                stage_q(lid, u0, kvh, c * HC);
            }
            stage(lid, in_a, false, seg_row0 + t0, keys, kv_col, c * HC);
            workgroupBarrier();
            for (var d4 = 0u; d4 < H4; d4++) {
                let k = kvs[kk * P4 + d4];
                for (var r = 0u; r < R1; r++) {
                    s[r] += dot(qs[(ub1 + UB * r) * H4 + d4], k);
                }
            }
        }
        for (var r = 0u; r < R1; r++) {
            let u = ub1 + UB * r;
            let at = u * BK + kk;
            // `||` short-circuits: the per-key test runs only across a mask boundary.
            let seen = kk < keys && (whole || sees(u0 + u, k_first + kk));
            ss[at / 4u][at % 4u] = select(MASKED, s[r], seen);
        }
        workgroupBarrier();

        stage(lid, in_a, true, seg_row0 + t0, keys, kv_col, 0u);
        var mx = NEG;
        for (var j = l2; j < BK; j += TPU) {
            let at = u2 * BK + j;
            mx = max(mx, ss[at / 4u][at % 4u]);
        }
        red[lid] = mx;
        workgroupBarrier();

        mx = run_max;
        for (var l = 0u; l < TPU; l++) {
            mx = max(mx, red[u2 * TPU + l]);
        }
        var sum = 0.0;
        for (var j = l2; j < BK; j += TPU) {
            let at = u2 * BK + j;
            let pj = exp2(ss[at / 4u][at % 4u] - mx);
            ss[at / 4u][at % 4u] = pj;
            sum += pj;
        }
        let a = exp2(run_max - mx);
        run_sum = run_sum * a + sum;
        run_max = mx;
        if (l2 == 0u) {
            alpha[u2] = a;
        }
        workgroupBarrier();

        for (var i = 0u; i < R3; i++) {
            acc[i] *= alpha[ub3 + DU * (i % R3C)];
        }
        // Four keys at a time: past `keys` the probabilities are exactly 0 and the staged
        // values 0, so the last group needs no mask.
        let c3 = d3 / 4u;
        let e3 = d3 % 4u;
        for (var c = 0u; c < NCH; c++) {
            for (var j4 = 0u; j4 < (keys + 3u) / 4u; j4++) {
                let j = 4u * j4;
                let v = vec4<f32>(
                    kvs[j * P4 + c3][e3],
                    kvs[(j + 1u) * P4 + c3][e3],
                    kvs[(j + 2u) * P4 + c3][e3],
                    kvs[(j + 3u) * P4 + c3][e3],
                );
                for (var r = 0u; r < R3C; r++) {
                    acc[c * R3C + r] += dot(ss[(ub3 + DU * r) * (BK / 4u) + j4], v);
                }
            }
            if (NCH > 1u) {
                // Everyone is done with V's chunk c: stage the next one.
                workgroupBarrier();
                if (c + 1u < NCH) {
                    stage(lid, in_a, true, seg_row0 + t0, keys, kv_col, (c + 1u) * HC);
                }
                workgroupBarrier();
            }
        }
        if (NCH == 1u) {
            workgroupBarrier();
        }
    }

    // Row sums from the per-invocation partials. Output i of this invocation: chunk
    // i / R3C, unit ub3 + DU * (i % R3C).
    red[lid] = run_sum;
    workgroupBarrier();
//#if SPLIT
    let n_units = p.n_kv_heads * p.units;
    let cell0 = slice * n_units + kvh * p.units;
    if (l2 == 0u && u0 + u2 < p.units) {
        var total = 0.0;
        for (var l = 0u; l < TPU; l++) {
            total += red[u2 * TPU + l];
        }
        let stats = (p.slices * n_units * HD) + (cell0 + u0 + u2) * 2u;
        out[stats] = run_max;
        out[stats + 1u] = total;
    }
    for (var i = 0u; i < R3; i++) {
        let u = ub3 + DU * (i % R3C);
        let d = (i / R3C) * HC + d3;
        if (u0 + u < p.units && d < p.hd) {
            out[(cell0 + u0 + u) * HD + d] = acc[i];
        }
    }
//#else
    for (var i = 0u; i < R3; i++) {
        let ui = ub3 + DU * (i % R3C);
        let u = u0 + ui;
        let d = (i / R3C) * HC + d3;
        if (u < p.units && d < p.hd) {
            var total = 0.0;
            for (var l = 0u; l < TPU; l++) {
                total += red[ui * TPU + l];
            }
            out[out_at(u, kvh) + d] = acc[i] / total;
        }
    }
//#endif
}
//#endif

//#if COOP
// Tensor cores (wgpu's `wgpu_cooperative_matrix`, FR x FR f16 fragments with f32
// accumulators) for head dim HD = 8 FR, 16 FR with HD16 or 32 FR with HD32 (128, 256 and
// 512 on NVIDIA GPUs): a workgroup of 4 subgroups owns BQ = 2 FR query units of one kv head
// and walks the keys in tiles of BK = 2 FR, twice.
//   pass 1: S = Q K^T per tile (subgroup s computes the score fragment (s / 2, s % 2)),
//           then each unit's running max and sum of exp2(S - max): RT invocations per unit
//           each take every RT-th key of the tile (score rows SP = BK + 4 floats apart, so
//           the lanes of a subgroup read distinct banks), and one per unit folds theirs in;
//   pass 2: S again, P = exp2(S - max) / sum as f16, O += P V (subgroup s owns the output
//           columns s * HD / 4 .. + HD / 4 as 2 x 2 accumulators, 2 x 4 with HD16).
// HD32 halves both tiles (BQ = BK = FR) so that Q and a K/V tile of 512 dims fit in an
// NVIDIA GPU's 48 KiB: S is one fragment, which subgroup s computes over the dims
// s * HD / 4 .. + HD / 4 into a plane of its own, the planes then summed; subgroup s owns
// the output columns s * HD / 4 .. + HD / 4 as 1 x 8 accumulators.
// With the final max and sum known before any P V product, the accumulators never need a
// rescale, which cooperative matrices cannot do per row; the price is a second Q K^T, cheap
// on tensor cores. Q (scaled by log2(e) / sqrt(hd)), K, V and P are rounded to f16 (2^-11
// relative), scores and outputs summed in f32. Rows past p.units and keys past a segment's
// end are zero in Q, K and V; a key past the end gets probability 0. Needs p.hd == HD.
// Masks as in the wide kernel: tiles no unit sees are skipped in both passes; across a mask
// boundary a hidden key scores MASKED in pass 1 and gets probability 0 in pass 2.
// SPLIT: a workgroup takes one slice of the key tiles, as the wide kernel does, and writes
// the same scratch: P = exp2(S - max) unnormalised, the output, and the slice's max and sum.
const SG: u32 = {{SG}}u;
const FR: u32 = {{FR}}u;
const FF: u32 = FR * FR;
const CWG: u32 = 4u * SG;
//#if HD32
const HD: u32 = 32u * FR;
const BQ: u32 = FR;
const BK: u32 = FR;
//#else
//#if HD16
const HD: u32 = 16u * FR;
//#else
const HD: u32 = 8u * FR;
//#endif
const BQ: u32 = 2u * FR;
const BK: u32 = 2u * FR;
//#endif
const HQ: u32 = HD / 4u; // output columns of a subgroup
const PS: u32 = HD + 8u; // row pitch of the staged Q and K/V tiles, in halves
const PP: u32 = BK + 8u; // row pitch of P, in halves
const SP: u32 = BK + 4u; // row pitch of the scores, in floats (16-byte steps)
const PLANE: u32 = BQ * SP; // one [unit][key] score plane
//#if HD32
const CS_LEN: u32 = 4u * PLANE; // a partial score plane per subgroup (over 4 FF floats)
//#else
const CS_LEN: u32 = PLANE; // 4 FR^2 + 8 FR floats: over the 4 FF that coop_out needs
//#endif
const RT: u32 = CWG / BQ; // invocations per unit in pass 1's statistics
const NEG: f32 = -1.0e30;
const MASKED: f32 = -2.0e30; // below NEG: exp2(MASKED - max) is 0 for every running max
var<workgroup> cq: array<f16, BQ * PS>;  // [unit][dim]
var<workgroup> ckv: array<f16, BK * PS>; // [key][dim], K then V of the tile
var<workgroup> cs: array<f32, CS_LEN>;   // [unit][key] scores; [subgroup][FR x FR] at the end
var<workgroup> cp: array<f16, BQ * PP>;  // [unit][key] probabilities
var<workgroup> cmax: array<f32, BQ>;
var<workgroup> csum: array<f32, BQ>;
var<workgroup> cpart: array<f32, 2u * CWG>; // pass 1: each invocation's (max, sum) of a tile

// Stages keys (or values) `row` .. `row + keys` of the tile as f16; rows past `keys` zero.
fn coop_stage(lid: u32, in_a: bool, values: bool, row: u32, keys: u32, kv_col: u32) {
    for (var i = lid; i < BK * HD / 4u; i += CWG) {
        let j = i / (HD / 4u);
        let d = (i % (HD / 4u)) * 4u;
        let x = kv_quad(in_a, values, row, j, keys, kv_col, d);
        let at = j * PS + d;
        ckv[at] = f16(x.x);
        ckv[at + 1u] = f16(x.y);
        ckv[at + 2u] = f16(x.z);
        ckv[at + 3u] = f16(x.w);
    }
}

// S = Q K^T of the staged tile into cs: subgroup s computes fragment (s / 2, s % 2); with
// HD32 the one fragment over a quarter of the dims each, then the quarters summed.
fn coop_scores(lid: u32, sg: u32) {
    var acc = coop_mat{{FR}}x{{FR}}<f32, C>();
//#if HD32
    // Indices and strides as lets: naga's SPIR-V writer wants every pointer operand of a
    // cooperative load or store computed before it.
    let d0 = sg * HQ;
    for (var kk = 0u; kk < HQ; kk += FR) {
        let stride = PS;
        let at = d0 + kk;
        let a = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&cq[at], stride);
        let b = coopLoad<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[at], stride);
        acc = coopMultiplyAdd(a, b, acc);
    }
    let stride_s = SP;
    let plane = sg * PLANE;
    coopStoreT(acc, &cs[plane], stride_s);
    workgroupBarrier();
    // Each score is one invocation's: plane 0 is read and written by it alone.
    for (var e = lid; e < BQ * BK; e += CWG) {
        let at = (e / BK) * SP + e % BK;
        cs[at] = cs[at] + cs[PLANE + at] + cs[2u * PLANE + at] + cs[3u * PLANE + at];
    }
//#else
    let qa = (sg >> 1u) * FR * PS;
    let ka = (sg & 1u) * FR * PS;
    for (var kk = 0u; kk < HD; kk += FR) {
        let stride = PS;
        let at_q = qa + kk;
        let at_k = ka + kk;
        let a = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&cq[at_q], stride);
        // K rows are K^T's columns: a column-major load.
        let b = coopLoad<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[at_k], stride);
        acc = coopMultiplyAdd(a, b, acc);
    }
    let at_s = (sg >> 1u) * FR * SP + (sg & 1u) * FR;
    let stride_s = SP;
    coopStoreT(acc, &cs[at_s], stride_s);
//#endif
}

// Writes accumulator (i, j) of every subgroup (units i * FR .., columns s * HQ + j * FR ..)
// to `out` through cs; SPLIT: to the slice's cells `cell0 + unit` of the scratch.
fn coop_out(lid: u32, sg: u32, acc: coop_mat{{FR}}x{{FR}}<f32, C>, i: u32, j: u32, u0: u32, kvh: u32, cell0: u32) {
    let at = sg * FF;
    let stride = FR;
    coopStoreT(acc, &cs[at], stride);
    workgroupBarrier();
    for (var e = lid; e < 4u * FF; e += CWG) {
        let u = u0 + i * FR + (e / FR) % FR;
        let d = (e / FF) * HQ + j * FR + e % FR;
        if (u < p.units) {
//#if SPLIT
            out[(cell0 + u) * HD + d] = cs[e];
//#else
            out[out_at(u, kvh) + d] = cs[e];
//#endif
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(CWG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // Unit blocks innermost, as in the wide kernel; inline, not a shared function: naga's
    // uniformity analysis does not follow a call's result, and the cooperative operations
    // below need this return and the key range uniform. A workgroup past the last leaves whole.
    let gid = wid.x + wid.y * nwg.x;
    let ublock = gid % p.unit_blocks;
    let rest = gid / p.unit_blocks;
    let slice = rest % p.slices;
    let kvh = rest / p.slices;
    if (kvh >= p.n_kv_heads) {
        return;
    }
    let u0 = ublock * BQ;
    let kv_col = kvh * p.hd;
    let cell0 = slice * p.n_kv_heads * p.units + kvh * p.units;
    for (var i = lid; i < BQ * HD; i += CWG) {
        let ui = i / HD;
        let d = i % HD;
        let u = u0 + ui;
        var x = 0.0;
        if (u < p.units) {
            x = q[q_at(u, kvh) + d] * p.scale_log2;
        }
        cq[ui * PS + d] = f16(x);
    }
    let tiles_a = (p.len_a + BK - 1u) / BK;
    let n_tiles = tiles_a + (p.len_b + BK - 1u) / BK;
    let t_begin = slice * p.tiles_per_slice;
    let t_end = min(t_begin + p.tiles_per_slice, n_tiles);
    // Masks (key indices; see the wide kernel): any unit sees keys in lo ..= hi, all of them
    // those in all_lo ..= all_hi.
    let causal = p.causal != 0u;
    let windowed = causal && p.window != 0u;
    let pos_first = p.query_start + u0 / p.group;
    let pos_last = p.query_start + (min(u0 + BQ, p.units) - 1u) / p.group;
    let lo = select(0u, max(pos_first + 1u, p.window) - p.window, windowed);
    let all_lo = select(0u, max(pos_last + 1u, p.window) - p.window, windowed);
    let hi = select(0xffffffffu, pos_last, causal);
    let all_hi = select(0xffffffffu, pos_first, causal);

    // Pass 1: each unit's max and sum of exp2(s - max) over all keys (invocation t < BQ
    // keeps unit t's).
    var run_max = NEG;
    var run_sum = 0.0;
    for (var t = t_begin; t < t_end; t++) {
        let in_a = t < tiles_a;
        let t0 = select(t - tiles_a, t, in_a) * BK;
        let keys = min(BK, select(p.len_b, p.len_a, in_a) - t0);
        let k_first = select(p.len_a, 0u, in_a) + t0;
        if (k_first > hi || k_first + keys - 1u < lo) {
            continue;
        }
        let whole = k_first >= all_lo && k_first + keys - 1u <= all_hi;
        workgroupBarrier();
        coop_stage(lid, in_a, false, select(p.b_row0, p.a_row0, in_a) + t0, keys, kv_col);
        workgroupBarrier();
        coop_scores(lid, sg);
        workgroupBarrier();
        // This invocation's keys lid % RT, + RT, .. of unit lid / RT.
        let su = lid / RT;
        var pmax = NEG;
        for (var j = lid % RT; j < keys; j += RT) {
            let seen = whole || sees(u0 + su, k_first + j);
            pmax = max(pmax, select(MASKED, cs[su * SP + j], seen));
        }
        var psum = 0.0;
        for (var j = lid % RT; j < keys; j += RT) {
            let seen = whole || sees(u0 + su, k_first + j);
            psum += exp2(select(MASKED, cs[su * SP + j], seen) - pmax);
        }
        cpart[lid] = pmax;
        cpart[CWG + lid] = psum;
        workgroupBarrier();
        if (lid < BQ) {
            var mx = run_max;
            for (var c = 0u; c < RT; c++) {
                mx = max(mx, cpart[lid * RT + c]);
            }
            var sum = run_sum * exp2(run_max - mx);
            for (var c = 0u; c < RT; c++) {
                sum += cpart[CWG + lid * RT + c] * exp2(cpart[lid * RT + c] - mx);
            }
            run_sum = sum;
            run_max = mx;
        }
    }
    if (lid < BQ) {
        cmax[lid] = run_max;
        csum[lid] = run_sum;
//#if SPLIT
        if (u0 + lid < p.units) {
            let stats = p.slices * p.n_kv_heads * p.units * HD + (cell0 + u0 + lid) * 2u;
            out[stats] = run_max;
            out[stats + 1u] = run_sum;
        }
//#endif
    }

    // Pass 2: O = P V with the final max and sum.
    let c0 = sg * HQ;
    var acc00 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc01 = coop_mat{{FR}}x{{FR}}<f32, C>();
//#if HD32
    var acc02 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc03 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc04 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc05 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc06 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc07 = coop_mat{{FR}}x{{FR}}<f32, C>();
//#else
    var acc10 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc11 = coop_mat{{FR}}x{{FR}}<f32, C>();
//#if HD16
    var acc02 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc03 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc12 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc13 = coop_mat{{FR}}x{{FR}}<f32, C>();
//#endif
//#endif
    for (var t = t_begin; t < t_end; t++) {
        let in_a = t < tiles_a;
        let t0 = select(t - tiles_a, t, in_a) * BK;
        let keys = min(BK, select(p.len_b, p.len_a, in_a) - t0);
        let row = select(p.b_row0, p.a_row0, in_a) + t0;
        let k_first = select(p.len_a, 0u, in_a) + t0;
        if (k_first > hi || k_first + keys - 1u < lo) {
            continue;
        }
        let whole = k_first >= all_lo && k_first + keys - 1u <= all_hi;
        workgroupBarrier();
        coop_stage(lid, in_a, false, row, keys, kv_col);
        workgroupBarrier();
        coop_scores(lid, sg);
        workgroupBarrier();
        for (var e = lid; e < BQ * BK; e += CWG) {
            let u = e / BK;
            let j = e % BK;
            var pr = 0.0;
            let seen = j < keys && (whole || sees(u0 + u, k_first + j));
//#if SPLIT
            // Unnormalised: the combine pass weighs the slices by their max and sum.
            if (seen) {
                pr = exp2(cs[u * SP + j] - cmax[u]);
            }
//#else
            if (seen && csum[u] > 0.0) {
                pr = exp2(cs[u * SP + j] - cmax[u]) / csum[u];
            }
//#endif
            cp[u * PP + j] = f16(pr);
        }
        coop_stage(lid, in_a, true, row, keys, kv_col);
        workgroupBarrier();
//#if HD32
        // One fragment of keys (BK = FR): P's one row of fragments times V's 8 columns.
        let sp = PP;
        let sv = PS;
        let a = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&cp[0], sp);
        let b0 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0], sv);
        let b1 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + FR], sv);
        let b2 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + 2u * FR], sv);
        let b3 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + 3u * FR], sv);
        acc00 = coopMultiplyAdd(a, b0, acc00);
        acc01 = coopMultiplyAdd(a, b1, acc01);
        acc02 = coopMultiplyAdd(a, b2, acc02);
        acc03 = coopMultiplyAdd(a, b3, acc03);
        let b4 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + 4u * FR], sv);
        let b5 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + 5u * FR], sv);
        let b6 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + 6u * FR], sv);
        let b7 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[c0 + 7u * FR], sv);
        acc04 = coopMultiplyAdd(a, b4, acc04);
        acc05 = coopMultiplyAdd(a, b5, acc05);
        acc06 = coopMultiplyAdd(a, b6, acc06);
        acc07 = coopMultiplyAdd(a, b7, acc07);
//#else
        for (var kk = 0u; kk < BK; kk += FR) {
            let sp = PP;
            let sv = PS;
            let pa0 = kk;
            let pa1 = FR * PP + kk;
            let vb0 = kk * PS + c0;
            let vb1 = vb0 + FR;
            let a0 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&cp[pa0], sp);
            let a1 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&cp[pa1], sp);
            // V rows are keys: a row-major [key, dim] B.
            let b0 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[vb0], sv);
            let b1 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[vb1], sv);
            acc00 = coopMultiplyAdd(a0, b0, acc00);
            acc01 = coopMultiplyAdd(a0, b1, acc01);
            acc10 = coopMultiplyAdd(a1, b0, acc10);
            acc11 = coopMultiplyAdd(a1, b1, acc11);
//#if HD16
            let b2 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[vb0 + 2u * FR], sv);
            let b3 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, B>>(&ckv[vb0 + 3u * FR], sv);
            acc02 = coopMultiplyAdd(a0, b2, acc02);
            acc03 = coopMultiplyAdd(a0, b3, acc03);
            acc12 = coopMultiplyAdd(a1, b2, acc12);
            acc13 = coopMultiplyAdd(a1, b3, acc13);
//#endif
        }
//#endif
    }
    workgroupBarrier();
    coop_out(lid, sg, acc00, 0u, 0u, u0, kvh, cell0);
    coop_out(lid, sg, acc01, 0u, 1u, u0, kvh, cell0);
//#if HD32
    coop_out(lid, sg, acc02, 0u, 2u, u0, kvh, cell0);
    coop_out(lid, sg, acc03, 0u, 3u, u0, kvh, cell0);
    coop_out(lid, sg, acc04, 0u, 4u, u0, kvh, cell0);
    coop_out(lid, sg, acc05, 0u, 5u, u0, kvh, cell0);
    coop_out(lid, sg, acc06, 0u, 6u, u0, kvh, cell0);
    coop_out(lid, sg, acc07, 0u, 7u, u0, kvh, cell0);
//#else
    coop_out(lid, sg, acc10, 1u, 0u, u0, kvh, cell0);
    coop_out(lid, sg, acc11, 1u, 1u, u0, kvh, cell0);
//#if HD16
    coop_out(lid, sg, acc02, 0u, 2u, u0, kvh, cell0);
    coop_out(lid, sg, acc03, 0u, 3u, u0, kvh, cell0);
    coop_out(lid, sg, acc12, 1u, 2u, u0, kvh, cell0);
    coop_out(lid, sg, acc13, 1u, 3u, u0, kvh, cell0);
//#endif
//#endif
}
//#endif
