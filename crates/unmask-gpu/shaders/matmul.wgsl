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

//#if TILED
// Register tiling without workgroup memory: each invocation keeps 4 rows x 4 columns of sums
// (4 x 8 with WIDE) and reads its rows of x and W straight from global memory, four elements
// per load. Software rasterisers run a workgroup on one CPU thread, where barriers cost more
// than re-reading cached global memory. Written out by hand: loops over local arrays were
// not unrolled by lavapipe and ran 1.3-1.5x slower.
const WGX: u32 = {{WGX}}u;
const WGY: u32 = {{WGY}}u;
// Output columns per invocation (with SWIGLU the second four sums are their up halves).
//#if WIDE
//#if SWIGLU
const TN: u32 = 4u;
//#else
const TN: u32 = 8u;
//#endif
//#else
const TN: u32 = 4u;
//#endif

// Four consecutive elements of a row of x, starting at vec4 index q of the row at `b`.
fn x_row4(b: u32, q: u32) -> vec4<f32> {
//#if XVEC4
    return x[b + q];
//#else
    let e = q * 4u;
    if e + 4u <= p.k {
        return vec4<f32>(x[b + e], x[b + e + 1u], x[b + e + 2u], x[b + e + 3u]);
    }
    // The last 1-3 elements of a row; W is zero padded there, x must be masked.
    return vec4<f32>(x_at(b, e), x_at(b, e + 1u), x_at(b, e + 2u), 0.0);
//#endif
}

@compute @workgroup_size(WGX, WGY)
fn tiled(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tile = tile_index(wid, nwg);
    let row0 = (tile / p.tiles_n) * (WGY * 4u) + lid.y * 4u;
    let c0 = (tile % p.tiles_n) * (WGX * TN) + lid.x * TN;
    if tile >= p.tiles || row0 >= p.m || c0 >= p.rows {
        return;
    }
    // Rows and columns past the edge are clamped onto the last one; their sums are not stored.
//#if XVEC4
    let xs = p.k >> 2u;
//#else
    let xs = p.k;
//#endif
    let x0 = min(row0, p.m - 1u) * xs;
    let x1 = min(row0 + 1u, p.m - 1u) * xs;
    let x2 = min(row0 + 2u, p.m - 1u) * xs;
    let x3 = min(row0 + 3u, p.m - 1u) * xs;
    let last = p.rows - 1u;
    let w0 = min(c0, last) * p.w_stride4;
    let w1 = min(c0 + 1u, last) * p.w_stride4;
    let w2 = min(c0 + 2u, last) * p.w_stride4;
    let w3 = min(c0 + 3u, last) * p.w_stride4;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
//#if WIDE
//#if SWIGLU
    let w4 = (min(c0, last) + p.up_off) * p.w_stride4;
    let w5 = (min(c0 + 1u, last) + p.up_off) * p.w_stride4;
    let w6 = (min(c0 + 2u, last) + p.up_off) * p.w_stride4;
    let w7 = (min(c0 + 3u, last) + p.up_off) * p.w_stride4;
//#else
    let w4 = min(c0 + 4u, last) * p.w_stride4;
    let w5 = min(c0 + 5u, last) * p.w_stride4;
    let w6 = min(c0 + 6u, last) * p.w_stride4;
    let w7 = min(c0 + 7u, last) * p.w_stride4;
//#endif
    var b0 = vec4<f32>(0.0);
    var b1 = vec4<f32>(0.0);
    var b2 = vec4<f32>(0.0);
    var b3 = vec4<f32>(0.0);
//#endif
//#if NORM
    var ss = vec4<f32>(0.0);
//#endif
    let kq = (p.k + 3u) >> 2u;
    for (var q = 0u; q < kq; q++) {
        let v0 = load_w4(w0 + q);
        let v1 = load_w4(w1 + q);
        let v2 = load_w4(w2 + q);
        let v3 = load_w4(w3 + q);
//#if WIDE
        let v4 = load_w4(w4 + q);
        let v5 = load_w4(w5 + q);
        let v6 = load_w4(w6 + q);
        let v7 = load_w4(w7 + q);
//#endif
//#if NORM
        let n0 = x_row4(x0, q);
        let n1 = x_row4(x1, q);
        let n2 = x_row4(x2, q);
        let n3 = x_row4(x3, q);
        ss += vec4<f32>(dot(n0, n0), dot(n1, n1), dot(n2, n2), dot(n3, n3));
        let g = norm4(q);
        let r0 = n0 * g;
        let r1 = n1 * g;
        let r2 = n2 * g;
        let r3 = n3 * g;
//#else
        let r0 = x_row4(x0, q);
        let r1 = x_row4(x1, q);
        let r2 = x_row4(x2, q);
        let r3 = x_row4(x3, q);
//#endif
        a0 += dot4(r0, v0, v1, v2, v3);
        a1 += dot4(r1, v0, v1, v2, v3);
        a2 += dot4(r2, v0, v1, v2, v3);
        a3 += dot4(r3, v0, v1, v2, v3);
//#if WIDE
        b0 += dot4(r0, v4, v5, v6, v7);
        b1 += dot4(r1, v4, v5, v6, v7);
        b2 += dot4(r2, v4, v5, v6, v7);
        b3 += dot4(r3, v4, v5, v6, v7);
//#endif
    }
//#if NORM
    let inv = inv_rms(ss);
    a0 *= inv.x;
    a1 *= inv.y;
    a2 *= inv.z;
    a3 *= inv.w;
//#if WIDE
    b0 *= inv.x;
    b1 *= inv.y;
    b2 *= inv.z;
    b3 *= inv.w;
//#endif
//#endif
//#if SWIGLU
    store4(row0, c0, glu(a0, b0));
    store4(row0 + 1u, c0, glu(a1, b1));
    store4(row0 + 2u, c0, glu(a2, b2));
    store4(row0 + 3u, c0, glu(a3, b3));
//#else
    store4(row0, c0, a0);
    store4(row0 + 1u, c0, a1);
    store4(row0 + 2u, c0, a2);
    store4(row0 + 3u, c0, a3);
//#if WIDE
    store4(row0, c0 + 4u, b0);
    store4(row0 + 1u, c0 + 4u, b1);
    store4(row0 + 2u, c0 + 4u, b2);
    store4(row0 + 3u, c0 + 4u, b3);
//#endif
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

//#if SHARED
// Classic shared-memory tiling: 256 invocations stage a 64-row tile of x and a 64-row tile of
// W, 16 elements deep, in workgroup memory (8 KiB), then each computes a 4 x 4 block from it.
// The tiles are stored k-major so one vec4 read gives four consecutive rows.
const BM: u32 = 64u;
const BK: u32 = 16u;
var<workgroup> xs: array<vec4<f32>, 256>; // [BK][BM / 4]
var<workgroup> ws: array<vec4<f32>, 256>; // [BK][BN / 4]
//#if SWIGLU
var<workgroup> us: array<vec4<f32>, 256>; // the up rows, as ws
//#endif

@compute @workgroup_size(16, 16)
fn tiled_shared(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // Out-of-range workgroups still take part in the barriers; only their stores are skipped.
    let tile = min(tile_index(wid, nwg), p.tiles - 1u);
    let tile_row0 = (tile / p.tiles_n) * BM;
    let tile_col0 = (tile % p.tiles_n) * BM;
    // Loader role: invocation t fetches 4 consecutive k of row t / 4 for both tiles.
    let lr = t >> 2u;
    let lq = t & 3u;
    let x_row = min(tile_row0 + lr, p.m - 1u);
    let w_row = min(tile_col0 + lr, p.rows - 1u);
    let slot = lr >> 2u;
    let lane = lr & 3u;

    var acc: array<vec4<f32>, 4>;
//#if SWIGLU
    var acc_up: array<vec4<f32>, 4>;
    let u_row = w_row + p.up_off;
//#endif
//#if NORM
    var ss = vec4<f32>(0.0);
//#endif
    let k_tiles = (p.k + BK - 1u) / BK;
    for (var kt = 0u; kt < k_tiles; kt++) {
        let q = kt * (BK / 4u) + lq; // vec4 index along k
//#if XVEC4
        let xv = select(vec4<f32>(0.0), x[x_row * (p.k >> 2u) + min(q, (p.k >> 2u) - 1u)], q < (p.k >> 2u));
//#else
        let xb = x_row * p.k;
        let e = q * 4u;
        let xv = vec4<f32>(x_at(xb, e), x_at(xb, e + 1u), x_at(xb, e + 2u), x_at(xb, e + 3u));
//#endif
        var wv = select(vec4<f32>(0.0), load_w4(w_row * p.w_stride4 + min(q, p.w_stride4 - 1u)), q < p.w_stride4);
//#if SWIGLU
        var uv = select(vec4<f32>(0.0), load_w4(u_row * p.w_stride4 + min(q, p.w_stride4 - 1u)), q < p.w_stride4);
//#endif
//#if NORM
        // The norm weight scales W's columns; x stays raw for the sum of squares.
        let g = norm4(q);
        wv *= g;
//#if SWIGLU
        uv *= g;
//#endif
//#endif
        let at = lq * BM + slot; // row lq * 4 of the k-major tile
        xs[at][lane] = xv.x;
        ws[at][lane] = wv.x;
        xs[at + BM / 4u][lane] = xv.y;
        ws[at + BM / 4u][lane] = wv.y;
        xs[at + BM / 2u][lane] = xv.z;
        ws[at + BM / 2u][lane] = wv.z;
        xs[at + 3u * BM / 4u][lane] = xv.w;
        ws[at + 3u * BM / 4u][lane] = wv.w;
//#if SWIGLU
        us[at][lane] = uv.x;
        us[at + BM / 4u][lane] = uv.y;
        us[at + BM / 2u][lane] = uv.z;
        us[at + 3u * BM / 4u][lane] = uv.w;
//#endif
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let a = xs[kk * (BM / 4u) + lid.y];
            let b = ws[kk * (BM / 4u) + lid.x];
            acc[0] += a.x * b;
            acc[1] += a.y * b;
            acc[2] += a.z * b;
            acc[3] += a.w * b;
//#if SWIGLU
            let bu = us[kk * (BM / 4u) + lid.x];
            acc_up[0] += a.x * bu;
            acc_up[1] += a.y * bu;
            acc_up[2] += a.z * bu;
            acc_up[3] += a.w * bu;
//#endif
//#if NORM
            ss += a * a;
//#endif
        }
        workgroupBarrier();
    }
    if tile_index(wid, nwg) >= p.tiles {
        return;
    }
    let c = tile_col0 + lid.x * 4u;
    let r = tile_row0 + lid.y * 4u;
//#if NORM
    let inv = inv_rms(ss);
    for (var i = 0u; i < 4u; i++) {
        acc[i] *= inv[i];
//#if SWIGLU
        acc_up[i] *= inv[i];
//#endif
    }
//#endif
//#if SWIGLU
    for (var i = 0u; i < 4u; i++) {
        acc[i] = glu(acc[i], acc_up[i]);
    }
//#endif
    store4(r, c, acc[0]);
    store4(r + 1u, c, acc[1]);
    store4(r + 2u, c, acc[2]);
    store4(r + 3u, c, acc[3]);
}
//#endif

