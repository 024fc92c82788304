// The grouping of a mixture-of-experts FFN (docs/models/diffusion-gemma.md §4.6), on the GPU:
// from the routed experts ids [rows, K] (moe_route.wgsl), each expert's list of the
// assignments (token row, slot) that chose it, and the row tiles the grouped matmuls run.
// One workgroup: count per expert, prefix sums over the E <= 256 experts, then the lists.
//
// plan (u32):
//   [0, E]              offs: expert e's list is order[offs[e] .. offs[e + 1]]
//   [E + 1, 2E + 2)     tile starts: expert e's row tiles are tiles tstart[e] .. tstart[e + 1]
//   [2E + 2, ..)        tile t: its expert | (its tile within the expert << 8)
// order[pos] = a (= row * K + slot): the lists one after another, each in ascending a, so the
// result is the same on every run and the gathered rows ascend.
// slot_pos[a] = pos, or NONE for an id >= E (never from moe_route; such a slot adds nothing).

struct Params {
    assignments: u32, // rows * K
    experts: u32,     // E <= MAX_E
    tile_cap: u32,    // tile entries the plan has room for
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> plan: array<u32>;
@group(0) @binding(3) var<storage, read_write> order: array<u32>;
@group(0) @binding(4) var<storage, read_write> slot_pos: array<u32>;

const WG: u32 = 256u;
const MAX_E: u32 = 256u;
// Rows of a tile of the grouped matmuls (moe_experts.wgsl).
const TM: u32 = {{TM}}u;
const NONE: u32 = 0xffffffffu;

var<workgroup> count: array<atomic<u32>, MAX_E>;
var<workgroup> filled: array<atomic<u32>, MAX_E>;
// Inclusive prefix sums of the counts and of the tiles per expert.
var<workgroup> rows_incl: array<u32, MAX_E>;
var<workgroup> tiles_incl: array<u32, MAX_E>;
// The experts of the assignments the workgroup places in one pass.
var<workgroup> chunk: array<u32, WG>;

// Start of expert e's list (e <= E).
fn offs(e: u32) -> u32 {
    return select(0u, rows_incl[max(e, 1u) - 1u], e > 0u);
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let e_count = min(p.experts, MAX_E);
    atomicStore(&count[t], 0u);
    atomicStore(&filled[t], 0u);
    workgroupBarrier();
    // Integer atomics: the counts do not depend on the order they arrive in.
    for (var a = t; a < p.assignments; a += WG) {
        let e = ids[a];
        if e < e_count {
            atomicAdd(&count[e], 1u);
        }
    }
    workgroupBarrier();
    let c = atomicLoad(&count[t]);
    rows_incl[t] = c;
    tiles_incl[t] = (c + TM - 1u) / TM;
    workgroupBarrier();
    // Hillis-Steele scans, both at once.
    for (var s = 1u; s < WG; s <<= 1u) {
        var r = rows_incl[t];
        var q = tiles_incl[t];
        if t >= s {
            r += rows_incl[t - s];
            q += tiles_incl[t - s];
        }
        workgroupBarrier();
        rows_incl[t] = r;
        tiles_incl[t] = q;
        workgroupBarrier();
    }
    let ts = e_count + 1u;
    let tiles_at = 2u * e_count + 2u;
    for (var e = t; e <= e_count; e += WG) {
        plan[e] = offs(e);
        plan[ts + e] = select(0u, tiles_incl[max(e, 1u) - 1u], e > 0u);
    }
    // Each tile's expert: the first whose inclusive tile count passes it.
    let tiles = min(tiles_incl[e_count - 1u], p.tile_cap);
    for (var i = t; i < tiles; i += WG) {
        var lo = 0u;
        var hi = e_count - 1u;
        while lo < hi {
            let mid = (lo + hi) / 2u;
            if tiles_incl[mid] > i {
                hi = mid;
            } else {
                lo = mid + 1u;
            }
        }
        let first = select(0u, tiles_incl[max(lo, 1u) - 1u], lo > 0u);
        plan[tiles_at + i] = lo | ((i - first) << 8u);
    }
    // The lists, WG assignments a pass: an assignment's place among those of its expert is
    // the number placed in earlier passes plus the earlier ones of its pass.
    for (var base = 0u; base < p.assignments; base += WG) {
        let a = base + t;
        var e = NONE;
        if a < p.assignments {
            e = ids[a];
            if e >= e_count {
                e = NONE;
                slot_pos[a] = NONE;
            }
        }
        chunk[t] = e;
        workgroupBarrier();
        if e != NONE {
            var rank = 0u;
            for (var u = 0u; u < t; u++) {
                rank += select(0u, 1u, chunk[u] == e);
            }
            let pos = offs(e) + atomicLoad(&filled[e]) + rank;
            order[pos] = a;
            slot_pos[a] = pos;
        }
        workgroupBarrier();
        if e != NONE {
            atomicAdd(&filled[e], 1u);
        }
        workgroupBarrier();
    }
}
