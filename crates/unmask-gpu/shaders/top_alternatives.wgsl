// The k most likely tokens of each row (k <= 20), streamed over vocabulary chunks like
// `select`: OpenAI's `top_logprobs`, the alternatives reported beside each chosen token.
//
// Per row the state holds the best k (logit bits, id) pairs so far, best first: a higher
// logit first, the lower id on ties, so the list does not depend on chunking or
// scheduling. Logits are the model's (CFG-combined, after a request's logit biases,
// before any cut or temperature).
// `accumulate` reduces one chunk per row (one workgroup per row) in two plain passes over
// it: the first finds each invocation's largest logit, whose k-th largest is a floor the
// chunk's k-th cannot be below; the second gathers the logits at or above it (usually a
// few more than k), which are ranked against each other. No invocation keeps a sorted list
// (on a SIMD CPU its insertions cost the most). When more than CAP logits reach the floor
// (many ties, a chunk of few ids), each invocation keeps its own sorted top k and k rounds
// take the workgroup's best head each instead. One invocation then merges the chunk's list
// into the state. `finalize` turns each pair
// into (id, log-probability) with the row's model softmax from `select`'s state (words 8
// and 9, kept with its LOGPROB flag).

const MOST: u32 = 20u;
const TOP_WORDS: u32 = 40u;
const NONE: u32 = 0xffffffffu;
const NEG: f32 = -3.0e38;

// Does (vb, ib) come before (va, ia)? A higher logit, then a lower id.
fn before(vb: f32, ib: u32, va: f32, ia: u32) -> bool {
    return vb > va || (vb == va && ib < ia);
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
    for (var j = 0u; j < MOST; j++) {
        state[row * TOP_WORDS + 2u * j] = bitcast<u32>(NEG);
        state[row * TOP_WORDS + 2u * j + 1u] = NONE;
    }
}
//#endif

