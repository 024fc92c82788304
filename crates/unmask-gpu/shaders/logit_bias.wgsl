// Logit biases (OpenAI's logit_bias, the presence / frequency penalties and the
// repetition penalty) on one vocabulary chunk of sampled rows' logits, before the token
// choice reads them. The table holds two words per row (the word its entries start at, and
// how many), then the entries, four words each: (id, scale of a positive logit, scale of a
// negative one, added bias), so l becomes l * scale + add (`IdBias::apply`). A row's ids
// are distinct, so no two invocations write one logit. One workgroup per row: most rows
// have a few entries, and a row without any returns at once.

struct Params {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let first = table[2u * row];
    let count = table[2u * row + 1u];
    for (var e = lid; e < count; e += 64u) {
        let at_entry = first + 4u * e;
        let id = table[at_entry];
        // Ids below the chunk wrap to large values and fail the one comparison.
        let col = id - p.vocab_offset;
        if (col < p.n) {
            let at = row * p.n + col;
            let l = logits[at];
            let scale = bitcast<f32>(table[at_entry + select(2u, 1u, l > 0.0)]);
            logits[at] = l * scale + bitcast<f32>(table[at_entry + 3u]);
        }
    }
}
