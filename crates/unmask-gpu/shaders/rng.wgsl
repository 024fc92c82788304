// Counter-based random numbers shared by the kernels that draw (appended with
// `kernel_source!("kernel", "rng")`): the same functions as `unmask_core::rng`, so the host
// and every GPU give one stream, and the precise log the Gumbel noise needs.

// Natural log with a small relative error for every positive normal x, also next to 1
// (where -ln(U) of a uniform close to 1 lives); the builtin only promises an absolute error
// there; also ln S0 of a confident row's entropy, S0 close to 1. x = 2^e * m,
// m in [sqrt(1/2), sqrt(2)], ln m = 2 atanh(s), s = (m - 1) / (m + 1).
fn ln_precise(x: f32) -> f32 {
    let bits = bitcast<u32>(x);
    var e = i32((bits >> 23u) & 0xffu) - 127;
    var m = bitcast<f32>((bits & 0x007fffffu) | 0x3f800000u);
    if (m > 1.41421356) {
        m = m * 0.5;
        e = e + 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series = 1.0 + s2 * (0.33333333 + s2 * (0.2 + s2 * (0.14285714 + s2 * (0.11111111 + s2 * 0.09090909))));
    let fe = f32(e);
    // ln 2 split so that fe * LN2_HI is exact.
    return fe * 0.693145751953125 + (fe * 1.4286068203094172e-6 + 2.0 * s * series);
}

// Same function as `unmask_core::rng::pcg_hash`.
fn pcg_hash(x: u32) -> u32 {
    let s = x * 747796405u + 2891336453u;
    let word = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (word >> 22u) ^ word;
}

// Upper bound of `gumbel`: U <= 1 - 2^-24, so -ln(-ln U) <= -ln(2^-24) = 16.64.
const GUMBEL_MAX: f32 = 17.0;

// Standard Gumbel noise -ln(-ln U), U = `unmask_core::rng::uniform_open(bits)`.
fn gumbel(bits: u32) -> f32 {
    let u = (f32(bits >> 9u) + 0.5) * (1.0 / 8388608.0);
    return -ln_precise(-ln_precise(u));
}

// Same function as `unmask_core::rng::hash4`: a seed and three counters.
fn hash4(seed_lo: u32, seed_hi: u32, a: u32, b: u32, c: u32) -> u32 {
    return pcg_hash(pcg_hash(pcg_hash(pcg_hash(seed_lo ^ pcg_hash(seed_hi)) ^ a) ^ b) ^ c);
}
