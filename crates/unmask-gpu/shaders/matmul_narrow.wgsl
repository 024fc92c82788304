// The NARROW and NDOT matmul kernels of matmul.wgsl (its header: flags, Params, bindings).

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
