// Token selection from LM-head logits, streamed over vocabulary chunks.
//
// Per row a small state (5 words) carries, across chunks:
//   best score, best id, the best id's logit (NEG when it has no confidence),
//   running max and running sum of exp(logit - max) over the confidence softmax.
// `accumulate` reduces one chunk per row (one workgroup per row) and merges it into the
// state; `finalize` turns the state into (token id, confidence bits). Ties in the score go
// to the lowest id everywhere, so the answer does not depend on chunking or scheduling.
//
// One stage per pipeline (flag RESET, ACCUMULATE or FINALIZE), so each entry point only
// declares the bindings it uses. ACCUMULATE takes CFG (unconditional logits bound) and
// NOISE (Gumbel noise, temperature > 0).

const STATE_WORDS: u32 = 5u;
const NONE: u32 = 0xffffffffu;
// Finite "minus infinity": a suppressed logit. exp of it minus any real max is 0.
const NEG: f32 = -3.0e38;

//#if RESET
struct Params {
    rows: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> state: array<u32>;

@compute @workgroup_size(64)
fn reset(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (row >= p.rows) {
        return;
    }
    let o = row * STATE_WORDS;
    state[o] = bitcast<u32>(NEG);
    state[o + 1u] = NONE;
    state[o + 2u] = bitcast<u32>(NEG);
    state[o + 3u] = bitcast<u32>(NEG);
    state[o + 4u] = bitcast<u32>(0.0);
}
//#endif

//#if FINALIZE
struct Params {
    rows: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> state: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn finalize(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (row >= p.rows) {
        return;
    }
    let o = row * STATE_WORDS;
    let logit = bitcast<f32>(state[o + 2u]);
    let mx = bitcast<f32>(state[o + 3u]);
    let sum = bitcast<f32>(state[o + 4u]);
    var conf = 0.0;
    if (logit > NEG && sum > 0.0) {
        conf = exp(logit - mx) / sum;
    }
    out[2u * row] = state[o + 1u];
    out[2u * row + 1u] = bitcast<u32>(conf);
}
//#endif

//#if ACCUMULATE
struct Params {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    step: u32,
    seed_lo: u32,
    seed_hi: u32,
    suppress: u32,      // NONE when absent
    exclude0: u32,      // NONE when absent
    exclude1: u32,
    temperature: f32,
    cfg_scale: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// Bindings exist only when used (the layout is derived from the entry point), so
// positions come last, at POS_BINDING.
// VEC4 (n a multiple of 4): logits are read four per load; each load of a lane costs a
// bounds check and, on SIMD CPU implementations, a per-lane loop.
//#if VEC4
@group(0) @binding(1) var<storage, read> logits: array<vec4<f32>>;
//#else
@group(0) @binding(1) var<storage, read> logits: array<f32>;
//#endif
@group(0) @binding(2) var<storage, read_write> state: array<u32>;
//#if CFG
//#if VEC4
@group(0) @binding(3) var<storage, read> uncond: array<vec4<f32>>;
//#else
@group(0) @binding(3) var<storage, read> uncond: array<f32>;
//#endif
//#endif
//#if NOISE
@group(0) @binding({{POS_BINDING}}) var<storage, read> positions: array<u32>;
//#endif

const WG: u32 = 256u;

var<workgroup> w_score: array<f32, WG>;
var<workgroup> w_id: array<u32, WG>;
var<workgroup> w_logit: array<f32, WG>;
var<workgroup> w_max: array<f32, WG>;
var<workgroup> w_sum: array<f32, WG>;

// Same function as `unmask_core::rng::pcg_hash`.
fn pcg_hash(x: u32) -> u32 {
    let s = x * 747796405u + 2891336453u;
    let word = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (word >> 22u) ^ word;
}

// Natural log with a small relative error for every positive normal x, also next to 1
// (where -ln(U) of a uniform close to 1 lives); the builtin only promises an absolute error
// there. x = 2^e * m, m in [sqrt(1/2), sqrt(2)], ln m = 2 atanh(s), s = (m - 1) / (m + 1).
fn ln_precise(x: f32) -> f32 {
    let bits = bitcast<u32>(x);
    var e = i32((bits >> 23u) & 0xffu) - 127;
    var m = bitcast<f32>((bits & 0x007fffffu) | 0x3f800000u);
    if (m > 1.41421356) {
        m = m * 0.5;
        e = e + 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series = 1.0 + s2 * (0.33333333 + s2 * (0.2 + s2 * (0.14285714 + s2 * (0.11111111 + s2 * 0.09090909))));
    let fe = f32(e);
    // ln 2 split so that fe * LN2_HI is exact.
    return fe * 0.693145751953125 + (fe * 1.4286068203094172e-6 + 2.0 * s * series);
}

// Upper bound of `gumbel`: U <= 1 - 2^-24, so -ln(-ln U) <= -ln(2^-24) = 16.64.
const GUMBEL_MAX: f32 = 17.0;

// Standard Gumbel noise -ln(-ln U), U = `unmask_core::rng::uniform_open(bits)`.
fn gumbel(bits: u32) -> f32 {
    let u = (f32(bits >> 9u) + 0.5) * (1.0 / 8388608.0);
    return -ln_precise(-ln_precise(u));
}

// Does candidate b beat a? Higher score, then lower id.
fn beats(score_b: f32, id_b: u32, score_a: f32, id_a: u32) -> bool {
    return score_b > score_a || (score_b == score_a && id_b < id_a);
}

// Merges slot `j` into slot `i` of the workgroup arrays.
fn merge_slots(i: u32, j: u32) {
    if (beats(w_score[j], w_id[j], w_score[i], w_id[i])) {
        w_score[i] = w_score[j];
        w_id[i] = w_id[j];
        w_logit[i] = w_logit[j];
    }
    let mi = w_max[i];
    let mj = w_max[j];
    let mx = max(mi, mj);
    w_sum[i] = w_sum[i] * exp(mi - mx) + w_sum[j] * exp(mj - mx);
    w_max[i] = mx;
}

// What one invocation has seen so far: the best candidate (score, id, its logit or NEG when
// it has no confidence) and the online max / sum of exp over the confidence softmax.
struct Partial {
    best_score: f32,
    best_id: u32,
    best_logit: f32,
    mx: f32,
    sum: f32,
}

// Folds logit `l_in` of vocabulary id `id` into `a`. Ids only grow within an invocation, so
// a strict > keeps the lowest id on ties.
fn visit(a: Partial, l_in: f32, id: u32, h_row: u32) -> Partial {
    var r = a;
    var l = l_in;
    let suppressed = id == p.suppress;
    if (suppressed) {
        l = NEG;
    }
    let member = !suppressed && id != p.exclude0 && id != p.exclude1;
    var score = l;
    //#if NOISE
    // The noise is below GUMBEL_MAX: a token that cannot reach the best score even with it
    // is lost anyway, and skipping its hash and logs changes nothing.
    if (l + p.temperature * GUMBEL_MAX >= r.best_score) {
        score = l + p.temperature * gumbel(pcg_hash(h_row ^ id));
    }
    //#endif
    if (score > r.best_score || r.best_id == NONE) {
        r.best_score = score;
        r.best_id = id;
        r.best_logit = select(NEG, l, member);
    }
    if (member) {
        if (l > r.mx) {
            r.sum = r.sum * exp(r.mx - l) + 1.0;
            r.mx = l;
        } else {
            r.sum += exp(l - r.mx);
        }
    }
    return r;
}

@compute @workgroup_size(256)
fn accumulate(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.n;
    // hash4(seed_lo, seed_hi, step, position, id) with the row-constant part hoisted.
    var h_row = 0u;
    //#if NOISE
    h_row = pcg_hash(pcg_hash(pcg_hash(p.seed_lo ^ pcg_hash(p.seed_hi)) ^ p.step) ^ positions[row]);
    //#endif
    var part = Partial(NEG, NONE, NEG, NEG, 0.0);
//#if VEC4
    let base4 = base / 4u;
    for (var v = 4u * lid; v < p.n; v += 4u * WG) {
        var l = logits[base4 + v / 4u];
        //#if CFG
        let u = uncond[base4 + v / 4u];
        l = u + (p.cfg_scale + 1.0) * (l - u);
        //#endif
        let id = p.vocab_offset + v;
        part = visit(part, l.x, id, h_row);
        part = visit(part, l.y, id + 1u, h_row);
        part = visit(part, l.z, id + 2u, h_row);
        part = visit(part, l.w, id + 3u, h_row);
    }
//#else
    for (var v = lid; v < p.n; v += WG) {
        var l = logits[base + v];
        //#if CFG
        let u = uncond[base + v];
        l = u + (p.cfg_scale + 1.0) * (l - u);
        //#endif
        part = visit(part, l, p.vocab_offset + v, h_row);
    }
//#endif
    w_score[lid] = part.best_score;
    w_id[lid] = part.best_id;
    w_logit[lid] = part.best_logit;
    w_max[lid] = part.mx;
    w_sum[lid] = part.sum;
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        workgroupBarrier();
        if (lid < stride) {
            merge_slots(lid, lid + stride);
        }
    }
    if (lid == 0u) {
        let o = row * STATE_WORDS;
        let s_score = bitcast<f32>(state[o]);
        let s_id = state[o + 1u];
        if (beats(s_score, s_id, w_score[0], w_id[0])) {
            w_score[0] = s_score;
            w_id[0] = s_id;
            w_logit[0] = bitcast<f32>(state[o + 2u]);
        }
        let sm = bitcast<f32>(state[o + 3u]);
        let cm = w_max[0];
        let m2 = max(sm, cm);
        let total = bitcast<f32>(state[o + 4u]) * exp(sm - m2) + w_sum[0] * exp(cm - m2);
        state[o] = bitcast<u32>(w_score[0]);
        state[o + 1u] = w_id[0];
        state[o + 2u] = bitcast<u32>(w_logit[0]);
        state[o + 3u] = bitcast<u32>(m2);
        state[o + 4u] = bitcast<u32>(total);
    }
}
//#endif
