// Token selection from LM-head logits, streamed over vocabulary chunks.
//
// Per row a small state (10 words) carries, across chunks:
//   0 best score, 1 best id, 2 the best id's logit (NEG when it has no confidence),
//   3 running max m of the confidence softmax's logits,
//   4 S0 = sum exp(l - m),
//   5 the second largest logit (MARGIN; the largest is m, a tie makes them equal),
//   6 S1 = sum exp(l - m) (l - m) (ENTROPY),
//   7 the best id's model logit r (the CFG-combined logit before the cut, the suppression
//     and the temperature), 8 running max of r over the whole row, 9 sum exp(r - max)
//     (LOGPROB: the chosen token's log-probability under the model's own softmax).
// `accumulate` reduces one chunk per row (one workgroup per row) and merges it into the
// state; `finalize` turns the state into (token id, confidence bits, log-probability bits,
// NaN without LOGPROB). Ties in the score go to the lowest id everywhere, so the token does
// not depend on chunking or scheduling.
//
// One stage per pipeline (flag RESET, THRESHOLD, ACCUMULATE or FINALIZE), so each entry
// point only declares the bindings it uses. ACCUMULATE takes CFG (unconditional logits
// bound), NOISE (Gumbel noise, temperature > 0) and CUT (a per-row threshold from
// `threshold`). The confidence kind is a flag of ACCUMULATE and FINALIZE: none for the
// chosen token's probability, MARGIN for top-1 minus top-2 probability, ENTROPY for
// sum p ln p; words 5 and 6 are only kept up to date by their kind.
//
// The top-p / top-k cut needs each row whole, so with a cut the host keeps full rows and
// runs `threshold` before a single `accumulate` over them: per row, the smallest key c of
// the order-preserving map of logits to u32 such that fewer than k logits have a key
// above c and the tempered probability above c is at most top_p. Ids with a key below c
// are cut. Both conditions only loosen as c grows, so c is found by bisection, its last
// steps over the few keys left between its bounds (gathered into workgroup memory). min-p
// is a floor on c: the key of the row's maximum plus `min_gap`; top-p's probabilities are
// then those of the ids at or above the floor (vLLM's order: min-p first), and min-p alone
// needs no bisection.

const STATE_WORDS: u32 = 10u;
const OUT_WORDS: u32 = 3u;
// A quiet NaN's bits: the log-probability word when LOGPROB is off.
const NAN_BITS: u32 = 0x7fc00000u;
const NONE: u32 = 0xffffffffu;
// Finite "minus infinity": a suppressed logit. exp of it minus any real max is 0.
const NEG: f32 = -3.0e38;

// 1 - exp(x) for x <= 0 with a small relative error also next to 0, where the subtraction
// cancels (the margin of two nearly tied logits): -expm1 as a Taylor series up to |x| = 0.5,
// truncated below 1.1e-8 relative.
fn one_minus_exp(x: f32) -> f32 {
    if (x < -0.5) {
        return 1.0 - exp(x);
    }
    let t = 1.0 + x / 6.0 * (1.0 + x / 7.0 * (1.0 + x / 8.0));
    return -x * (1.0 + x / 2.0 * (1.0 + x / 3.0 * (1.0 + x / 4.0 * (1.0 + x / 5.0 * t))));
}

