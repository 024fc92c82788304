//! Wall-clock time on every target: `std::time::Instant` panics in a browser
//! (wasm32-unknown-unknown has no clock), where `performance.now()` is used instead.

/// Time since it was started, in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch {
    #[cfg(not(target_arch = "wasm32"))]
    start: std::time::Instant,
    #[cfg(target_arch = "wasm32")]
    start_ms: f64,
}

impl Stopwatch {
    pub fn start() -> Self {
        Self {
            #[cfg(not(target_arch = "wasm32"))]
            start: std::time::Instant::now(),
            #[cfg(target_arch = "wasm32")]
            start_ms: now_ms(),
        }
    }

    pub fn elapsed_s(&self) -> f64 {
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.start.elapsed().as_secs_f64()
        }
        #[cfg(target_arch = "wasm32")]
        {
            (now_ms() - self.start_ms) / 1000.0
        }
    }
}

/// `performance.now()` of the page or worker, else `Date.now()`.
#[cfg(target_arch = "wasm32")]
fn now_ms() -> f64 {
    use js_sys::wasm_bindgen::JsCast;
    let performance = js_sys::Reflect::get(&js_sys::global(), &"performance".into())
        .ok()
        .and_then(|p| p.dyn_into::<js_sys::Object>().ok());
    if let Some(p) = performance
        && let Ok(now) = js_sys::Reflect::get(&p, &"now".into())
        && let Ok(f) = now.dyn_into::<js_sys::Function>()
        && let Some(ms) = f.call0(&p).ok().and_then(|v| v.as_f64())
    {
        return ms;
    }
    js_sys::Date::now()
}
