//! Measured kernel choice. The first time an `Auto` kernel meets a shape class on a device,
//! every candidate is timed on that shape and the fastest is kept: in memory for the
//! process, and natively in a JSON file keyed by adapter and driver, so that later
//! processes on the same device start with the winners. A class names the kernel source's
//! hash, so an edited kernel is measured again.
//!
//! File (default `<cache dir>/unmask/kernels.json`):
//! `{"format": 1, "devices": {"<device key>": {"<class>": {"winner": "...", "ms": {...}}}}}`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use crate::context::AdapterClass;

/// When `Auto` kernels are chosen by measurement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TunePolicy {
    /// Measure on hardware GPUs (discrete, integrated, virtual); on CPU adapters
    /// (lavapipe, llvmpipe, WARP) keep the fixed choice, which was measured there once and
    /// does not depend on timing noise.
    #[default]
    Auto,
    /// Measure on every adapter.
    Always,
    /// Never measure: the fixed choice (winners already in the file are not read either).
    Off,
}

impl TunePolicy {
    pub const NAMES: [&str; 3] = ["auto", "always", "off"];

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "auto" => Some(Self::Auto),
            "always" => Some(Self::Always),
            "off" => Some(Self::Off),
            _ => None,
        }
    }
}

/// What was measured for one shape class.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub winner: String,
    /// Each candidate's time per run, in ms.
    pub times: Vec<(String, f64)>,
}

/// The winners of one device, by shape class.
type Winners = BTreeMap<String, Measured>;

/// Measured choices of one device, shared by every kernel call of a context.
pub struct KernelTuner {
    enabled: bool,
    device_key: String,
    path: Option<PathBuf>,
    winners: Mutex<Winners>,
    measured: AtomicUsize,
    warned: AtomicUsize,
}

impl std::fmt::Debug for KernelTuner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelTuner")
            .field("enabled", &self.enabled)
            .field("device_key", &self.device_key)
            .field("measured", &self.measurements())
            .finish()
    }
}

