// y = x · Wᵀ for one row chunk of a weight matrix W [N, K] (an nn.Linear weight [out, in]).
//
// x is f32 [M, K] with row stride K, y is f32 [M, N] with row stride N; this dispatch writes
// the output columns [col0, col0 + rows) that belong to the chunk. Accumulation is f32
// (HALF: f16 within one k-tile of GEMM, f32 across them; NDOT: exact integer sums of x codes
// times weight codes within a 32-element block, f32 across blocks).
//
// Flags pick the variant:
//   NAIVE / TILED / SHARED / GEMM / NARROW / NDOT / COOP  which entry point the file holds
//                           (one per spec); NDOT (integer dot products) reads WQ8 / WQ4 only
//   WF32 / WPACKED / F16    weight storage: f32, f16 pairs in u32 words, native f16
//   WQ8 / WQ4 (+ QUANT)     block-quantized weights, decoded as they are loaded
//   XVEC4                   K % 4 == 0, so x rows are 16-byte aligned and read as vec4
//   WIDE                    (TILED) 4 x 8 outputs per invocation instead of 4 x 4
// Fused prologue and epilogues (each exact up to f32 rounding order):
//   NORM      RMSNorm of the x rows folded in: W's columns are scaled by the norm weight g
//             as they are loaded, each row's sum of squares is gathered from the x values the
//             kernel reads anyway, and its 1 / rms scales the row's sums at the end:
//             y = (x / rms(x)) * g . W^T without a normalised copy of x.
//   RESIDUAL  y += x . W^T (the residual stream is y; the o-proj and down projections).
//   SWIGLU    the chunk holds gate rows then, from row up_off, the up rows of the same
//             output columns; y = silu(x . Wg^T) * (x . Wu^T). (TILED needs WIDE: its second
//             group of 4 columns holds the up sums of the first four.)
//   BK16                    (GEMM) k-tiles 16 deep instead of 8
//   COOP                    cooperative-matrix tiles (needs wgpu_cooperative_matrix, f16 and
//                           subgroups); constants SG, FR and BK
//   SPLITK                  (COOP) K split into slices of p.kt_slice k-tiles, one workgroup
//                           per tile and slice, raw partial sums into y (the split scratch);
//                           `matmul_split.wgsl` sums the slices and applies the epilogue
//   TM2                     (COOP) tiles of 2 fragment rows instead of 4, for M <= 2 FR
//   HALF                    (GEMM) f16 tiles and f16 sums within a k-tile (needs shader-f16)
// Constants (TILED): WGX x WGY invocations per workgroup.
//
// The kernels after this file's NAIVE: matmul_tiled.wgsl (TILED, SHARED), matmul_gemm.wgsl
// (GEMM), matmul_narrow.wgsl (NARROW, NDOT) and matmul_coop.wgsl (COOP), appended to it with
// weight_load.wgsl (`ops::matmul::KERNEL`): one module, one spec picks one entry point.

struct Params {
    m: u32,         // rows of x and y in use
    k: u32,         // inner dimension, also the row stride of x
    rows: u32,      // rows of this weight chunk = output columns written
    col0: u32,      // first output column of this chunk
    n: u32,         // row stride of y
    w_stride4: u32, // weight row stride in groups of 4 elements (zero padded past k)
    tiles_n: u32,   // output tiles along the columns
    tiles: u32,     // output tiles in all; workgroup ids are linearised over x and y
    s_off: u32,     // WQ8 / WQ4: word of the chunk where the scales start
    eps: f32,       // NORM: RMSNorm epsilon
    up_off: u32,    // SWIGLU: chunk row of the up row of output column 0
    kt_slice: u32,  // SPLITK: k-tiles of one slice of K
}

@group(0) @binding(0) var<uniform> p: Params;

//#if XVEC4
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
//#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
//#endif

// The weight `w` at binding 2 and its loaders (`load_w4`, `load_w1`, `codes4`, `scale_of`):
// shaders/weight_load.wgsl, appended to this file.

@group(0) @binding(3) var<storage, read_write> y: array<f32>;

//#if NORM
// The RMSNorm weight g [K]: four elements at vec4 index q, zero past K.
//#if XVEC4
@group(0) @binding(4) var<storage, read> gw: array<vec4<f32>>;

fn norm4(q: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), gw[min(q, (p.k >> 2u) - 1u)], q < (p.k >> 2u));
}
//#else
@group(0) @binding(4) var<storage, read> gw: array<f32>;

fn g_at(e: u32) -> f32 {
    return select(0.0, gw[min(e, p.k - 1u)], e < p.k);
}

