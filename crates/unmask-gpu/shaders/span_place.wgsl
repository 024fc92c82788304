// ACache: a stored span's K/V (every key rotated for its position in the span-only pass,
// 0..rows) copied into a request's arena at row dst_row, each key rotated by `offset` more
// positions. RoPE is a rotation by an angle proportional to the position, so a key at
// position p rotated by the angle of offset o is the key at p + o; values do not move.
// Rotation as in rope_qkv.wgsl (half-split pairs, host-made cos/sin table).
// KV_F16: both K/V layers hold f16, two per u32 word (element 2i in the low half of word
// i); an invocation rotates two neighbouring pairs, a whole word of each half.

struct Params {
    rows: u32,
    n_kv_heads: u32,
    head_dim: u32,
    src_row: u32,   // first row read from the stored span
    dst_row: u32,   // arena row of the span's first position
    offset: u32,    // positions the span moves: its offset in the request
    max_pos: u32,   // rows of the table
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if KV_F16
@group(0) @binding(1) var<storage, read> src_k: array<u32>;
@group(0) @binding(2) var<storage, read> src_v: array<u32>;
//#else
@group(0) @binding(1) var<storage, read> src_k: array<f32>;
@group(0) @binding(2) var<storage, read> src_v: array<f32>;
//#endif
@group(0) @binding(3) var<storage, read> table: array<vec2<f32>>;
//#if KV_F16
@group(0) @binding(4) var<storage, read_write> dst_k: array<u32>;
@group(0) @binding(5) var<storage, read_write> dst_v: array<u32>;
//#else
@group(0) @binding(4) var<storage, read_write> dst_k: array<f32>;
@group(0) @binding(5) var<storage, read_write> dst_v: array<f32>;
//#endif

// (first, second) of a pair rotated by table entry `at`.
fn turn(x1: f32, x2: f32, at: u32) -> vec2<f32> {
    let cs = table[at];
    return vec2<f32>(x1 * cs.x - x2 * cs.y, x2 * cs.x + x1 * cs.y);
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let half = p.head_dim / 2u;
    let kv_w = p.n_kv_heads * p.head_dim;
    let src = (p.src_row + row) * kv_w;
    let dst = (p.dst_row + row) * kv_w;
    let base = min(p.offset, p.max_pos - 1u) * half;
//#if KV_F16
    let quads = p.n_kv_heads * (half / 2u);
    for (var i = lid.x; i < quads; i += 64u) {
        let head = i / (half / 2u);
        let j = (i % (half / 2u)) * 2u;
        let w1 = (src + head * p.head_dim + j) / 2u;
        let w2 = w1 + half / 2u;
        let x1 = unpack2x16float(src_k[w1]);
        let x2 = unpack2x16float(src_k[w2]);
        let a = turn(x1.x, x2.x, base + j);
        let b = turn(x1.y, x2.y, base + j + 1u);
        let d1 = (dst + head * p.head_dim + j) / 2u;
        dst_k[d1] = pack2x16float(vec2<f32>(a.x, b.x));
        dst_k[d1 + half / 2u] = pack2x16float(vec2<f32>(a.y, b.y));
    }
    for (var c = lid.x; c < kv_w / 2u; c += 64u) {
        dst_v[dst / 2u + c] = src_v[src / 2u + c];
    }
//#else
    let pairs = p.n_kv_heads * half;
    for (var i = lid.x; i < pairs; i += 64u) {
        let head = i / half;
        let j = i % half;
        let at = head * p.head_dim + j;
        let r = turn(src_k[src + at], src_k[src + at + half], base + j);
        dst_k[dst + at] = r.x;
        dst_k[dst + at + half] = r.y;
    }
    for (var c = lid.x; c < kv_w; c += 64u) {
        dst_v[dst + c] = src_v[src + c];
    }
//#endif
}
