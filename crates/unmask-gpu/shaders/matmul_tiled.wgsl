// The TILED and SHARED matmul kernels of matmul.wgsl (its header: flags, Params, bindings).

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
