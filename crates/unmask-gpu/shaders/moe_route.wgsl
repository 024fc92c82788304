// Mixture-of-experts routing (DiffusionGemma's router, docs/models/diffusion-gemma.md §4.6):
// for each row of router logits s [E], p = softmax(s) in f32, the K largest p (ties to the
// lower expert index), their weights renormalised to sum 1 and then each multiplied by its
// expert's scale: w_j = p_j / (sum of the chosen p) * per_expert_scale[e_j].
// One workgroup per row; ids [rows, K] in descending p, weights [rows, K] beside them.

struct Params {
    rows: u32,
    experts: u32, // E <= MAX_E
    top_k: u32,   // K <= MAX_K, K <= E
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> expert_scale: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> weights: array<f32>;

const WG: u32 = 64u;
const MAX_E: u32 = 256u;
const MAX_K: u32 = 16u;
var<workgroup> prob: array<f32, MAX_E>;
var<workgroup> red_v: array<f32, WG>;
var<workgroup> red_i: array<u32, WG>;
var<workgroup> chosen: array<u32, MAX_K>;

// (value, index) of the better of two candidates: the larger value, ties to the lower index;
// an index of MAX_E is no candidate.
fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    if bi >= MAX_E {
        return true;
    }
    if ai >= MAX_E {
        return false;
    }
    return av > bv || (av == bv && ai < bi);
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    // Every invocation reaches the barriers; a row past the end only skips the writes.
    let valid = row < p.rows;
    let r = min(row, p.rows - 1u);
    let e_count = min(p.experts, MAX_E);
    // The row's maximum, then the sum of exp(s - max): softmax as the reference takes it.
    var m = -3.0e38;
    for (var e = t; e < e_count; e += WG) {
        m = max(m, logits[r * p.experts + e]);
    }
    red_v[t] = m;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if t < s {
            red_v[t] = max(red_v[t], red_v[t + s]);
        }
        workgroupBarrier();
    }
    let row_max = red_v[0];
    workgroupBarrier();
    var sum = 0.0;
    for (var e = t; e < e_count; e += WG) {
        let x = exp(logits[r * p.experts + e] - row_max);
        prob[e] = x;
        sum += x;
    }
    red_v[t] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if t < s {
            red_v[t] += red_v[t + s];
        }
        workgroupBarrier();
    }
    let total = red_v[0];
    workgroupBarrier();
    for (var e = t; e < e_count; e += WG) {
        prob[e] = prob[e] / total;
    }
    workgroupBarrier();
    // K rounds of argmax over the experts not chosen yet.
    let k_count = min(p.top_k, MAX_K);
    for (var k = 0u; k < k_count; k++) {
        var bv = 0.0;
        var bi = MAX_E;
        for (var e = t; e < e_count; e += WG) {
            var taken = false;
            for (var j = 0u; j < k; j++) {
                taken = taken || chosen[j] == e;
            }
            if !taken && better(prob[e], e, bv, bi) {
                bv = prob[e];
                bi = e;
            }
        }
        red_v[t] = bv;
        red_i[t] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if t < s && !better(red_v[t], red_i[t], red_v[t + s], red_i[t + s]) {
                red_v[t] = red_v[t + s];
                red_i[t] = red_i[t + s];
            }
            workgroupBarrier();
        }
        if t == 0u {
            chosen[k] = red_i[0];
        }
        workgroupBarrier();
    }
    if valid && t == 0u {
        var picked = 0.0;
        for (var k = 0u; k < k_count; k++) {
            picked += prob[chosen[k]];
        }
        for (var k = 0u; k < k_count; k++) {
            let e = chosen[k];
            ids[row * p.top_k + k] = e;
            weights[row * p.top_k + k] = prob[e] / picked * expert_scale[e];
        }
    }
}
