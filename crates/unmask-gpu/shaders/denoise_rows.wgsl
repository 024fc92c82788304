// What DiffusionGemma's sampler needs of each canvas row (docs/models/diffusion-gemma.md §6),
// from its soft-capped logits x: with z = x / T, the argmax of z (first index on ties), the
// entropy of softmax(z), a token drawn from softmax(z) by the Gumbel-max trick over the
// counter-based stream (seed, step, row, token), and optionally softmax(z) itself, the next
// step's self-conditioning input, and the argmax's log-probability under the model's own
// softmax(x) (temperature 1). One workgroup per row; only 5 words per row go back to the
// host instead of the row's V logits. 256 invocations: the browser's limit.

struct Params {
    rows: u32,
    vocab: u32,
    temperature: f32,
    seed_lo: u32,
    seed_hi: u32,
    step: u32,
    write_probs: u32,
    // The first row of logits and stats this dispatch reads and writes: a batched step's
    // canvases share them, each canvas its own probs (and draws by its own row numbers).
    first_row: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> probs: array<f32>;
@group(0) @binding(3) var<storage, read_write> stats: array<u32>;

const WG: u32 = 256u;
const NEG: f32 = -3.0e38;

var<workgroup> w_val: array<f32, WG>;
var<workgroup> w_idx: array<u32, WG>;
var<workgroup> w_gval: array<f32, WG>;
var<workgroup> w_gidx: array<u32, WG>;
var<workgroup> w_sum: array<f32, WG>;
var<workgroup> w_sz: array<f32, WG>;
var<workgroup> w_s1: array<f32, WG>;

// Does (vb, ib) beat (va, ia)? Higher value, then lower index.
fn beats(vb: f32, ib: u32, va: f32, ia: u32) -> bool {
    return vb > va || (vb == va && ib < ia);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
) {
    let lid = lid3.x;
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = (p.first_row + row) * p.vocab;
    let out = row * p.vocab;
    // Pass 1: the largest z and, with the Gumbel noise, the drawn token.
    var best = NEG;
    var best_i = 0xffffffffu;
    var gbest = NEG;
    var gbest_i = 0xffffffffu;
    for (var v = lid; v < p.vocab; v += WG) {
        let z = logits[base + v] / p.temperature;
        if (z > best) {
            best = z;
            best_i = v;
        }
        let g = z + gumbel(hash4(p.seed_lo, p.seed_hi, p.step, row, v));
        if (g > gbest) {
            gbest = g;
            gbest_i = v;
        }
    }
    w_val[lid] = best;
    w_idx[lid] = best_i;
    w_gval[lid] = gbest;
    w_gidx[lid] = gbest_i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            if (beats(w_val[lid + s], w_idx[lid + s], w_val[lid], w_idx[lid])) {
                w_val[lid] = w_val[lid + s];
                w_idx[lid] = w_idx[lid + s];
            }
            if (beats(w_gval[lid + s], w_gidx[lid + s], w_gval[lid], w_gidx[lid])) {
                w_gval[lid] = w_gval[lid + s];
                w_gidx[lid] = w_gidx[lid + s];
            }
        }
        workgroupBarrier();
    }
    let mx = w_val[0];
    // Pass 2: S = sum exp(z - mx) and sum exp(z - mx) (z - mx): H = ln S - that / S; and
    // S1 = sum exp(x - max x) = sum exp(T (z - mx)), S itself at T = 1 (a uniform branch).
    var sum = 0.0;
    var sz = 0.0;
    var s1 = 0.0;
    let tempered = p.temperature != 1.0;
    for (var v = lid; v < p.vocab; v += WG) {
        let d = logits[base + v] / p.temperature - mx;
        let e = exp(d);
        sum += e;
        sz += e * d;
        if (tempered) {
            s1 += exp(d * p.temperature);
        }
    }
    w_sum[lid] = sum;
    w_sz[lid] = sz;
    w_s1[lid] = s1;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            w_sum[lid] += w_sum[lid + s];
            w_sz[lid] += w_sz[lid + s];
            w_s1[lid] += w_s1[lid + s];
        }
        workgroupBarrier();
    }
    let total = w_sum[0];
    let model_total = select(total, w_s1[0], tempered);
    if (p.write_probs != 0u) {
        for (var v = lid; v < p.vocab; v += WG) {
            probs[out + v] = exp(logits[base + v] / p.temperature - mx) / total;
        }
    }
    if (lid == 0u) {
        let at = (p.first_row + row) * 5u;
        stats[at] = w_idx[0];
        stats[at + 1u] = w_gidx[0];
        stats[at + 2u] = bitcast<u32>(max(ln_precise(total) - w_sz[0] / total, 0.0));
        stats[at + 3u] = bitcast<u32>(mx);
        // log softmax(x)[argmax] = -ln S1: the argmax of z is the argmax of x.
        stats[at + 4u] = bitcast<u32>(min(-ln_precise(model_total), 0.0));
    }
}
