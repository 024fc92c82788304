// The GEMM matmul kernel of matmul.wgsl (its header: flags, Params, bindings).

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