//#if GEMM
// Large M: 128 x 128 output tiles (128 x 64 with SWIGLU, whose weight tile holds 64 gate rows
// then the 64 up rows of the same columns), 256 invocations of 8 x 8 outputs each: rows
// 4 ty .. +3 and 64 + 4 ty .. +3, columns 4 tx .. +3 and 64 + 4 tx .. +3, so every read of
// workgroup memory is one vec4 and the 16 invocations along x read 256 consecutive bytes.
// Tiles of x and W, BK deep, are stored k-major in two buffers: the next k-tile is fetched
// into registers while the current one is multiplied, then stored into the other buffer, so
// a k-tile costs one barrier. Loader invocation t owns tile row t % 128, so a subgroup's 32
// stores of one k hit 32 consecutive words (distinct banks) without padding, which keeps
// 2 x 2 x 8 x 128 f32 at 16 KiB, the browser limit.
// BK16: 16 deep, where the device has the workgroup memory for it.
// HALF: the tiles hold f16 and the products are summed in f16 over one k-tile (BK terms),
// then added into f32 sums; the error is f16 rounding of x and W plus a BK-term f16 sum.
//#if HALF
alias GT = f16;
//#else
alias GT = f32;
//#endif
//#if BK16
const BK: u32 = 16u;
//#else
const BK: u32 = 8u;
//#endif
// [buffer][k][row / 4]
var<workgroup> ga: array<vec4<GT>, 2u * BK * 32u>;
var<workgroup> gb: array<vec4<GT>, 2u * BK * 32u>;

// Stores the x and W quads of loader row `lr` at quad `lq` of the k-tile in buffer `buf`.
fn gemm_store(buf: u32, lq: u32, lr: u32, xv: vec4<f32>, wv: vec4<f32>) {
    let at = (buf * BK + lq * 4u) * 32u + (lr >> 2u);
    let lane = lr & 3u;
    ga[at][lane] = GT(xv.x);
    ga[at + 32u][lane] = GT(xv.y);
    ga[at + 64u][lane] = GT(xv.z);
    ga[at + 96u][lane] = GT(xv.w);
    gb[at][lane] = GT(wv.x);
    gb[at + 32u][lane] = GT(wv.y);
    gb[at + 64u][lane] = GT(wv.z);
    gb[at + 96u][lane] = GT(wv.w);
}