// Maps f32 to u32 so that the u32 order is the f32 order (both zeros map to one key).
fn order_key(x: f32) -> u32 {
    var b = bitcast<u32>(x);
    if (x == 0.0) {
        b = 0u;
    }
    if ((b >> 31u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

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
    state[o + 5u] = bitcast<u32>(NEG);
    state[o + 6u] = bitcast<u32>(0.0);
    state[o + 7u] = bitcast<u32>(NEG);
    state[o + 8u] = bitcast<u32>(NEG);
    state[o + 9u] = bitcast<u32>(0.0);
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
    let mx = bitcast<f32>(state[o + 3u]);
    let sum = bitcast<f32>(state[o + 4u]);
    // 0 for a row without any logit in the softmax (sum 0, max NEG).
    var conf = 0.0;
//#if MARGIN
    // p1 - p2 = (1 - exp(l2 - l1)) / S0; exactly 0 when the top two tie. One column: l2 is
    // NEG and the margin 1 / S0.
    let second = bitcast<f32>(state[o + 5u]);
    if (second < mx) {
        conf = one_minus_exp(max(second - mx, NEG)) / sum;
    }
//#else
//#if ENTROPY
    // sum p ln p = S1 / S0 - ln S0 (<= 0: S1 <= 0 and S0 >= 1, the maximum's own term).
    let s1 = bitcast<f32>(state[o + 6u]);
    if (sum > 0.0) {
        conf = s1 / sum - ln_precise(sum);
    }
//#else
    let logit = bitcast<f32>(state[o + 2u]);
    if (logit > NEG && sum > 0.0) {
        conf = exp(logit - mx) / sum;
    }
//#endif
//#endif
    out[OUT_WORDS * row] = state[o + 1u];
    out[OUT_WORDS * row + 1u] = bitcast<u32>(conf);
    var logprob = NAN_BITS;
//#if LOGPROB
    // log softmax(r)[best] = r_best - max - ln sum; the sum is at least 1 (the max's term)
    // once any logit was seen.
    let r_sum = bitcast<f32>(state[o + 9u]);
    if (r_sum > 0.0) {
        let lp = bitcast<f32>(state[o + 7u]) - bitcast<f32>(state[o + 8u]) - ln_precise(r_sum);
        logprob = bitcast<u32>(min(lp, 0.0));
    }
//#endif
    out[OUT_WORDS * row + 2u] = logprob;
}
//#endif

//#if THRESHOLD
struct Params {
    rows: u32,
    n: u32,
    // Row of `cut` for row 0 of `logits`.
    row_base: u32,
    suppress: u32,      // NONE when absent
    top_k: u32,         // 0 when absent
    // Absent: 2.0 from the host, above any probability.
    top_p: f32,
    // 1/T at temperature T > 0, else 1: the probabilities of the cut are softmax(l * scale).
    scale: f32,
    // min-p: logits below max + min_gap are cut (`SelectParams::min_p_gap`); NEG when absent.
    min_gap: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> cut: array<u32>;

const WG: u32 = 256u;

var<workgroup> w_count: array<u32, WG>;
var<workgroup> w_mass: array<f32, WG>;
// The lower bound of the answer from the invocations' maxima (0: none).
var<workgroup> w_low: u32;
// Most keys gathered for the bisection's last steps (8 KiB of keys and weights).
const BAND: u32 = 1024u;
var<workgroup> b_key: array<u32, BAND>;
var<workgroup> b_weight: array<f32, BAND>;
var<workgroup> b_fill: atomic<u32>;

// Sums w_count and w_mass over the workgroup into slot 0, visible to all after it.
fn reduce_sums(lid: u32) {
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        workgroupBarrier();
        if (lid < stride) {
            w_count[lid] += w_count[lid + stride];
            w_mass[lid] += w_mass[lid + stride];
        }
    }
    workgroupBarrier();
}

// One workgroup per row. Passes over the row: its maximum, its softmax sum with the count
// of the keys at or above a lower bound of the answer, then one per bisection step (the
// count and probability above the midpoint) until at most BAND keys are left between the
// bounds; those are gathered into workgroup memory once and the bisection ends there.
// With top-k within the workgroup's size, the k-th largest of the invocations' maxima
// bounds the answer from below (k distinct ids lie at or above it), so a top-k cut
// usually gathers at once: 3 passes instead of up to 34. min-p alone takes one pass.
@compute @workgroup_size(256)
fn threshold(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.n;
    var mine = NEG;
    for (var v = lid; v < p.n; v += WG) {
        if (v != p.suppress) {
            mine = max(mine, logits[base + v]);
        }
    }
    if (lid == 0u) {
        w_low = 0u;
    }
    w_mass[lid] = mine;
    w_count[lid] = order_key(mine);
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        workgroupBarrier();
        if (lid < stride) {
            w_mass[lid] = max(w_mass[lid], w_mass[lid + stride]);
        }
    }
    let mx = workgroupUniformLoad(&w_mass[0]);
    // min-p keeps the logits from mx + min_gap up (vLLM applies it before top-k / top-p,
    // whose probabilities are then renormalised over what it kept).
    let min_p = p.min_gap > NEG;
    var floor = NEG;
    if (min_p) {
        floor = mx + p.min_gap;
    }
    // min-p alone: its floor is the cut, and no search is needed.
    if (p.top_k == 0u && p.top_p > 1.0) {
        if (lid == 0u) {
            cut[p.row_base + row] = select(0u, order_key(floor), min_p);
        }
        return;
    }
    // The k-th largest of the invocations' maxima (by key; the barriers above made them
    // visible): the invocations holding it all write the same value.
    if (p.top_k > 0u && p.top_k <= WG) {
        let key = w_count[lid];
        var greater = 0u;
        var at_least = 0u;
        for (var j = 0u; j < WG; j++) {
            let other = w_count[j];
            greater += select(0u, 1u, other > key);
            at_least += select(0u, 1u, other >= key);
        }
        if (greater < p.top_k && p.top_k <= at_least) {
            w_low = key;
        }
    }
    // The answer is at least the bracket and, with min-p, its floor's key.
    var lo = workgroupUniformLoad(&w_low);
    if (min_p) {
        lo = max(lo, order_key(floor));
    }
    var total = 0.0;
    var in_band = 0u;
    for (var v = lid; v < p.n; v += WG) {
        let l = logits[base + v];
        if (v != p.suppress) {
            if (l >= floor) {
                total += exp((l - mx) * p.scale);
            }
            in_band += select(0u, 1u, order_key(l) >= lo);
        }
    }
    // Every invocation has read the maxima before the slots are overwritten.
    workgroupBarrier();
    w_mass[lid] = total;
    w_count[lid] = in_band;
    reduce_sums(lid);
    let p_mass = p.top_p * workgroupUniformLoad(&w_mass[0]);
    // Invariant: the answer lies in [lo, hi]; `band` keys of the row lie in [lo, hi], and
    // `above_*` are the count and probability of the keys above hi, so a step only sums
    // the keys in (mid, hi] (an exp each, or a stored weight once gathered). The key of
    // the maximum passes both conditions (nothing lies above it). lo, hi, band and the
    // sums are workgroup-uniform (read through workgroupUniformLoad), so the loop may stop
    // once lo meets hi.
    var band = workgroupUniformLoad(&w_count[0]);
    var hi = order_key(mx);
    var above_count = 0u;
    var above_mass = 0.0;
    var gathered = false;
    // Keys gathered (the band when they were): later steps filter them by their bounds.
    var stored = 0u;
    for (var it = 0u; it < 32u; it++) {
        if (lo >= hi) {
            break;
        }
        if (!gathered && band <= BAND) {
            // One more pass: the band's keys and weights into workgroup memory.
            if (lid == 0u) {
                atomicStore(&b_fill, 0u);
            }
            workgroupBarrier();
            for (var v = lid; v < p.n; v += WG) {
                let l = logits[base + v];
                let key = order_key(l);
                if (key >= lo && key <= hi && v != p.suppress) {
                    let at = atomicAdd(&b_fill, 1u);
                    if (at < BAND) {
                        b_key[at] = key;
                        b_weight[at] = exp((l - mx) * p.scale);
                    }
                }
            }
            workgroupBarrier();
            gathered = true;
            stored = band;
        }
        let mid = lo + (hi - lo) / 2u;
        var count = 0u;
        var mass = 0.0;
        if (gathered) {
            for (var i = lid; i < stored; i += WG) {
                let key = b_key[i];
                if (key > mid && key <= hi) {
                    count += 1u;
                    mass += b_weight[i];
                }
            }
        } else {
            for (var v = lid; v < p.n; v += WG) {
                let l = logits[base + v];
                let key = order_key(l);
                if (key > mid && key <= hi && v != p.suppress) {
                    count += 1u;
                    mass += exp((l - mx) * p.scale);
                }
            }
        }
        workgroupBarrier();
        w_count[lid] = count;
        w_mass[lid] = mass;
        reduce_sums(lid);
        let band_count = workgroupUniformLoad(&w_count[0]);
        let band_mass = workgroupUniformLoad(&w_mass[0]);
        let holds = (p.top_k == 0u || above_count + band_count < p.top_k)
            && above_mass + band_mass <= p_mass;
        if (holds) {
            hi = mid;
            above_count += band_count;
            above_mass += band_mass;
            band -= band_count;
        } else {
            lo = mid + 1u;
            band = band_count;
        }
    }
    // lo started at min-p's floor, when there is one, and only grew.
    if (lid == 0u) {
        cut[p.row_base + row] = lo;
    }
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
    // NONE when absent; the host sets them only for the probability (MARGIN and ENTROPY
    // see the whole row).
    exclude0: u32,
    exclude1: u32,
    // T times `logit_scale`: the noise's weight on the scaled logits.
    noise_scale: f32,
    cfg_scale: f32,
    // 1/T for a tempered confidence at T > 0, else 1: logits are scaled by it on load, so
    // the token (argmax of l + T g, or of l/T + g) is the same either way.
    logit_scale: f32,
    // Row of `state`, `positions` and `cut` for row 0 of `logits`.
    row_base: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
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
//#if CUT
@group(0) @binding({{CUT_BINDING}}) var<storage, read> cut: array<u32>;
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
//#if MARGIN
var<workgroup> w_second: array<f32, WG>;
//#endif
//#if ENTROPY
var<workgroup> w_s1: array<f32, WG>;
//#endif
//#if LOGPROB
var<workgroup> w_rlogit: array<f32, WG>;
var<workgroup> w_rmax: array<f32, WG>;
var<workgroup> w_rsum: array<f32, WG>;
//#endif

// Does candidate b beat a? Higher score, then lower id.
fn beats(score_b: f32, id_b: u32, score_a: f32, id_a: u32) -> bool {
    return score_b > score_a || (score_b == score_a && id_b < id_a);
}

// What one invocation (or workgroup, or the state) has seen so far: the best candidate
// (score, id, its logit or NEG when it has no confidence) and the online statistics of the
// confidence softmax (state words 3 to 6).
struct Partial {
    best_score: f32,
    best_id: u32,
    best_logit: f32,
    mx: f32,
    sum: f32,
    second: f32,
    s1: f32,
    // LOGPROB: the best id's model logit, and the model softmax's running max and sum.
    r_logit: f32,
    r_max: f32,
    r_sum: f32,
}

// Folds logit `l_in` of vocabulary id `id` into `a`. Ids only grow within an invocation, so
// a strict > keeps the lowest id on ties. `cut_key`: the row's threshold (0 cuts nothing).
fn visit(a: Partial, l_in: f32, id: u32, h_row: u32, cut_key: u32) -> Partial {
    var r = a;
    var l = l_in * p.logit_scale;
    var suppressed = id == p.suppress;
    //#if CUT
    suppressed = suppressed || order_key(l_in) < cut_key;
    //#endif
    if (suppressed) {
        l = NEG;
    }
    let member = !suppressed && id != p.exclude0 && id != p.exclude1;
    var score = l;
    //#if NOISE
    // The noise is below GUMBEL_MAX: a token that cannot reach the best score even with it
    // is lost anyway, and skipping its hash and logs changes nothing.
    if (l + p.noise_scale * GUMBEL_MAX >= r.best_score) {
        score = l + p.noise_scale * gumbel(pcg_hash(h_row ^ id));
    }
    //#endif
    if (score > r.best_score || r.best_id == NONE) {
        r.best_score = score;
        r.best_id = id;
        r.best_logit = select(NEG, l, member);
        r.r_logit = l_in;
    }
    //#if LOGPROB
    // The model's softmax sees every id, whatever the cut, suppression or temperature.
    if (l_in > r.r_max) {
        r.r_sum = r.r_sum * exp(max(r.r_max - l_in, NEG)) + 1.0;
        r.r_max = l_in;
    } else {
        r.r_sum += exp(l_in - r.r_max);
    }
    //#endif
    if (member) {
        if (l > r.mx) {
            // A new maximum: S0 <- e^d S0, S1 <- e^d (S1 + d S0) with d = m - l <= 0, then
            // l's own term (1, and 0 for S1). d is clamped so that the empty start (m NEG,
            // sums 0) stays exactly 0 for any l.
            let d = max(r.mx - l, NEG);
            let scale = exp(d);
            //#if ENTROPY
            r.s1 = scale * (r.s1 + d * r.sum);
            //#endif
            r.sum = r.sum * scale + 1.0;
            //#if MARGIN
            r.second = r.mx;
            //#endif
            r.mx = l;
        } else {
            let d = l - r.mx;
            let e = exp(d);
            r.sum += e;
            //#if ENTROPY
            // A -inf logit adds 0 * NEG = 0, not NaN.
            r.s1 += e * max(d, NEG);
            //#endif
            //#if MARGIN
            r.second = max(r.second, l);
            //#endif
        }
    }
    return r;
}

// `a` and `b` together. The statistics are exact max / min or sums, so the result is the
// same in any order up to rounding, and the best candidate is the same in any order.
fn merge(a: Partial, b: Partial) -> Partial {
    var r = a;
    if (beats(b.best_score, b.best_id, a.best_score, a.best_id)) {
        r.best_score = b.best_score;
        r.best_id = b.best_id;
        r.best_logit = b.best_logit;
        r.r_logit = b.r_logit;
    }
    //#if LOGPROB
    let r_max = max(a.r_max, b.r_max);
    r.r_sum = a.r_sum * exp(max(a.r_max - r_max, NEG)) + b.r_sum * exp(max(b.r_max - r_max, NEG));
    r.r_max = r_max;
    //#endif
    let mx = max(a.mx, b.mx);
    // Clamped like in `visit`: an empty side (max NEG, sums 0) adds exactly 0.
    let da = max(a.mx - mx, NEG);
    let db = max(b.mx - mx, NEG);
    let ea = exp(da);
    let eb = exp(db);
    r.mx = mx;
    r.sum = a.sum * ea + b.sum * eb;
    //#if ENTROPY
    r.s1 = ea * (a.s1 + da * a.sum) + eb * (b.s1 + db * b.sum);
    //#endif
    //#if MARGIN
    // The runner-up is the smaller maximum or the larger runner-up.
    r.second = max(min(a.mx, b.mx), max(a.second, b.second));
    //#endif
    return r;
}

fn load_slot(i: u32) -> Partial {
    var r = Partial(w_score[i], w_id[i], w_logit[i], w_max[i], w_sum[i], NEG, 0.0, NEG, NEG, 0.0);
    //#if MARGIN
    r.second = w_second[i];
    //#endif
    //#if ENTROPY
    r.s1 = w_s1[i];
    //#endif
    //#if LOGPROB
    r.r_logit = w_rlogit[i];
    r.r_max = w_rmax[i];
    r.r_sum = w_rsum[i];
    //#endif
    return r;
}

fn store_slot(i: u32, a: Partial) {
    w_score[i] = a.best_score;
    w_id[i] = a.best_id;
    w_logit[i] = a.best_logit;
    w_max[i] = a.mx;
    w_sum[i] = a.sum;
    //#if MARGIN
    w_second[i] = a.second;
    //#endif
    //#if ENTROPY
    w_s1[i] = a.s1;
    //#endif
    //#if LOGPROB
    w_rlogit[i] = a.r_logit;
    w_rmax[i] = a.r_max;
    w_rsum[i] = a.r_sum;
    //#endif
}

fn load_state(o: u32) -> Partial {
    return Partial(
        bitcast<f32>(state[o]),
        state[o + 1u],
        bitcast<f32>(state[o + 2u]),
        bitcast<f32>(state[o + 3u]),
        bitcast<f32>(state[o + 4u]),
        bitcast<f32>(state[o + 5u]),
        bitcast<f32>(state[o + 6u]),
        bitcast<f32>(state[o + 7u]),
        bitcast<f32>(state[o + 8u]),
        bitcast<f32>(state[o + 9u]),
    );
}

fn store_state(o: u32, a: Partial) {
    state[o] = bitcast<u32>(a.best_score);
    state[o + 1u] = a.best_id;
    state[o + 2u] = bitcast<u32>(a.best_logit);
    state[o + 3u] = bitcast<u32>(a.mx);
    state[o + 4u] = bitcast<u32>(a.sum);
    state[o + 5u] = bitcast<u32>(a.second);
    state[o + 6u] = bitcast<u32>(a.s1);
    state[o + 7u] = bitcast<u32>(a.r_logit);
    state[o + 8u] = bitcast<u32>(a.r_max);
    state[o + 9u] = bitcast<u32>(a.r_sum);
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
    let srow = p.row_base + row;
    // hash4(seed_lo, seed_hi, step, position, id) with the row-constant part hoisted.
    var h_row = 0u;
    //#if NOISE
    h_row = pcg_hash(pcg_hash(pcg_hash(p.seed_lo ^ pcg_hash(p.seed_hi)) ^ p.step) ^ positions[srow]);
    //#endif
    var cut_key = 0u;
    //#if CUT
    cut_key = cut[srow];
    //#endif
    var part = Partial(NEG, NONE, NEG, NEG, 0.0, NEG, 0.0, NEG, NEG, 0.0);
//#if VEC4
    let base4 = base / 4u;
    for (var v = 4u * lid; v < p.n; v += 4u * WG) {
        var l = logits[base4 + v / 4u];
        //#if CFG
        let u = uncond[base4 + v / 4u];
        l = u + (p.cfg_scale + 1.0) * (l - u);
        //#endif
        let id = p.vocab_offset + v;
        part = visit(part, l.x, id, h_row, cut_key);
        part = visit(part, l.y, id + 1u, h_row, cut_key);
        part = visit(part, l.z, id + 2u, h_row, cut_key);
        part = visit(part, l.w, id + 3u, h_row, cut_key);
    }
//#else
    for (var v = lid; v < p.n; v += WG) {
        var l = logits[base + v];
        //#if CFG
        let u = uncond[base + v];
        l = u + (p.cfg_scale + 1.0) * (l - u);
        //#endif
        part = visit(part, l, p.vocab_offset + v, h_row, cut_key);
    }
//#endif
    store_slot(lid, part);
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        workgroupBarrier();
        if (lid < stride) {
            store_slot(lid, merge(load_slot(lid), load_slot(lid + stride)));
        }
    }
    if (lid == 0u) {
        let o = srow * STATE_WORDS;
        store_state(o, merge(load_slot(0u), load_state(o)));
    }
}
//#endif
