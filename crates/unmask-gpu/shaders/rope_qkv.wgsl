// RoPE and the K/V arena write of one fused QKV projection, in one pass over its rows:
// the q heads are rotated in place (attention reads them from the QKV rows), the k heads
// are rotated into the layer's K arena and the v heads copied into its V arena, both at
// arena row kv_index[row]. Rotation as in rope.wgsl (half-split, host-made cos/sin table).
// BIAS (Qwen2/Dream): the projection's bias, one value per QKV column, is added first, so
// the matmul needs no bias epilogue.
// KV_F16: the arenas hold f16, two per u32 word (element 2i in the low half of word i, as
// attention reads them), rounded to nearest from the f32 values; no shader-f16 needed. An
// invocation writes whole words: two neighbouring rotated pairs (head_dim % 4 == 0), two
// neighbouring v columns.

struct Params {
    rows: u32,
    n_heads: u32,     // q heads
    n_kv_heads: u32,  // k heads = v heads
    head_dim: u32,
    row_stride: u32,  // columns of a QKV row: (n_heads + 2 n_kv_heads) head_dim
    max_pos: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read> kv_index: array<u32>;
//#if KV_F16
@group(0) @binding(5) var<storage, read_write> k_arena: array<u32>;
@group(0) @binding(6) var<storage, read_write> v_arena: array<u32>;
//#else
@group(0) @binding(5) var<storage, read_write> k_arena: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_arena: array<f32>;
//#endif
//#if BIAS
@group(0) @binding(7) var<storage, read> bias: array<f32>;
//#endif

// Column c of the row starting at src, plus its bias when the model has one.
fn qkv_at(src: u32, c: u32) -> f32 {
    //#if BIAS
    return qkv[src + c] + bias[c];
    //#else
    return qkv[src + c];
    //#endif
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
    let pos = min(positions[row], p.max_pos - 1u);
    let src = row * p.row_stride;
    let kv_w = p.n_kv_heads * p.head_dim;
    let dst = kv_index[row] * kv_w;
//#if KV_F16
    // q heads rotated in place as below; each k invocation rotates pairs j and j + 1.
    for (var i = lid.x; i < p.n_heads * half; i += 64u) {
        let col = (i / half) * p.head_dim + i % half;
        let r = rotate(src, col, pos * half + i % half, half);
        qkv[src + col] = r.x;
        qkv[src + col + half] = r.y;
    }
    let quads = p.n_kv_heads * (half / 2u);
    for (var i = lid.x; i < quads; i += 64u) {
        let head = i / (half / 2u);
        let j = (i % (half / 2u)) * 2u;
        let col = (p.n_heads + head) * p.head_dim + j;
        let a = rotate(src, col, pos * half + j, half);
        let b = rotate(src, col + 1u, pos * half + j + 1u, half);
        let d = (dst + head * p.head_dim + j) / 2u;
        k_arena[d] = pack2x16float(vec2<f32>(a.x, b.x));
        k_arena[d + half / 2u] = pack2x16float(vec2<f32>(a.y, b.y));
    }
    let v_col = (p.n_heads + p.n_kv_heads) * p.head_dim;
    for (var c = lid.x * 2u; c < kv_w; c += 128u) {
        v_arena[(dst + c) / 2u] =
            pack2x16float(vec2<f32>(qkv_at(src, v_col + c), qkv_at(src, v_col + c + 1u)));
    }
//#else
    // Rotated pairs of the q heads, then of the k heads.
    let pairs = (p.n_heads + p.n_kv_heads) * half;
    for (var i = lid.x; i < pairs; i += 64u) {
        let head = i / half;
        let j = i % half;
        let col = head * p.head_dim + j;
        let at = src + col;
        let cs = table[pos * half + j];
        let x1 = qkv_at(src, col);
        let x2 = qkv_at(src, col + half);
        let r1 = x1 * cs.x - x2 * cs.y;
        let r2 = x2 * cs.x + x1 * cs.y;
        if (head < p.n_heads) {
            qkv[at] = r1;
            qkv[at + half] = r2;
        } else {
            let d = dst + (head - p.n_heads) * p.head_dim + j;
            k_arena[d] = r1;
            k_arena[d + half] = r2;
        }
    }
    let v_col = (p.n_heads + p.n_kv_heads) * p.head_dim;
    for (var c = lid.x; c < kv_w; c += 64u) {
        v_arena[dst + c] = qkv_at(src, v_col + c);
    }
//#endif
}

//#if KV_F16
// Column `col` of the row at `src` rotated with its partner `col + half` by table entry `at`:
// (first, second) of the pair.
fn rotate(src: u32, col: u32, at: u32, half: u32) -> vec2<f32> {
    let cs = table[at];
    let x1 = qkv_at(src, col);
    let x2 = qkv_at(src, col + half);
    return vec2<f32>(x1 * cs.x - x2 * cs.y, x2 * cs.x + x1 * cs.y);
}
//#endif
