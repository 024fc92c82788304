// Weight loaders shared by the kernels that read a `Weight` (tensor/weight.rs) in any format:
// appended to a kernel's own source (`kernel_source!("kernel", "weight_load")`), which declares
// nothing at binding 2 and a uniform `p` with a member `s_off` (the word of the chunk where a
// quantized weight's scales start). Exactly one format flag is set:
//   WF32 / WPACKED / F16    f32, f16 pairs in u32 words, native f16 (needs shader-f16)
//   WQ8 / WQ4 (+ QUANT)     the block-quantized formats of unmask_core::quant
// Every format gives `load_w4(i)` (elements 4i .. 4i + 3 of the chunk as f32) and `load_w1(i)`
// (element i); the quantized ones also give `codes4(i)` and `scale_of(block)`, so a kernel
// can fetch a block's scale once.
//#if WF32
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;

fn load_w4(i: u32) -> vec4<f32> {
    return w[i];
}

fn load_w1(i: u32) -> f32 {
    return w[i >> 2u][i & 3u];
}
//#endif

//#if WPACKED
// Four halves per vec2<u32>: element 2i sits in the low 16 bits of word i.
@group(0) @binding(2) var<storage, read> w: array<vec2<u32>>;

fn load_w4(i: u32) -> vec4<f32> {
    let v = w[i];
    return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
}

fn load_w1(i: u32) -> f32 {
    let word = w[i >> 2u][(i >> 1u) & 1u];
    return unpack2x16float(word)[i & 1u];
}
//#endif

//#if F16
@group(0) @binding(2) var<storage, read> w: array<vec4<f16>>;

fn load_w4(i: u32) -> vec4<f32> {
    return vec4<f32>(w[i]);
}

fn load_w1(i: u32) -> f32 {
    return f32(w[i >> 2u][i & 3u]);
}
//#endif

//#if QUANT
// One chunk of a quantized weight (tensor.rs, `Weight`): the codes of all its rows, then from
// word s_off its f16 scales, two per word. Rows are padded to whole blocks of 32, so element
// i of the chunk (row * stride + column) has scale i / 32. Nothing is dequantized in memory;
// scales are unpacked from u32 words, so no shader-f16 is needed.
@group(0) @binding(2) var<storage, read> w: array<u32>;

fn scale_of(block: u32) -> f32 {
    return unpack2x16float(w[p.s_off + (block >> 1u)])[block & 1u];
}
//#endif

//#if WQ8
// Elements 4i .. 4i + 3: the four signed bytes of word i, sign-extended by shifting each to
// the top of an i32 and back. `codes4` leaves the scale off for kernels that hoist it.
fn codes4(i: u32) -> vec4<f32> {
    let b = vec4<u32>(w[i]) << vec4<u32>(24u, 16u, 8u, 0u);
    return vec4<f32>(bitcast<vec4<i32>>(b) >> vec4<u32>(24u));
}

fn load_w4(i: u32) -> vec4<f32> {
    return codes4(i) * scale_of(i >> 3u);
}

fn load_w1(i: u32) -> f32 {
    let b = w[i >> 2u] << (24u - 8u * (i & 3u));
    return f32(bitcast<i32>(b) >> 24u) * scale_of(i >> 5u);
}
//#endif

//#if WQ4
// Elements 4i .. 4i + 3: four nibbles (code + 8) of word i / 2, low half for even i.
fn codes4(i: u32) -> vec4<f32> {
    let half = w[i >> 1u] >> ((i & 1u) * 16u);
    let q = (vec4<u32>(half) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    return vec4<f32>(q) - 8.0;
}

fn load_w4(i: u32) -> vec4<f32> {
    return codes4(i) * scale_of(i >> 3u);
}

fn load_w1(i: u32) -> f32 {
    let q = (w[i >> 3u] >> (4u * (i & 7u))) & 15u;
    return (f32(q) - 8.0) * scale_of(i >> 5u);
}
//#endif