@compute @workgroup_size(16, 16)
fn gemm(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // Out-of-range workgroups still take part in the barriers; only their stores are skipped.
    let tile = min(tile_index(wid, nwg), p.tiles - 1u);
    let row0 = (tile / p.tiles_n) * 128u;
    let lr = t & 127u;
    let lq = t >> 7u; // first quad of each k-tile this invocation loads (and lq + 2 with BK16)
    let x_row = min(row0 + lr, p.m - 1u);
//#if SWIGLU
    let col0 = (tile % p.tiles_n) * 64u;
    let w_row = min(col0 + (lr & 63u), p.rows - 1u) + select(0u, p.up_off, lr >= 64u);
//#else
    let col0 = (tile % p.tiles_n) * 128u;
    let w_row = min(col0 + lr, p.rows - 1u);
//#endif
    let wb = w_row * p.w_stride4;
//#if QUANT
    // A k-tile lies inside one 32-element block, so the scale is fetched once per block.
    let blocks = p.w_stride4 >> 3u;
    var sc = scale_of(w_row * blocks);
//#else
    let sc = 1.0;
//#endif
    var xv0 = x_quad(x_row, lq);
    var wv0 = w_quad(wb, lq, sc);
    gemm_store(0u, lq, lr, xv0, wv0);
//#if BK16
    var xv1 = x_quad(x_row, lq + 2u);
    var wv1 = w_quad(wb, lq + 2u, sc);
    gemm_store(0u, lq + 2u, lr, xv1, wv1);
//#endif
    workgroupBarrier();

//#if HALF
    var f0 = vec4<f32>(0.0);
    var f1 = vec4<f32>(0.0);
    var f2 = vec4<f32>(0.0);
    var f3 = vec4<f32>(0.0);
    var f4 = vec4<f32>(0.0);
    var f5 = vec4<f32>(0.0);
    var f6 = vec4<f32>(0.0);
    var f7 = vec4<f32>(0.0);
    var f8 = vec4<f32>(0.0);
    var f9 = vec4<f32>(0.0);
    var f10 = vec4<f32>(0.0);
    var f11 = vec4<f32>(0.0);
    var f12 = vec4<f32>(0.0);
    var f13 = vec4<f32>(0.0);
    var f14 = vec4<f32>(0.0);
    var f15 = vec4<f32>(0.0);
//#else
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    var s2 = vec4<f32>(0.0);
    var s3 = vec4<f32>(0.0);
    var s4 = vec4<f32>(0.0);
    var s5 = vec4<f32>(0.0);
    var s6 = vec4<f32>(0.0);
    var s7 = vec4<f32>(0.0);
    var s8 = vec4<f32>(0.0);
    var s9 = vec4<f32>(0.0);
    var s10 = vec4<f32>(0.0);
    var s11 = vec4<f32>(0.0);
    var s12 = vec4<f32>(0.0);
    var s13 = vec4<f32>(0.0);
    var s14 = vec4<f32>(0.0);
    var s15 = vec4<f32>(0.0);
//#endif
//#if NORM
    var ssa = vec4<f32>(0.0);
    var ssb = vec4<f32>(0.0);
//#endif
    let k_tiles = (p.k + BK - 1u) / BK;
    for (var kt = 0u; kt < k_tiles; kt++) {
        let cur = kt & 1u;
        let next = kt + 1u;
        if next < k_tiles {
            let q = next * (BK / 4u) + lq;
//#if QUANT
            if (next * BK) % 32u == 0u {
                sc = scale_of(w_row * blocks + min(next * BK / 32u, blocks - 1u));
            }
//#endif
            xv0 = x_quad(x_row, q);
            wv0 = w_quad(wb, q, sc);
//#if BK16
            xv1 = x_quad(x_row, q + 2u);
            wv1 = w_quad(wb, q + 2u, sc);
//#endif
        }
//#if HALF
        var s0 = vec4<f16>(0.0);
        var s1 = vec4<f16>(0.0);
        var s2 = vec4<f16>(0.0);
        var s3 = vec4<f16>(0.0);
        var s4 = vec4<f16>(0.0);
        var s5 = vec4<f16>(0.0);
        var s6 = vec4<f16>(0.0);
        var s7 = vec4<f16>(0.0);
        var s8 = vec4<f16>(0.0);
        var s9 = vec4<f16>(0.0);
        var s10 = vec4<f16>(0.0);
        var s11 = vec4<f16>(0.0);
        var s12 = vec4<f16>(0.0);
        var s13 = vec4<f16>(0.0);
        var s14 = vec4<f16>(0.0);
        var s15 = vec4<f16>(0.0);
//#endif
        for (var kk = 0u; kk < BK; kk++) {
            let at = (cur * BK + kk) * 32u;
            let a = ga[at + lid.y];
            let a2 = ga[at + 16u + lid.y];
            let b = gb[at + lid.x];
            let b2 = gb[at + 16u + lid.x];
            s0 += a.x * b;
            s1 += a.y * b;
            s2 += a.z * b;
            s3 += a.w * b;
            s4 += a.x * b2;
            s5 += a.y * b2;
            s6 += a.z * b2;
            s7 += a.w * b2;
            s8 += a2.x * b;
            s9 += a2.y * b;
            s10 += a2.z * b;
            s11 += a2.w * b;
            s12 += a2.x * b2;
            s13 += a2.y * b2;
            s14 += a2.z * b2;
            s15 += a2.w * b2;
//#if NORM
            // Every invocation of a row of the grid repeats these 8 sums; cheaper than a
            // reduction through workgroup memory, which the double buffers leave no room for.
            let fa = vec4<f32>(a);
            let fa2 = vec4<f32>(a2);
            ssa += fa * fa;
            ssb += fa2 * fa2;
//#endif
        }
//#if HALF
        f0 += vec4<f32>(s0);
        f1 += vec4<f32>(s1);
        f2 += vec4<f32>(s2);
        f3 += vec4<f32>(s3);
        f4 += vec4<f32>(s4);
        f5 += vec4<f32>(s5);
        f6 += vec4<f32>(s6);
        f7 += vec4<f32>(s7);
        f8 += vec4<f32>(s8);
        f9 += vec4<f32>(s9);
        f10 += vec4<f32>(s10);
        f11 += vec4<f32>(s11);
        f12 += vec4<f32>(s12);
        f13 += vec4<f32>(s13);
        f14 += vec4<f32>(s14);
        f15 += vec4<f32>(s15);
//#endif
        if next < k_tiles {
            gemm_store(1u - cur, lq, lr, xv0, wv0);
//#if BK16
            gemm_store(1u - cur, lq + 2u, lr, xv1, wv1);
//#endif
        }
        workgroupBarrier();
    }
    if tile_index(wid, nwg) >= p.tiles {
        return;
    }
    // o[i]: row 4 ty + i, low columns; o[4 + i] its high columns; o[8 + i], o[12 + i]: row
    // 64 + 4 ty + i.
//#if HALF
    var o = array<vec4<f32>, 16>(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15);
//#else
    var o = array<vec4<f32>, 16>(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15);
//#endif
//#if NORM
    let ia = inv_rms(ssa);
    let ib = inv_rms(ssb);
    for (var i = 0u; i < 4u; i++) {
        o[i] *= ia[i];
        o[4u + i] *= ia[i];
        o[8u + i] *= ib[i];
        o[12u + i] *= ib[i];
    }
//#endif
    let r = row0 + lid.y * 4u;
    let c = col0 + lid.x * 4u;
    for (var i = 0u; i < 4u; i++) {
//#if SWIGLU
        store4(r + i, c, glu(o[i], o[4u + i]));
        store4(r + 64u + i, c, glu(o[8u + i], o[12u + i]));
//#else
        store4(r + i, c, o[i]);
        store4(r + i, c + 64u, o[4u + i]);
        store4(r + 64u + i, c, o[8u + i]);
        store4(r + 64u + i, c + 64u, o[12u + i]);
//#endif
    }
}
//#endif

