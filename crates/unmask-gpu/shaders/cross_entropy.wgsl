// The cross-entropy of given target tokens from LM-head logits, streamed over vocabulary
// chunks like `select.wgsl`, so a scored row reads back 12 bytes instead of its vocabulary.
//
// Per row a state of three f32 carries, across chunks: the running max m of the row's
// logits, S = sum exp(l - m), and the target's logit (NEG until its chunk comes). The host
// finishes -log p(target) = m + ln S - l_target in f64.
//
// One workgroup per row. Flags: CFG (unconditional logits bound; the row's logits are
// u + (cfg_scale + 1)(c - u), as generation guides them) and FIRST (the first chunk writes
// the state instead of merging into it, so no reset pass is needed).

// Finite "minus infinity": exp of it minus any real max is 0.
const NEG: f32 = -3.0e38;

struct Params {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    // Row of `targets` and `state` for row 0 of `logits`.
    row_base: u32,
    cfg_scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> state: array<f32>;
//#if CFG
@group(0) @binding(4) var<storage, read> uncond: array<f32>;
//#endif

const WG: u32 = 256u;

var<workgroup> w_max: array<f32, WG>;
var<workgroup> w_sum: array<f32, WG>;
var<workgroup> w_target: array<f32, WG>;

// S of one side rescaled to the common max m >= its own; the clamp keeps an empty side
// (max NEG, S 0) exactly 0.
fn rescaled(side_max: f32, side_sum: f32, m: f32) -> f32 {
    return side_sum * exp(max(side_max - m, NEG));
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
    let wanted = targets[srow];
    var mx = NEG;
    var sum = 0.0;
    var hit = NEG;
    for (var v = lid; v < p.n; v += WG) {
        var l = logits[base + v];
        //#if CFG
        let u = uncond[base + v];
        l = u + (p.cfg_scale + 1.0) * (l - u);
        //#endif
        if (p.vocab_offset + v == wanted) {
            hit = l;
        }
        if (l > mx) {
            sum = rescaled(mx, sum, l) + 1.0;
            mx = l;
        } else {
            sum += exp(l - mx);
        }
    }
    w_max[lid] = mx;
    w_sum[lid] = sum;
    w_target[lid] = hit;
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        workgroupBarrier();
        if (lid < stride) {
            let m = max(w_max[lid], w_max[lid + stride]);
            w_sum[lid] = rescaled(w_max[lid], w_sum[lid], m)
                + rescaled(w_max[lid + stride], w_sum[lid + stride], m);
            w_max[lid] = m;
            // At most one invocation of all saw the target; the others hold NEG.
            w_target[lid] = max(w_target[lid], w_target[lid + stride]);
        }
    }
    if (lid == 0u) {
        var m = w_max[0];
        var s = w_sum[0];
        var t = w_target[0];
        //#if !FIRST
        let o = 3u * srow;
        let old_max = state[o];
        let merged = max(m, old_max);
        s = rescaled(m, s, merged) + rescaled(old_max, state[o + 1u], merged);
        m = merged;
        t = max(t, state[o + 2u]);
        //#endif
        state[3u * srow] = m;
        state[3u * srow + 1u] = s;
        state[3u * srow + 2u] = t;
    }
}
