// Second pass of the split-K matmul (`coop-split`): sums the K slices' partial results that
// `matmul.wgsl` (COOP + SPLITK) left in the scratch and applies the epilogue, for the output
// columns [col0, col0 + rows) of one weight chunk.
//
// Scratch layout: `slices` blocks of `slice_len` floats; in each, row r (of x) starts at
// r * stride, and the chunk's weight rows follow tile by tile, `tile_n` per tile. SWIGLU:
// a tile holds tile_n / 2 gate rows, then the up rows of the same output columns.
// Flags: RESIDUAL (y += result), SWIGLU (y = silu(gate) * up).

struct Params {
    m: u32,         // rows of x and y in use
    rows: u32,      // output columns of this chunk
    col0: u32,      // first output column of this chunk
    n: u32,         // row stride of y
    stride: u32,    // scratch floats per row
    slice_len: u32, // scratch floats per slice
    slices: u32,    // slices of K
    tile_n: u32,    // weight rows per tile
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

fn slice_sum(at: u32) -> f32 {
    var sum = 0.0;
    for (var s = 0u; s < p.slices; s++) {
        sum += parts[s * p.slice_len + at];
    }
    return sum;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // Invocations are linearised over x and y (wide outputs need more than 65535 groups).
    let i = gid.x + gid.y * nwg.x * 64u;
    if i >= p.m * p.rows {
        return;
    }
    let row = i / p.rows;
    let c = i % p.rows;
//#if SWIGLU
    let half = p.tile_n / 2u;
    let at = row * p.stride + (c / half) * p.tile_n + c % half;
    let g = slice_sum(at);
    let v = g / (1.0 + exp(-g)) * slice_sum(at + half);
//#else
    let v = slice_sum(row * p.stride + c);
//#endif
    let out = row * p.n + p.col0 + c;
//#if RESIDUAL
    y[out] += v;
//#else
    y[out] = v;
//#endif
}