//#if NARROW
// Small M (the cached modes' steady state): a workgroup computes 32 rows x 16 weight rows
// (16 output columns; 8 with SWIGLU, whose tile holds 8 gate then the 8 up rows), so the
// workgroup count follows N, and M only in steps of 32. To keep 256 invocations busy on so
// few outputs they split K eight ways: invocation (s, cg, rg) sums quads s and s + 8 of
// every 64-deep chunk for rows 4 rg .. +3 and weight rows 4 cg .. +3; the eight partial sums
// are added in workgroup memory at the end. Each chunk of W is decoded once into workgroup
// memory and read by all 32 rows; a loader decodes 8 elements of one quantization block
// with one scale. Reads of a quarter subgroup (8 slices) are 8 consecutive vec4s.
const NQ: u32 = 16u; // quads per chunk
var<workgroup> nx: array<vec4<f32>, 512>; // x chunk [32 rows][NQ]; then 4 x [32 rows][4] sums
var<workgroup> nw: array<vec4<f32>, 256>; // W chunk [16 rows][NQ]
//#if NORM
var<workgroup> nss: array<vec4<f32>, 64>; // [slice][row group]: partial sums of squares
//#endif

@compute @workgroup_size(256)
fn narrow(
    @builtin(local_invocation_index) t: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tile = min(tile_index(wid, nwg), p.tiles - 1u);
    let row0 = (tile / p.tiles_n) * 32u;
    // Loader roles: x quad t % 16 of tile rows t / 16 and 16 + t / 16; for t < 128, W quads
    // 2 (t % 8) and 2 (t % 8) + 1 of tile row t / 8.
    let xq = t & 15u;
    let xr = t >> 4u;
    let x_row0 = min(row0 + xr, p.m - 1u);
    let x_row1 = min(row0 + 16u + xr, p.m - 1u);
    let loads_w = t < 128u;
    let wr = (t >> 3u) & 15u;
    let wq = (t & 7u) * 2u;
//#if SWIGLU
    let col0 = (tile % p.tiles_n) * 8u;
    let w_row = min(col0 + (wr & 7u), p.rows - 1u) + select(0u, p.up_off, wr >= 8u);
//#else
    let col0 = (tile % p.tiles_n) * 16u;
    let w_row = min(col0 + wr, p.rows - 1u);
//#endif
    let wb = w_row * p.w_stride4;
//#if QUANT
    let blocks = p.w_stride4 >> 3u;
//#endif
    // Compute roles.
    let s = t & 7u;
    let cg = (t >> 3u) & 3u;
    let rg = t >> 5u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
//#if NORM
    var ss = vec4<f32>(0.0);
//#endif
    let chunks = (p.k + 63u) / 64u;
    for (var ch = 0u; ch < chunks; ch++) {
        let q0 = ch * NQ;
        nx[xr * NQ + xq] = x_quad(x_row0, q0 + xq);
        nx[(16u + xr) * NQ + xq] = x_quad(x_row1, q0 + xq);
        if loads_w {
            let q = q0 + wq;
//#if QUANT
            let sc = scale_of(w_row * blocks + min(q >> 3u, blocks - 1u));
//#else
            let sc = 1.0;
//#endif
            nw[wr * NQ + wq] = w_quad(wb, q, sc);
            nw[wr * NQ + wq + 1u] = w_quad(wb, q + 1u, sc);
        }
        workgroupBarrier();
        for (var u = 0u; u < 2u; u++) {
            let q = s + 8u * u;
            let xa = rg * 4u * NQ + q;
            let x0 = nx[xa];
            let x1 = nx[xa + NQ];
            let x2 = nx[xa + 2u * NQ];
            let x3 = nx[xa + 3u * NQ];
            let wa = cg * 4u * NQ + q;
            let w0 = nw[wa];
            let w1 = nw[wa + NQ];
            let w2 = nw[wa + 2u * NQ];
            let w3 = nw[wa + 3u * NQ];
            a0 += dot4(x0, w0, w1, w2, w3);
            a1 += dot4(x1, w0, w1, w2, w3);
            a2 += dot4(x2, w0, w1, w2, w3);
            a3 += dot4(x3, w0, w1, w2, w3);
//#if NORM
            ss += vec4<f32>(dot(x0, x0), dot(x1, x1), dot(x2, x2), dot(x3, x3));
//#endif
        }
        workgroupBarrier();
    }
    // Slices 4..7 store their sums, 0..3 add theirs onto them: four sets of [row][column
    // group] in nx, which the last barrier freed.
    let red = rg * 16u + cg;
    if s >= 4u {
        let b = (s - 4u) * 128u + red;
        nx[b] = a0;
        nx[b + 4u] = a1;
        nx[b + 8u] = a2;
        nx[b + 12u] = a3;
    }
//#if NORM
    if cg == 0u {
        nss[s * 8u + rg] = ss;
    }
//#endif
    workgroupBarrier();
    if s < 4u {
        let b = s * 128u + red;
        nx[b] += a0;
        nx[b + 4u] += a1;
        nx[b + 8u] += a2;
        nx[b + 12u] += a3;
    }
    workgroupBarrier();
    if tile_index(wid, nwg) >= p.tiles {
        return;
    }
    // Epilogue: invocation t finishes tile row t / 8.
    let r = t >> 3u;
    let row = row0 + r;
//#if NORM
    var sq = 0.0;
    for (var i = 0u; i < 8u; i++) {
        sq += nss[i * 8u + (r >> 2u)][r & 3u];
    }
    let inv = inv_rms(vec4<f32>(sq)).x;
//#else
    let inv = 1.0;
//#endif
//#if SWIGLU
    let c = t & 7u;
    var g = 0.0;
    var up = 0.0;
    for (var i = 0u; i < 4u; i++) {
        let b = i * 128u + r * 4u;
        g += nx[b + (c >> 2u)][c & 3u];
        up += nx[b + 2u + (c >> 2u)][c & 3u];
    }
    store1(row, col0 + c, glu(vec4<f32>(g * inv), vec4<f32>(up * inv)).x);
//#else
    for (var j = 0u; j < 2u; j++) {
        let c = (t & 7u) * 2u + j;
        var v = 0.0;
        for (var i = 0u; i < 4u; i++) {
            v += nx[i * 128u + r * 4u + (c >> 2u)][c & 3u];
        }
        store1(row, col0 + c, v * inv);
    }
//#endif
}
//#endif