/// A stable 32-bit hash (FNV-1a) of a kernel's source, part of its shape classes.
pub fn source_hash(source: &str) -> u32 {
    source.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// The file the winners are kept in when none is given: `$UNMASK_TUNE_FILE`, else
/// `<user cache dir>/unmask/kernels.json`. None in a browser.
pub fn default_tune_file() -> Option<PathBuf> {
    #[cfg(target_arch = "wasm32")]
    {
        None
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        if let Some(p) = std::env::var_os("UNMASK_TUNE_FILE").filter(|p| !p.is_empty()) {
            return Some(PathBuf::from(p));
        }
        dirs::cache_dir().map(|d| d.join("unmask").join("kernels.json"))
    }
}

impl KernelTuner {
    /// The tuner of a device. `path`: where winners are read from and written to (`None`:
    /// this process only).
    pub fn new(info: &wgpu::AdapterInfo, policy: TunePolicy, path: Option<PathBuf>) -> Self {
        let enabled = match policy {
            TunePolicy::Auto => AdapterClass::of(info.device_type) == AdapterClass::Gpu,
            TunePolicy::Always => true,
            TunePolicy::Off => false,
        };
        let device_key = format!(
            "{:?} | {} | {:04x}:{:04x} | {} {}",
            info.backend, info.name, info.vendor, info.device, info.driver, info.driver_info
        );
        let tuner = Self {
            enabled,
            device_key,
            path: if enabled { path } else { None },
            winners: Mutex::new(BTreeMap::new()),
            measured: AtomicUsize::new(0),
            warned: AtomicUsize::new(0),
        };
        if let Some(file) = tuner.read_file() {
            let mine = file["devices"][&tuner.device_key].clone();
            *tuner.lock() = parse_device(&mine);
        }
        tuner
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Winners> {
        self.winners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `Auto` kernels are chosen by measurement on this device.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The key the device's winners are filed under.
    pub fn device_key(&self) -> &str {
        &self.device_key
    }

    pub fn path(&self) -> Option<&PathBuf> {
        self.path.as_ref()
    }

    /// The measured winner of a shape class, if it was measured on this device.
    pub fn winner(&self, class: &str) -> Option<String> {
        if !self.enabled {
            return None;
        }
        self.lock().get(class).map(|m| m.winner.clone())
    }

    /// How many shape classes this process measured.
    pub fn measurements(&self) -> usize {
        self.measured.load(Ordering::Relaxed)
    }

    /// Every class with what was measured, in class order.
    pub fn entries(&self) -> Vec<(String, Measured)> {
        self.lock()
            .iter()
            .map(|(c, m)| (c.clone(), m.clone()))
            .collect()
    }

    /// Keeps the fastest of `times` (candidate, ms) as the class's winner, and writes the
    /// file. Returns the winner. Ties go to the first candidate.
    pub fn record(&self, class: &str, times: Vec<(String, f64)>) -> Option<String> {
        let winner = times
            .iter()
            .filter(|(_, ms)| ms.is_finite())
            .fold(None::<&(String, f64)>, |best, c| match best {
                Some(b) if b.1 <= c.1 => Some(b),
                _ => Some(c),
            })?
            .0
            .clone();
        self.lock().insert(
            class.to_string(),
            Measured {
                winner: winner.clone(),
                times,
            },
        );
        self.measured.fetch_add(1, Ordering::Relaxed);
        self.write_file();
        Some(winner)
    }

    fn warn(&self, message: String) {
        // One warning per process: the cache file is an optimisation, not an input.
        if self.warned.fetch_add(1, Ordering::Relaxed) == 0 {
            eprintln!("unmask: {message}; kernel choices stay in memory");
        }
    }

    fn read_file(&self) -> Option<Value> {
        let path = self.path.as_ref()?;
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                self.warn(format!(
                    "cannot read the kernel tuning file {}: {e}",
                    path.display()
                ));
                return None;
            }
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v["format"] == 1 && v["devices"].is_object() => Some(v),
            Ok(_) => {
                self.warn(format!(
                    "the kernel tuning file {} is not format 1; it will be rewritten",
                    path.display()
                ));
                None
            }
            Err(e) => {
                self.warn(format!(
                    "the kernel tuning file {} is not JSON ({e}); it will be rewritten",
                    path.display()
                ));
                None
            }
        }
    }

    /// Rewrites the file with this device's winners, keeping other devices' entries. The
    /// new text goes to a temporary file first, so a reader never sees half a file.
    fn write_file(&self) {
        let Some(path) = self.path.clone() else {
            return;
        };
        let mut file = self
            .read_file()
            .unwrap_or_else(|| json!({"format": 1, "devices": {}}));
        let mine: serde_json::Map<String, Value> = self
            .lock()
            .iter()
            .map(|(class, m)| {
                let ms: serde_json::Map<String, Value> =
                    m.times.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
                (class.clone(), json!({"winner": m.winner, "ms": ms}))
            })
            .collect();
        file["devices"][&self.device_key] = Value::Object(mine);
        let text = serde_json::to_string_pretty(&file).expect("JSON values serialise");
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, text + "\n"))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            self.warn(format!(
                "cannot write the kernel tuning file {}: {e}",
                path.display()
            ));
        }
    }
}

fn parse_device(v: &Value) -> Winners {
    let mut out = Winners::new();
    let Some(classes) = v.as_object() else {
        return out;
    };
    for (class, entry) in classes {
        let Some(winner) = entry["winner"].as_str() else {
            continue;
        };
        let times = entry["ms"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                    .collect()
            })
            .unwrap_or_default();
        out.insert(
            class.clone(),
            Measured {
                winner: winner.to_string(),
                times,
            },
        );
    }
    out
}

