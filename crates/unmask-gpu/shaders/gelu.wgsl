// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/π) (g + 0.044715 g³))) (torch gelu(approximate="tanh")),
// appended to the kernels that apply it (`kernel_source!("kernel", "gelu")`).
// Beyond |g| = 10 the tanh is ±1 in f32 (tanh(43) rounds to 1), so the cubic is taken of g
// clamped there: it cannot overflow, and tanh never sees an argument past 10, where some
// drivers' exp-based tanh returns NaN.
fn gelu_tanh(g: f32) -> f32 {
    let c = clamp(g, -10.0, 10.0);
    let z = 0.7978845608028654 * (c + 0.044715 * c * c * c);
    return 0.5 * g * (1.0 + tanh(clamp(z, -10.0, 10.0)));
}