//#if NDOT
// Integer dot products for quantized weights at small M: the tile of `narrow` (32 rows x 16
// weight rows, 8 gate then 8 up rows with SWIGLU; 256 invocations splitting K eight ways),
// but the weights are never converted to float. Their i8 codes (q8 as stored, q4 nibbles
// re-biased to signed bytes with bit operations) go straight into dot4I8Packed against x
// codes, which x gets as it is staged: per row and 32-element block, sx = max|x| / 127 and
// codes round(x / sx) in -127..127. A block's integer sum is exact (|sum| <= 32 * 127^2); it
// is scaled by sx * sw into the f32 sums. NORM multiplies x by the norm weight g before it
// is quantized (g cannot be folded into integer weight codes); the sums of squares come from
// the raw f32 x and 1 / rms scales the sums at the end, as in the other kernels. The error
// is that of x's codes: each element is off by at most sx / 2 = max|x_block| / 254.
// K is staged 256 deep (8 blocks). Invocation t quantizes block t % 8 of tile row t / 8 and
// loads half (t / 8 % 2) of block t % 8 of weight row t / 16; then invocation (s, cg, rg)
// multiplies block s for tile rows 4 rg .. +3 and weight rows 4 cg .. +3. Codes are stored
// [row][half][block], so the 8 blocks a quarter subgroup reads are 8 consecutive vec4s.
// Without a hardware integer dot product the backends expand dot4I8Packed into byte
// extracts and multiplies; it stays exact.
// x codes [32 rows][2 halves][8 blocks]; after the loop, 4 x [32 rows][4] sums as f32 bits.
var<workgroup> dx: array<vec4<u32>, 512>;
var<workgroup> dw: array<vec4<u32>, 256>; // W codes [16 rows][2 halves][8 blocks]
var<workgroup> dxs: array<f32, 256>;      // x scales [32 rows][8 blocks]; NORM: then sums of x^2
var<workgroup> dws: array<f32, 128>;      // W scales [16 rows][8 blocks]

// Four x values already multiplied by 127 / max as four signed bytes.
fn x_word(v: vec4<f32>) -> u32 {
    return pack4xI8(vec4<i32>(clamp(round(v), vec4<f32>(-127.0), vec4<f32>(127.0))));
}

// The codes of x elements 8j .. 8j + 7 of a block (quads a and b) as two words, in the
// order of the weight words they meet: q8 words hold 4 consecutive elements; a q4 word
// holds 8, which become the even then the odd ones (`q4_even`, `q4_odd`).
fn x_words(a: vec4<f32>, b: vec4<f32>) -> vec2<u32> {
//#if WQ4
    return vec2<u32>(x_word(vec4<f32>(a.xz, b.xz)), x_word(vec4<f32>(a.yw, b.yw)));
//#else
    return vec2<u32>(x_word(a), x_word(b));
//#endif
}

//#if WQ4
// Nibbles 0, 2, 4, 6 (code + 8, 0..15) of a q4 word as four signed bytes code: adding 0x78
// to each byte (no carry out of it) then flipping its top bit subtracts 8.
fn q4_even(v: u32) -> u32 {
    return ((v & 0x0f0f0f0fu) + 0x78787878u) ^ 0x80808080u;
}

// Nibbles 1, 3, 5, 7, as `q4_even`.
fn q4_odd(v: u32) -> u32 {
    return (((v >> 4u) & 0x0f0f0f0fu) + 0x78787878u) ^ 0x80808080u;
}
//#endif

// The integer dot product of one block of x codes (a0, a1) with one of W codes (b0, b1).
fn block_dot(a0: vec4<u32>, a1: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>) -> i32 {
    return dot4I8Packed(a0.x, b0.x) + dot4I8Packed(a0.y, b0.y) + dot4I8Packed(a0.z, b0.z)
        + dot4I8Packed(a0.w, b0.w) + dot4I8Packed(a1.x, b1.x) + dot4I8Packed(a1.y, b1.y)
        + dot4I8Packed(a1.z, b1.z) + dot4I8Packed(a1.w, b1.w);
}

// Block sums of one x row (codes a0, a1, scale sx) with four weight rows, scaled.
fn block_dot4(
    a0: vec4<u32>, a1: vec4<u32>, sx: f32,
    w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>,
    w4: vec4<u32>, w5: vec4<u32>, w6: vec4<u32>, w7: vec4<u32>,
    sw: vec4<f32>,
) -> vec4<f32> {
    let d = vec4<i32>(
        block_dot(a0, a1, w0, w1),
        block_dot(a0, a1, w2, w3),
        block_dot(a0, a1, w4, w5),
        block_dot(a0, a1, w6, w7),
    );
    return vec4<f32>(d) * (sx * sw);
}

// The partial sums at `i` of the reduction after the main loop.
fn dsum(i: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(dx[i]);
}

