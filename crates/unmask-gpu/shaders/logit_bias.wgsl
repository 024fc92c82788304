// Logit biases (OpenAI's logit_bias, the repetition penalty and the presence / frequency
// penalties, in vLLM's order) on one vocabulary chunk of sampled rows' logits, before the
// token choice reads them. The table holds two words per row (the word its entries start
// at, and how many), then the entries, five words each: (id, bias, scale of a positive
// value, scale of a negative one, minus the penalty), so with x = l + bias, l becomes
// x * scale + add (`IdBias::apply`). A row's ids are distinct, so no two invocations write
// one logit. One workgroup per row: most rows have a few entries, and a row without any
// returns at once.

struct Params {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    _pad: u32,
}

const ENTRY_WORDS: u32 = 5u;

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
        let at_entry = first + ENTRY_WORDS * e;
        let id = table[at_entry];
        // Ids below the chunk wrap to large values and fail the one comparison.
        let col = id - p.vocab_offset;
        if (col < p.n) {
            let at = row * p.n + col;
            let x = logits[at] + bitcast<f32>(table[at_entry + 1u]);
            let scale = bitcast<f32>(table[at_entry + select(3u, 2u, x > 0.0)]);
            logits[at] = x * scale + bitcast<f32>(table[at_entry + 4u]);
        }
    }
}
