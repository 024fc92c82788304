// Element-wise activations of DiffusionGemma (docs/models/diffusion-gemma.md §4.5, §4.7), one
// element per invocation, selected by a flag:
//   GELU_GATE  out[r, c] = gelu_tanh(gu[r, c]) * gu[r, cols + c]: rows of [gate | up] from one
//              fused gate|up matmul, `cols` outputs per row
//   SOFTCAP    x = value * tanh(x / value) in place (final logit soft-capping)
//   SCALE      x = x * value in place (the layer scalar on the residual stream)

struct Params {
    n: u32,     // elements written
    cols: u32,  // GELU_GATE: outputs per row (the input rows hold 2 cols)
    value: f32, // SOFTCAP: the cap; SCALE: the factor
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if GELU_GATE
@group(0) @binding(1) var<storage, read> gu: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#else
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
//#endif

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if i >= p.n {
        return;
    }
//#if GELU_GATE
    let r = i / p.cols;
    let c = i - r * p.cols;
    let at = r * 2u * p.cols + c;
    out[i] = gelu_tanh(gu[at]) * gu[at + p.cols];
//#endif
//#if SOFTCAP
    // tanh is ±1 in f32 past 10; clamping keeps large logits (1e4) from reaching a tanh that
    // overflows inside.
    x[i] = p.value * tanh(clamp(x[i] / p.value, -10.0, 10.0));
//#endif
//#if SCALE
    x[i] = x[i] * p.value;
//#endif
}