@compute @workgroup_size(256)
fn narrow_dot(
    @builtin(local_invocation_index) t: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tile = min(tile_index(wid, nwg), p.tiles - 1u);
    let row0 = (tile / p.tiles_n) * 32u;
    // Loader roles: x block xb of tile row xr; half wh of W block wbk of tile weight row wr.
    let xb = t & 7u;
    let xr = t >> 3u;
    let x_row = row0 + xr;
    let wbk = t & 7u;
    let wh = (t >> 3u) & 1u;
    let wr = t >> 4u;
//#if SWIGLU
    let col0 = (tile % p.tiles_n) * 8u;
    let w_row = min(col0 + (wr & 7u), p.rows - 1u) + select(0u, p.up_off, wr >= 8u);
//#else
    let col0 = (tile % p.tiles_n) * 16u;
    let w_row = min(col0 + wr, p.rows - 1u);
//#endif
    let blocks = p.w_stride4 >> 3u; // blocks of a stored (padded) weight row
    let k_blocks = (p.k + 31u) / 32u;
    // Compute roles.
    let s = t & 7u;
    let cg = (t >> 3u) & 3u;
    let rg = t >> 5u;
    // Row groups wholly past M skip the products (their sums are never stored).
    let rows_live = row0 + rg * 4u < p.m;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
//#if NORM
    var ss = 0.0;
//#endif
    let chunks = (k_blocks + 7u) / 8u;
    for (var ch = 0u; ch < chunks; ch++) {
        let blk = ch * 8u + xb;
        // Quantize x block blk of row x_row; rows past M get zero codes.
        var c0 = vec2<u32>(0u);
        var c1 = vec2<u32>(0u);
        var c2 = vec2<u32>(0u);
        var c3 = vec2<u32>(0u);
        var sx = 0.0;
        if x_row < p.m {
            let q0 = blk * 8u;
            var v0 = x_quad(x_row, q0);
            var v1 = x_quad(x_row, q0 + 1u);
            var v2 = x_quad(x_row, q0 + 2u);
            var v3 = x_quad(x_row, q0 + 3u);
            var v4 = x_quad(x_row, q0 + 4u);
            var v5 = x_quad(x_row, q0 + 5u);
            var v6 = x_quad(x_row, q0 + 6u);
            var v7 = x_quad(x_row, q0 + 7u);
//#if NORM
            ss += dot(v0, v0) + dot(v1, v1) + dot(v2, v2) + dot(v3, v3)
                + dot(v4, v4) + dot(v5, v5) + dot(v6, v6) + dot(v7, v7);
            v0 *= norm4(q0);
            v1 *= norm4(q0 + 1u);
            v2 *= norm4(q0 + 2u);
            v3 *= norm4(q0 + 3u);
            v4 *= norm4(q0 + 4u);
            v5 *= norm4(q0 + 5u);
            v6 *= norm4(q0 + 6u);
            v7 *= norm4(q0 + 7u);
//#endif
            let m4 = max(
                max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))),
                max(max(abs(v4), abs(v5)), max(abs(v6), abs(v7))),
            );
            let amax = max(max(m4.x, m4.y), max(m4.z, m4.w));
            // A block below 1e-30 is taken as zero: 127 / amax would overflow f32 for the
            // smallest magnitudes, and such a block adds nothing measurable.
            if amax >= 1e-30 {
                let inv = 127.0 / amax;
                sx = amax / 127.0;
                c0 = x_words(v0 * inv, v1 * inv);
                c1 = x_words(v2 * inv, v3 * inv);
                c2 = x_words(v4 * inv, v5 * inv);
                c3 = x_words(v6 * inv, v7 * inv);
            }
        }
        dx[xr * 16u + xb] = vec4<u32>(c0, c1);
        dx[xr * 16u + 8u + xb] = vec4<u32>(c2, c3);
        dxs[xr * 8u + xb] = sx;
        // Load half wh of W block wbk of weight row w_row (zero past the stored row).
        let wblk = ch * 8u + wbk;
        var codes = vec4<u32>(0u);
        var sw = 0.0;
        if wblk < blocks {
//#if WQ8
            let i = w_row * p.w_stride4 + wblk * 8u + wh * 4u;
            codes = vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]);
//#else
            let i = w_row * (p.w_stride4 >> 1u) + wblk * 4u + wh * 2u;
            let v0 = w[i];
            let v1 = w[i + 1u];
            codes = vec4<u32>(q4_even(v0), q4_odd(v0), q4_even(v1), q4_odd(v1));
//#endif
            sw = scale_of(w_row * blocks + wblk);
        }
        dw[(wr * 2u + wh) * 8u + wbk] = codes;
        if wh == 0u {
            dws[wr * 8u + wbk] = sw;
        }
        workgroupBarrier();
        if rows_live && ch * 8u + s < k_blocks {
            let wa = cg * 64u + s;
            let w0 = dw[wa];
            let w1 = dw[wa + 8u];
            let w2 = dw[wa + 16u];
            let w3 = dw[wa + 24u];
            let w4 = dw[wa + 32u];
            let w5 = dw[wa + 40u];
            let w6 = dw[wa + 48u];
            let w7 = dw[wa + 56u];
            let sa = cg * 32u + s;
            let sw4 = vec4<f32>(dws[sa], dws[sa + 8u], dws[sa + 16u], dws[sa + 24u]);
            let xa = rg * 64u + s;
            let xs = rg * 32u + s;
            // Tile row 4 rg + i: codes at xa + 16 i (+ 8 for the second half), scale xs + 8 i.
            a0 += block_dot4(dx[xa], dx[xa + 8u], dxs[xs],
                w0, w1, w2, w3, w4, w5, w6, w7, sw4);
            a1 += block_dot4(dx[xa + 16u], dx[xa + 24u], dxs[xs + 8u],
                w0, w1, w2, w3, w4, w5, w6, w7, sw4);
            a2 += block_dot4(dx[xa + 32u], dx[xa + 40u], dxs[xs + 16u],
                w0, w1, w2, w3, w4, w5, w6, w7, sw4);
            a3 += block_dot4(dx[xa + 48u], dx[xa + 56u], dxs[xs + 24u],
                w0, w1, w2, w3, w4, w5, w6, w7, sw4);
        }
        workgroupBarrier();
    }
    // As `narrow`: slices 4..7 store their sums, 0..3 add theirs onto them: four sets of
    // [row][column group] in dx, which the last barrier freed.
    let red = rg * 16u + cg;
    if s >= 4u {
        let b = (s - 4u) * 128u + red;
        dx[b] = bitcast<vec4<u32>>(a0);
        dx[b + 4u] = bitcast<vec4<u32>>(a1);
        dx[b + 8u] = bitcast<vec4<u32>>(a2);
        dx[b + 12u] = bitcast<vec4<u32>>(a3);
    }
//#if NORM
    // Row xr's sum of squares over the blocks xb, xb + 8, ...: [row][8] in dxs.
    dxs[t] = ss;
//#endif
    workgroupBarrier();
    if s < 4u {
        let b = s * 128u + red;
        dx[b] = bitcast<vec4<u32>>(dsum(b) + a0);
        dx[b + 4u] = bitcast<vec4<u32>>(dsum(b + 4u) + a1);
        dx[b + 8u] = bitcast<vec4<u32>>(dsum(b + 8u) + a2);
        dx[b + 12u] = bitcast<vec4<u32>>(dsum(b + 12u) + a3);
    }
    workgroupBarrier();
    if tile_index(wid, nwg) >= p.tiles {
        return;
    }
    // Epilogue: invocation t finishes tile row t / 8.
    let r = t >> 3u;
    let row = row0 + r;