//#if ACCUMULATE
struct Params {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    k: u32,
    cfg_scale: f32,
    // Row of `state` for row 0 of `logits`.
    row_base: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<u32>;
//#if CFG
@group(0) @binding(3) var<storage, read> uncond: array<f32>;
//#endif

const WG: u32 = 256u;

var<workgroup> w_val: array<f32, WG>;
var<workgroup> w_id: array<u32, WG>;
var<workgroup> w_lane: array<u32, WG>;
// This chunk's best k, best first.
var<workgroup> c_val: array<f32, MOST>;
var<workgroup> c_id: array<u32, MOST>;
// Kept pairs at or above the floor, in no order.
const CAP: u32 = 256u;
var<workgroup> cand_val: array<f32, CAP>;
var<workgroup> cand_id: array<u32, CAP>;
var<workgroup> cand_count: atomic<u32>;
var<workgroup> cand_n: u32;
var<workgroup> w_floor: f32;

// The model's logit of column v of the row starting at `base` (CFG-combined).
fn logit_at(base: u32, v: u32) -> f32 {
    var l = logits[base + v];
    //#if CFG
    let u = uncond[base + v];
    l = u + (p.cfg_scale + 1.0) * (l - u);
    //#endif
    return l;
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
    let k = min(p.k, MOST);
    let base = row * p.n;
    if (lid == 0u) {
        atomicStore(&cand_count, 0u);
        w_floor = NEG;
    }
    // Pass 1: each invocation's largest logit (a NaN is never taken).
    var best = NEG;
    for (var v = lid; v < p.n; v += WG) {
        let l = logit_at(base, v);
        if (l > best) {
            best = l;
        }
    }
    w_val[lid] = best;
    workgroupBarrier();
    // The floor: the k-th largest of those maxima. k invocations hold a logit at or above
    // it, so the chunk's k-th is not below it. Places are distinct (ties by lane).
    var place = 0u;
    for (var d = 0u; d < WG; d++) {
        let o = w_val[d];
        place += u32(o > best || (o == best && d < lid));
    }
    if (place == k - 1u) {
        w_floor = best;
    }
    let floor = workgroupUniformLoad(&w_floor);
    // Pass 2: the logits at or above the floor, usually a few more than k.
    for (var v = lid; v < p.n; v += WG) {
        let l = logit_at(base, v);
        if (l >= floor) {
            let at = atomicAdd(&cand_count, 1u);
            if (at < CAP) {
                cand_val[at] = l;
                cand_id[at] = p.vocab_offset + v;
            }
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        cand_n = atomicLoad(&cand_count);
    }
    let n_cand = workgroupUniformLoad(&cand_n);
    if (n_cand <= CAP) {
        // Each candidate's place is the number of candidates before it (distinct ids make
        // the places distinct); the first k places are the chunk's list.
        if (lid < n_cand) {
            let cv = cand_val[lid];
            let ci = cand_id[lid];
            var at = 0u;
            for (var d = 0u; d < n_cand; d++) {
                at += u32(before(cand_val[d], cand_id[d], cv, ci));
            }
            if (at < k) {
                c_val[at] = cv;
                c_id[at] = ci;
            }
        }
        // Fewer candidates than k: the rest of the list is empty.
        if (lid >= n_cand && lid < k) {
            c_val[lid] = NEG;
            c_id[lid] = NONE;
        }
        workgroupBarrier();
    } else {
        top_rounds(lid, k, base);
    }
    if (lid != 0u) {
        return;
    }
    merge_into_state(row, k);
}

// The chunk's list when too many logits reach the floor (many ties, or a chunk of few
// ids): each invocation keeps its own sorted top k, then k rounds take the workgroup's
// best head each, and its owner moves on to its next.
fn top_rounds(lid: u32, k: u32, base: u32) {
    var vals: array<f32, MOST>;
    var ids: array<u32, MOST>;
    for (var j = 0u; j < MOST; j++) {
        vals[j] = NEG;
        ids[j] = NONE;
    }
    // Ids grow within an invocation, so a strict > keeps the lower id of a tie first.
    for (var v = lid; v < p.n; v += WG) {
        let l = logit_at(base, v);
        if (l > vals[k - 1u]) {
            var j = k - 1u;
            while (j > 0u && vals[j - 1u] < l) {
                vals[j] = vals[j - 1u];
                ids[j] = ids[j - 1u];
                j--;
            }
            vals[j] = l;
            ids[j] = p.vocab_offset + v;
        }
    }
    var head = 0u;
    for (var r = 0u; r < k; r++) {
        if (head < k) {
            w_val[lid] = vals[head];
            w_id[lid] = ids[head];
        } else {
            w_val[lid] = NEG;
            w_id[lid] = NONE;
        }
        w_lane[lid] = lid;
        for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
            workgroupBarrier();
            if (lid < stride
                && before(w_val[lid + stride], w_id[lid + stride], w_val[lid], w_id[lid])) {
                w_val[lid] = w_val[lid + stride];
                w_id[lid] = w_id[lid + stride];
                w_lane[lid] = w_lane[lid + stride];
            }
        }
        workgroupBarrier();
        if (lid == w_lane[0]) {
            head++;
        }
        if (lid == 0u) {
            c_val[r] = w_val[0];
            c_id[r] = w_id[0];
        }
        // Every invocation has read slot 0 before the next round writes it.
        workgroupBarrier();
    }
}

// Merges the chunk's list with the state's, both best first, keeping k.
fn merge_into_state(row: u32, k: u32) {
    let o = (p.row_base + row) * TOP_WORDS;
    var kept_val: array<f32, MOST>;
    var kept_id: array<u32, MOST>;
    var a = 0u;
    var b = 0u;
    for (var j = 0u; j < k; j++) {
        var sv = NEG;
        var si = NONE;
        if (a < k) {
            sv = bitcast<f32>(state[o + 2u * a]);
            si = state[o + 2u * a + 1u];
        }
        if (b < k && (a >= k || before(c_val[b], c_id[b], sv, si))) {
            kept_val[j] = c_val[b];
            kept_id[j] = c_id[b];
            b++;
        } else {
            kept_val[j] = sv;
            kept_id[j] = si;
            a++;
        }
    }
    for (var j = 0u; j < k; j++) {
        state[o + 2u * j] = bitcast<u32>(kept_val[j]);
        state[o + 2u * j + 1u] = kept_id[j];
    }
}
//#endif

//#if FINALIZE
struct Params {
    rows: u32,
    k: u32,
    // Word of `out` where row 0's alternatives start (after the choices).
    out_base: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> state: array<u32>;
// `select`'s state: words 8 and 9 of a row are its model softmax's max and sum.
@group(0) @binding(2) var<storage, read> select_state: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

const SELECT_WORDS: u32 = 10u;

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
    let k = min(p.k, MOST);
    let mx = bitcast<f32>(select_state[row * SELECT_WORDS + 8u]);
    let sum = bitcast<f32>(select_state[row * SELECT_WORDS + 9u]);
    // The same expression as `select`'s own log-probability, so the chosen id's value is
    // the same in both (without CFG bit for bit: with it each kernel combines the logits
    // itself).
    let ln_sum = ln_precise(max(sum, 1.0));
    for (var j = 0u; j < k; j++) {
        let at = p.out_base + (row * k + j) * 2u;
        let id = state[row * TOP_WORDS + 2u * j + 1u];
        out[at] = id;
        // An empty slot (fewer ids than k) keeps NEG; the host knows it by its id.
        var lp = NEG;
        if (id != NONE) {
            lp = min(bitcast<f32>(state[row * TOP_WORDS + 2u * j]) - mx - ln_sum, 0.0);
        }
        out[at + 1u] = bitcast<u32>(lp);
    }
}
//#endif