fn norm4(q: u32) -> vec4<f32> {
    let e = q * 4u;
    return vec4<f32>(g_at(e), g_at(e + 1u), g_at(e + 2u), g_at(e + 3u));
}
//#endif

// 1 / rms of rows whose sums of squares are `ss`.
fn inv_rms(ss: vec4<f32>) -> vec4<f32> {
    return inverseSqrt(ss / f32(p.k) + vec4<f32>(p.eps));
}
//#endif

//#if SWIGLU
// silu(g) * u, as the reference computes it (g * sigmoid(g)).
fn glu(g: vec4<f32>, u: vec4<f32>) -> vec4<f32> {
    return g / (1.0 + exp(-g)) * u;
}
//#endif

fn tile_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

//#if !XVEC4
// One x element of a row starting at element `base`; zero past the end of the row.
fn x_at(base: u32, e: u32) -> f32 {
    return select(0.0, x[base + min(e, p.k - 1u)], e < p.k);
}
//#endif

// Dot products of one x quad with four weight quads.
fn dot4(r: vec4<f32>, a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(r, a), dot(r, b), dot(r, c), dot(r, d));
}

// Quad q (elements 4q .. 4q + 3) of x row `row`, zero past K.
fn x_quad(row: u32, q: u32) -> vec4<f32> {
//#if XVEC4
    let kq = p.k >> 2u;
    return select(vec4<f32>(0.0), x[row * kq + min(q, kq - 1u)], q < kq);
//#else
    let b = row * p.k;
    let e = q * 4u;
    return vec4<f32>(x_at(b, e), x_at(b, e + 1u), x_at(b, e + 2u), x_at(b, e + 3u));
//#endif
}

// Quad q of the weight row starting at quad `base`, zero past the row, times the norm weight
// (NORM). Quantized codes are multiplied by `sc`, the scale the caller fetched once for the
// whole block; other formats ignore it.
fn w_quad(base: u32, q: u32, sc: f32) -> vec4<f32> {
    let i = base + min(q, p.w_stride4 - 1u);
//#if QUANT
    var v = codes4(i) * sc;
//#else
    var v = load_w4(i);
//#endif
    v = select(vec4<f32>(0.0), v, q < p.w_stride4);
//#if NORM
    v *= norm4(q);
//#endif
    return v;
}


//#if NAIVE
// One output per invocation, scalar loads: the baseline every other variant is measured against.
@compute @workgroup_size(16, 16)
fn naive(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tile = tile_index(wid, nwg);
    let row = (tile / p.tiles_n) * 16u + lid.y;
    let col = (tile % p.tiles_n) * 16u + lid.x;
    if tile >= p.tiles || row >= p.m || col >= p.rows {
        return;
    }
    let xb = row * p.k;
    let wb = col * p.w_stride4 * 4u;
    var acc = 0.0;
//#if SWIGLU
    let ub = (col + p.up_off) * p.w_stride4 * 4u;
    var acc_up = 0.0;
//#endif
//#if NORM
    var ss = 0.0;
//#endif
    for (var e = 0u; e < p.k; e++) {
        var xv = x[xb + e];
//#if NORM
        ss += xv * xv;
        xv *= gw[e];
//#endif
        acc += xv * load_w1(wb + e);
//#if SWIGLU
        acc_up += xv * load_w1(ub + e);
//#endif
    }
//#if NORM
    let inv = inv_rms(vec4<f32>(ss)).x;
    acc *= inv;
//#if SWIGLU
    acc_up *= inv;
//#endif
//#endif
//#if SWIGLU
    acc = glu(vec4<f32>(acc), vec4<f32>(acc_up)).x;
//#endif
    let at = row * p.n + p.col0 + col;
//#if RESIDUAL
    y[at] += acc;
//#else
    y[at] = acc;
//#endif
}
//#endif

//#if !NAIVE
// Stores the sums of output columns c .. c + 3 of a row, skipping those past the edge.
fn store4(row: u32, c: u32, v: vec4<f32>) {
    if row >= p.m {
        return;
    }
    let base = row * p.n + p.col0;
    for (var j = 0u; j < 4u; j++) {
        if c + j < p.rows {
//#if RESIDUAL
            y[base + c + j] += v[j];
//#else
            y[base + c + j] = v[j];
//#endif
        }
    }
}

// Stores one output (tile-local column c of this chunk), skipping those past the edge.
fn store1(row: u32, c: u32, v: f32) {
    if row >= p.m || c >= p.rows {
        return;
    }
    let at = row * p.n + p.col0 + c;
//#if RESIDUAL
    y[at] += v;
//#else
    y[at] = v;
//#endif
}
//#endif
