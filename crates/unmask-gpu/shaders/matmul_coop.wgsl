// The COOP matmul kernel of matmul.wgsl (its header: flags, Params, bindings).

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