//#if NORM
    var sq = 0.0;
    for (var i = 0u; i < 8u; i++) {
        sq += dxs[r * 8u + i];
    }
    let inv = inv_rms(vec4<f32>(sq)).x;
//#else
    let inv = 1.0;
//#endif
//#if SWIGLU
    let c = t & 7u;
    var g = 0.0;
    var up = 0.0;
    for (var i = 0u; i < 4u; i++) {
        let b = i * 128u + r * 4u;
        g += dsum(b + (c >> 2u))[c & 3u];
        up += dsum(b + 2u + (c >> 2u))[c & 3u];
    }
    store1(row, col0 + c, glu(vec4<f32>(g * inv), vec4<f32>(up * inv)).x);
//#else
    for (var j = 0u; j < 2u; j++) {
        let c = (t & 7u) * 2u + j;
        var v = 0.0;
        for (var i = 0u; i < 4u; i++) {
            v += dsum(i * 128u + r * 4u + (c >> 2u))[c & 3u];
        }
        store1(row, col0 + c, v * inv);
    }
//#endif
}
//#endif

//#if COOP
// Tensor cores through cooperative matrices (wgpu's `wgpu_cooperative_matrix`) of FR x FR
// fragments (16 on NVIDIA GPUs, 8 where an adapter offers only 8 x 8 x 8, as lavapipe does):
// a workgroup of 8 subgroups computes a TM x TN = 4 FR x 8 FR tile (64 x 128 at FR 16;
// TM2: 2 FR x 8 FR, for M <= 2 FR, so a 32-row step computes no half tile of copies;
// SWIGLU: TN / 2 gate and the matching TN / 2 up weight rows, TN / 2 output columns);
// subgroup s owns the RS x 2 FR block (s / 4, s % 4), RS = TM / 2, as RS / FR x 2
// accumulators of FR x FR f32.
// Each k-tile of x and W is staged once in workgroup memory as f16, row-major with 8 halves
// of padding per row (16-byte aligned rows, rotating banks), double-buffered, so one barrier
// per k-tile; the next k-tile's global loads are issued into registers before the current
// tile's multiplies and stored to the other buffer after them, so their latency overlaps the
// matrix loop. f16 weights reach workgroup memory without a conversion; x is rounded to f16
// after NORM's scaling (x / rms(x) * g, the normalised row itself, in f32: the rows' 1 / rms
// come from a pass over each row before this kernel, `rmsnorm.wgsl` STATS, so no workgroup
// re-reads its rows over all of K for them). Products are summed in f32 by the hardware. The
// accumulators leave through an FR x FR f32 tile per subgroup in workgroup memory, where the
// residual add, SwiGLU and the edges are applied. Constants: SG, the device's (fixed)
// subgroup size; FR, the fragment size; BK, 32 or 16 deep k-tiles as workgroup memory allows.
const SG: u32 = {{SG}}u;
const CWG: u32 = 8u * SG;
const FR: u32 = {{FR}}u;
const FF: u32 = FR * FR; // elements of one fragment
//#if TM2
const TM: u32 = 2u * FR; // tile rows (x rows)
//#else
const TM: u32 = 4u * FR;
//#endif
const RS: u32 = TM / 2u; // rows of one subgroup's block
const TN: u32 = 8u * FR; // tile weight rows
const BK: u32 = {{BK}}u;
const XS: u32 = BK + 8u; // row stride of the staged tiles, in halves
const KQ: u32 = BK / 4u; // quads per staged row
const XQ: u32 = (TM * KQ + CWG - 1u) / CWG; // x quads one invocation stages per k-tile
const WQ: u32 = (TN * KQ + CWG - 1u) / CWG; // W quads one invocation stages per k-tile
var<workgroup> ca: array<f16, 2u * TM * XS>; // [buffer][x row][k]
var<workgroup> cb: array<f16, 2u * TN * XS>; // [buffer][W row][k]
var<workgroup> cc: array<f32, 8u * FF>;      // [subgroup][FR x FR]
var<workgroup> cinv: array<f32, TM>;         // NORM: 1 / rms of the tile's rows
var<private> xr: array<vec4<f16>, XQ>;       // the next k-tile's x quads
var<private> wr: array<vec4<f16>, WQ>;       // the next k-tile's W quads

//#if NORM
// 1 / rms of every x row (`rmsnorm.wgsl` with STATS).
@group(0) @binding(5) var<storage, read> row_inv: array<f32>;
//#endif

// Quad q of W row `w_row` for k-tile `kt` as f16, zero past the row.
fn coop_w(w_row: u32, kt: u32, q: u32) -> vec4<f16> {
    let qq = kt * KQ + q;
    let i = w_row * p.w_stride4 + min(qq, p.w_stride4 - 1u);
//#if QUANT
    // A k-tile lies inside one 32-element block: one scale per row and k-tile.
    let blocks = p.w_stride4 >> 3u;
    let v = vec4<f16>(codes4(i) * scale_of(w_row * blocks + min(kt * BK / 32u, blocks - 1u)));
//#else
//#if F16
    let v = w[i];
//#else
    let v = vec4<f16>(load_w4(i));
//#endif
//#endif
    return select(vec4<f16>(0.0h), v, qq < p.w_stride4);
}

// Loads k-tile `kt` of the tile's TM x rows and TN W rows into this invocation's registers.
fn coop_fetch(t: u32, kt: u32, row0: u32, wcol0: u32) {
    for (var j = 0u; j < XQ; j++) {
        let i = t + j * CWG;
        if i < TM * KQ {
            let r = i / KQ;
            let q = kt * KQ + i % KQ;
            var v = x_quad(min(row0 + r, p.m - 1u), q);
//#if NORM
            v *= cinv[r] * norm4(q);
//#endif
            xr[j] = vec4<f16>(v);
        }
    }
    for (var j = 0u; j < WQ; j++) {
        let i = t + j * CWG;
        if i < TN * KQ {
            let r = i / KQ;
//#if SWIGLU
            let w_row = min(wcol0 + (r % (TN / 2u)), p.rows - 1u) + select(0u, p.up_off, r >= TN / 2u);
//#else
            let w_row = min(wcol0 + r, p.rows - 1u);
//#endif
            wr[j] = coop_w(w_row, kt, i % KQ);
        }
    }
}

