// Grouped matmul of a mixture-of-experts FFN (docs/models/diffusion-gemma.md §4.6) over one
// weight chunk, which holds the whole matrices of experts [e0, e1) (`Weight::zeros_stacked`).
// A workgroup takes one row tile of one expert's list (moe_plan.wgsl) and one tile of output
// columns, and multiplies the tile's input rows by that expert's matrix only:
//   GELU   x = the token rows y [rows, K] gathered through the list (order[pos] / top_k),
//          W = gate_up[e] [2n, k] (gate rows then up rows); y[pos, c] = gelu_tanh(g) * u
//   else   x = the activated rows [assignments, k] in list order, W = down[e] [n, k];
//          y[pos, c] = x[pos] . W[c]
// Register tiles as in matmul.wgsl's TILED: each invocation keeps 4 rows x 4 columns of sums
// (GELU: and their 4 up sums) and reads x and W straight from global memory, four elements a
// load; W is decoded by shaders/weight_load.wgsl (appended), so every weight format works.
// Workgroups past the chunk's tiles (the grid is sized on the host for the worst case) leave
// at once. XVEC4: k % 4 == 0, x read as vec4.

struct Params {
    k: u32,           // inner dimension, the row stride of x
    n: u32,           // output columns, the row stride of y
    top_k: u32,       // GELU: slots per token row
    experts: u32,     // E (the plan's layout, moe_plan.wgsl)
    e0: u32,          // first expert of the chunk
    e1: u32,          // one past its last
    expert_rows: u32, // weight rows per expert (GELU: 2n)
    w_stride4: u32,   // weight row stride in groups of 4 elements
    s_off: u32,       // WQ8 / WQ4: word of the chunk where the scales start
    tiles_n: u32,     // column tiles
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if XVEC4
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
//#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
//#endif
// Binding 2: the weight chunk `w` (weight_load.wgsl).
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
//#if GELU
@group(0) @binding(5) var<storage, read> order: array<u32>;
//#endif

const TM: u32 = {{TM}}u;
const WGX: u32 = 16u;
const TN: u32 = WGX * 4u;

// The x row that list position `pos` reads.
fn x_row(pos: u32) -> u32 {
//#if GELU
    return order[pos] / p.top_k;
//#else
    return pos;
//#endif
}

// Quad q (elements 4q .. 4q + 3) of x row `row`, zero past k.
fn x_quad(row: u32, q: u32) -> vec4<f32> {
//#if XVEC4
    return x[row * (p.k >> 2u) + q];
//#else
    let b = row * p.k;
    let e = q * 4u;
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if e + j < p.k {
            v[j] = x[b + e + j];
        }
    }
    return v;
//#endif
}

fn dot4(r: vec4<f32>, a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(r, a), dot(r, b), dot(r, c), dot(r, d));
}

// Stores columns c .. c + 3 of list position `pos` that exist (pos < end, c + j < n).
fn store4(pos: u32, end: u32, c: u32, v: vec4<f32>) {
    if pos >= end {
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        if c + j < p.n {
            y[pos * p.n + c + j] = v[j];
        }
    }
}

@compute @workgroup_size(16, TM / 4u)
fn main(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lin = wid.x + wid.y * nwg.x;
    let ts = p.experts + 1u;
    // Row tile t of all experts' tiles: those of experts [e0, e1) are contiguous.
    let t = plan[ts + p.e0] + lin / p.tiles_n;
    if t >= plan[ts + p.e1] {
        return;
    }
    let entry = plan[2u * p.experts + 2u + t];
    let e = entry & 255u;
    let end = plan[e + 1u];
    let r0 = plan[e] + (entry >> 8u) * TM + lid.y * 4u;
    let c0 = (lin % p.tiles_n) * TN + lid.x * 4u;
    if r0 >= end || c0 >= p.n {
        return;
    }
    // Rows past the list and columns past n are clamped onto the last; never stored.
    let x0 = x_row(r0);
    let x1 = x_row(min(r0 + 1u, end - 1u));
    let x2 = x_row(min(r0 + 2u, end - 1u));
    let x3 = x_row(min(r0 + 3u, end - 1u));
    let wb = (e - p.e0) * p.expert_rows;
    let last = p.n - 1u;
    let w0 = (wb + c0) * p.w_stride4;
    let w1 = (wb + min(c0 + 1u, last)) * p.w_stride4;
    let w2 = (wb + min(c0 + 2u, last)) * p.w_stride4;
    let w3 = (wb + min(c0 + 3u, last)) * p.w_stride4;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
//#if GELU
    // The up row of output column c is row n + c of the expert.
    let u0 = w0 + p.n * p.w_stride4;
    let u1 = w1 + p.n * p.w_stride4;
    let u2 = w2 + p.n * p.w_stride4;
    let u3 = w3 + p.n * p.w_stride4;
    var b0 = vec4<f32>(0.0);
    var b1 = vec4<f32>(0.0);
    var b2 = vec4<f32>(0.0);
    var b3 = vec4<f32>(0.0);
//#endif
    let kq = (p.k + 3u) >> 2u;
    for (var q = 0u; q < kq; q++) {
        let v0 = load_w4(w0 + q);
        let v1 = load_w4(w1 + q);
        let v2 = load_w4(w2 + q);
        let v3 = load_w4(w3 + q);
        let r0q = x_quad(x0, q);
        let r1q = x_quad(x1, q);
        let r2q = x_quad(x2, q);
        let r3q = x_quad(x3, q);
        a0 += dot4(r0q, v0, v1, v2, v3);
        a1 += dot4(r1q, v0, v1, v2, v3);
        a2 += dot4(r2q, v0, v1, v2, v3);
        a3 += dot4(r3q, v0, v1, v2, v3);
//#if GELU
        let g0 = load_w4(u0 + q);
        let g1 = load_w4(u1 + q);
        let g2 = load_w4(u2 + q);
        let g3 = load_w4(u3 + q);
        b0 += dot4(r0q, g0, g1, g2, g3);
        b1 += dot4(r1q, g0, g1, g2, g3);
        b2 += dot4(r2q, g0, g1, g2, g3);
        b3 += dot4(r3q, g0, g1, g2, g3);
//#endif
    }
//#if GELU
    a0 = glu4(a0, b0);
    a1 = glu4(a1, b1);
    a2 = glu4(a2, b2);
    a3 = glu4(a3, b3);
//#endif
    store4(r0, end, c0, a0);
    store4(r0 + 1u, end, c0, a1);
    store4(r0 + 2u, end, c0, a2);
    store4(r0 + 3u, end, c0, a3);
}

//#if GELU
fn glu4(g: vec4<f32>, u: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(gelu_tanh(g.x), gelu_tanh(g.y), gelu_tanh(g.z), gelu_tanh(g.w)) * u;
}
//#endif