/// Times each candidate: `record(step, candidate)` records one run of it. One untimed run
/// first (it compiles the pipeline), then runs batched into one submit so that a short
/// kernel is not drowned by the submit's latency; the median of 3 such submits, per run.
#[cfg(not(target_arch = "wasm32"))]
pub fn time_candidates(
    ctx: &crate::GpuContext,
    candidates: &[&'static str],
    mut record: impl FnMut(&mut crate::StepEncoder, &'static str) -> crate::Result<()>,
) -> crate::Result<Vec<(String, f64)>> {
    use std::time::Instant;
    let mut out = Vec::with_capacity(candidates.len());
    for &name in candidates {
        let mut submit = |runs: usize| -> crate::Result<f64> {
            let mut step = crate::StepEncoder::new(ctx, "tune");
            for _ in 0..runs {
                record(&mut step, name)?;
            }
            let start = Instant::now();
            step.submit()?;
            ctx.wait_idle()?;
            Ok(start.elapsed().as_secs_f64() * 1e3)
        };
        submit(1)?;
        let once = submit(1)?;
        // Enough runs for about 2 ms of work per submit, at most 16.
        let runs = ((2.0 / once.max(1e-3)).ceil() as usize).clamp(1, 16);
        let mut times = [0.0f64; 3];
        for t in &mut times {
            *t = submit(runs)? / runs as f64;
        }
        times.sort_by(f64::total_cmp);
        out.push((name.to_string(), times[1]));
    }
    Ok(out)
}

/// The largest difference between `found` and `expected`, relative to the largest reference
/// magnitude; infinite when the lengths differ or a value is not finite.
pub fn max_relative_error(expected: &[f32], found: &[f32]) -> f32 {
    if expected.len() != found.len() {
        return f32::INFINITY;
    }
    let scale = expected
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(1e-6);
    expected.iter().zip(found).fold(0.0f32, |worst, (e, f)| {
        let d = (e - f).abs() / scale;
        if d.is_nan() {
            f32::INFINITY
        } else {
            worst.max(d)
        }
    })
}

/// Whether a candidate's output `found` agrees with the reference kernel's `expected`: every
/// element within `tol` times the largest reference magnitude. A kernel that computes
/// nonsense on some driver (an experimental feature, a miscompiled variant) is never kept,
/// however fast it ran.
pub fn outputs_agree(expected: &[f32], found: &[f32], tol: f32) -> bool {
    max_relative_error(expected, found) <= tol
}

/// What one kernel writes into `out` from zero: `out` is cleared, `record` runs alone in a
/// step, and `out` is read back. How candidates are checked against a reference kernel.
#[cfg(not(target_arch = "wasm32"))]
pub fn output_from_zero(
    ctx: &crate::GpuContext,
    out: &crate::Tensor,
    record: impl FnOnce(&mut crate::StepEncoder) -> crate::Result<()>,
) -> crate::Result<Vec<f32>> {
    out.write_f32(ctx, &vec![0.0; out.numel()])?;
    let mut step = crate::StepEncoder::new(ctx, "output check");
    record(&mut step)?;
    step.submit()?;
    out.read_f32(ctx)
}

/// Times each candidate that `verify` accepts; a rejected or failing one is recorded with
/// NaN, so it never wins. `verify` runs the candidate once and compares its output with a
/// reference kernel's.
#[cfg(not(target_arch = "wasm32"))]
pub fn time_verified_candidates(
    ctx: &crate::GpuContext,
    candidates: &[&'static str],
    mut verify: impl FnMut(&'static str) -> crate::Result<bool>,
    record: impl FnMut(&mut crate::StepEncoder, &'static str) -> crate::Result<()>,
) -> crate::Result<Vec<(String, f64)>> {
    let mut accepted = Vec::new();
    let mut rejected = Vec::new();
    for &name in candidates {
        match verify(name) {
            Ok(true) => accepted.push(name),
            Ok(false) => rejected.push((
                name,
                "its output differs from the reference kernel's".to_string(),
            )),
            Err(e) => rejected.push((name, e.to_string())),
        }
    }
    for (name, why) in &rejected {
        eprintln!("unmask: kernel candidate {name} left out of the measured choice: {why}");
    }
    let mut times = time_candidates(ctx, &accepted, record)?;
    times.extend(rejected.into_iter().map(|(n, _)| (n.to_string(), f64::NAN)));
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(device_type: wgpu::DeviceType, name: &str) -> wgpu::AdapterInfo {
        let mut info = wgpu::AdapterInfo::new(device_type, wgpu::Backend::Vulkan);
        info.name = name.into();
        info.vendor = 0x10de;
        info.device = 0x2335;
        info.driver = "NVIDIA".into();
        info.driver_info = "570.1".into();
        info
    }

    fn temp_file(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("unmask-tune-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir.join("sub").join("kernels.json")
    }

    #[test]
    fn policy_decides_per_device_type() {
        let gpu = info(wgpu::DeviceType::DiscreteGpu, "H200");
        let cpu = info(wgpu::DeviceType::Cpu, "llvmpipe");
        assert!(KernelTuner::new(&gpu, TunePolicy::Auto, None).enabled());
        assert!(!KernelTuner::new(&cpu, TunePolicy::Auto, None).enabled());
        assert!(KernelTuner::new(&cpu, TunePolicy::Always, None).enabled());
        assert!(!KernelTuner::new(&gpu, TunePolicy::Off, None).enabled());
        assert_eq!(TunePolicy::parse("always"), Some(TunePolicy::Always));
        assert_eq!(TunePolicy::parse("fast"), None);
    }

    #[test]
    fn winners_persist_per_device_and_survive_a_bad_file() {
        let path = temp_file("persist");
        let h200 = info(wgpu::DeviceType::DiscreteGpu, "H200");
        let a = KernelTuner::new(&h200, TunePolicy::Auto, Some(path.clone()));
        assert_eq!(a.winner("matmul/x"), None);
        let times = vec![("tiled".to_string(), 2.0), ("wide".to_string(), 1.5)];
        assert_eq!(a.record("matmul/x", times).as_deref(), Some("wide"));
        assert_eq!(a.winner("matmul/x").as_deref(), Some("wide"));
        assert_eq!(a.measurements(), 1);
        // Another process on the same device reads it; another device does not.
        let b = KernelTuner::new(&h200, TunePolicy::Auto, Some(path.clone()));
        assert_eq!(b.winner("matmul/x").as_deref(), Some("wide"));
        assert_eq!(b.measurements(), 0);
        let other = info(wgpu::DeviceType::DiscreteGpu, "RTX 4090");
        let c = KernelTuner::new(&other, TunePolicy::Auto, Some(path.clone()));
        assert_eq!(c.winner("matmul/x"), None);
        // Its record keeps the first device's entries.
        c.record("matmul/x", vec![("tiled".to_string(), 1.0)]);
        let d = KernelTuner::new(&h200, TunePolicy::Auto, Some(path.clone()));
        assert_eq!(d.winner("matmul/x").as_deref(), Some("wide"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("RTX 4090") && text.contains("H200"), "{text}");
        // A corrupt file is ignored (a warning), then rewritten on the next record.
        std::fs::write(&path, "{not json").unwrap();
        let e = KernelTuner::new(&h200, TunePolicy::Auto, Some(path.clone()));
        assert_eq!(e.winner("matmul/x"), None);
        e.record("matmul/y", vec![("tiled".to_string(), 1.0)]);
        let f = KernelTuner::new(&h200, TunePolicy::Auto, Some(path.clone()));
        assert_eq!(f.winner("matmul/y").as_deref(), Some("tiled"));
        // Off reads nothing.
        let g = KernelTuner::new(&h200, TunePolicy::Off, Some(path.clone()));
        assert_eq!(g.winner("matmul/y"), None);
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn ties_and_failed_candidates() {
        let t = KernelTuner::new(
            &info(wgpu::DeviceType::DiscreteGpu, "x"),
            TunePolicy::Auto,
            None,
        );
        let w = t.record(
            "c",
            vec![
                ("a".to_string(), f64::NAN),
                ("b".to_string(), 1.0),
                ("c".to_string(), 1.0),
            ],
        );
        assert_eq!(w.as_deref(), Some("b"));
        assert_eq!(t.record("d", vec![("a".to_string(), f64::NAN)]), None);
        assert_ne!(source_hash("fn main() {}"), source_hash("fn main() { }"));
    }
}