// Stores the registers `coop_fetch` filled into staging buffer `buf`.
fn coop_put(t: u32, buf: u32) {
    for (var j = 0u; j < XQ; j++) {
        let i = t + j * CWG;
        if i < TM * KQ {
            let at = (buf * TM + i / KQ) * XS + (i % KQ) * 4u;
            let v = xr[j];
            ca[at] = v.x;
            ca[at + 1u] = v.y;
            ca[at + 2u] = v.z;
            ca[at + 3u] = v.w;
        }
    }
    for (var j = 0u; j < WQ; j++) {
        let i = t + j * CWG;
        if i < TN * KQ {
            let at = (buf * TN + i / KQ) * XS + (i % KQ) * 4u;
            let v = wr[j];
            cb[at] = v.x;
            cb[at + 1u] = v.y;
            cb[at + 2u] = v.z;
            cb[at + 3u] = v.w;
        }
    }
}

// Writes accumulator (a, b) of every subgroup: tile rows sm * RS + a * FR .. +FR, weight
// rows sn * 2 FR + b * FR .. +FR of subgroup s = 4 sm + sn.
fn coop_out(t: u32, sg: u32, acc: coop_mat{{FR}}x{{FR}}<f32, C>, a: u32, b: u32, row0: u32, col0: u32) {
    // Every index and stride of a cooperative load or store is a `let` of its own.
    let at = sg * FF;
    let stride = FR;
    coopStoreT(acc, &cc[at], stride);
    workgroupBarrier();
    for (var e = t; e < 8u * FF; e += CWG) {
        let s = e / FF;
        let sn = s & 3u;
        let row = row0 + (s >> 2u) * RS + a * FR + (e / FR) % FR;
        let c = sn * 2u * FR + b * FR + e % FR;
//#if SWIGLU
        // Gate sums in subgroups sn = 0, 1; the up sums of the same columns two subgroups on.
        if sn < 2u {
            let g = cc[e];
            store1(row, col0 + c, g / (1.0 + exp(-g)) * cc[e + 2u * FF]);
        }
//#else
        store1(row, col0 + c, cc[e]);
//#endif
    }
    workgroupBarrier();
}

@compute @workgroup_size(CWG)
fn coop(
    @builtin(local_invocation_index) t: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let k_tiles = (p.k + BK - 1u) / BK;
//#if SPLITK
    // Workgroup w computes tile w % tiles over the k-tiles of slice w / tiles.
    let groups = p.tiles * ((k_tiles + p.kt_slice - 1u) / p.kt_slice);
    let w = min(tile_index(wid, nwg), groups - 1u);
    let tile = w % p.tiles;
    let kt0 = (w / p.tiles) * p.kt_slice;
    let kt1 = min(kt0 + p.kt_slice, k_tiles);
//#else
    let groups = p.tiles;
    let tile = min(tile_index(wid, nwg), p.tiles - 1u);
    let kt0 = 0u;
    let kt1 = k_tiles;
//#endif
    let row0 = (tile / p.tiles_n) * TM;
//#if SWIGLU
    let col0 = (tile % p.tiles_n) * (TN / 2u);
//#else
    let col0 = (tile % p.tiles_n) * TN;
//#endif
//#if NORM
    if t < TM {
        cinv[t] = row_inv[min(row0 + t, p.m - 1u)];
    }
    workgroupBarrier();
//#endif
    coop_fetch(t, kt0, row0, col0);
    coop_put(t, 0u);
    workgroupBarrier();
    let sm = sg >> 2u;
    let sn = sg & 3u;
    var acc00 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc01 = coop_mat{{FR}}x{{FR}}<f32, C>();
//#if !TM2
    var acc10 = coop_mat{{FR}}x{{FR}}<f32, C>();
    var acc11 = coop_mat{{FR}}x{{FR}}<f32, C>();
//#endif
    for (var kt = kt0; kt < kt1; kt++) {
        let cur = (kt - kt0) & 1u;
        let more = kt + 1u < kt1;
        if more {
            coop_fetch(t, kt + 1u, row0, col0);
        }
        for (var kk = 0u; kk < BK; kk += FR) {
            let stride = XS;
            let xa0 = (cur * TM + sm * RS) * XS + kk;
            let wa0 = (cur * TN + sn * 2u * FR) * XS + kk;
            let wa1 = wa0 + FR * XS;
            let a0 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&ca[xa0], stride);
            // W rows are B's columns: a column-major load.
            let b0 = coopLoad<coop_mat{{FR}}x{{FR}}<f16, B>>(&cb[wa0], stride);
            let b1 = coopLoad<coop_mat{{FR}}x{{FR}}<f16, B>>(&cb[wa1], stride);
            acc00 = coopMultiplyAdd(a0, b0, acc00);
            acc01 = coopMultiplyAdd(a0, b1, acc01);
//#if !TM2
            let xa1 = xa0 + FR * XS;
            let a1 = coopLoadT<coop_mat{{FR}}x{{FR}}<f16, A>>(&ca[xa1], stride);
            acc10 = coopMultiplyAdd(a1, b0, acc10);
            acc11 = coopMultiplyAdd(a1, b1, acc11);
//#endif
        }
        if more {
            coop_put(t, 1u - cur);
        }
        workgroupBarrier();
    }
    // Out-of-range workgroups took part in the barriers above; the tile they repeat is
    // written once (the whole workgroup leaves together, so the barriers below stay uniform).
    if tile_index(wid, nwg) >= groups {
        return;
    }
//#if SPLITK
    // The slice's raw sums go straight to the scratch: slice-major, then rows padded to whole
    // tiles, `tiles_n * TN` columns per row in the tile's weight-row order (SWIGLU: TN / 2
    // gate then TN / 2 up columns per tile); the scratch holds every padded row and column.
    let stride = p.tiles_n * TN;
    let rows_padded = (p.tiles / p.tiles_n) * TM;
    let base = (kt0 / p.kt_slice) * rows_padded * stride + (row0 + sm * RS) * stride
        + (tile % p.tiles_n) * TN + sn * 2u * FR;
    let at00 = base;
    let at01 = base + FR;
    coopStoreT(acc00, &y[at00], stride);
    coopStoreT(acc01, &y[at01], stride);
//#if !TM2
    let at10 = base + FR * stride;
    let at11 = at10 + FR;
    coopStoreT(acc10, &y[at10], stride);
    coopStoreT(acc11, &y[at11], stride);
//#endif
//#else
    coop_out(t, sg, acc00, 0u, 0u, row0, col0);
    coop_out(t, sg, acc01, 0u, 1u, row0, col0);
//#if !TM2
    coop_out(t, sg, acc10, 1u, 0u, row0, col0);
    coop_out(t, sg, acc11, 1u, 1u, row0, col0);
//#endif
//#endif
}
//#endif
