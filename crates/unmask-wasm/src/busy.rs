//! One generation at a time per engine: they would share the device queue and the prefix
//! store. The flag is held by a guard, so every way out of a generation (its result, an
//! error returned with `?`, an early return) clears it; a flag set by hand and cleared by
//! hand stayed set when a path forgot it, and the engine refused every later request.

use std::cell::Cell;
use std::rc::Rc;

/// Holds the engine's busy flag; dropping it clears the flag.
#[derive(Debug)]
pub struct BusyGuard {
    flag: Rc<Cell<bool>>,
}

impl BusyGuard {
    /// Sets `flag` and returns its guard; `None` when it was already set (a generation is
    /// running), leaving it as it was.
    pub fn acquire(flag: &Rc<Cell<bool>>) -> Option<Self> {
        if flag.replace(true) {
            return None;
        }
        Some(Self { flag: flag.clone() })
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.flag.set(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_released_on_drop() {
        let flag = Rc::new(Cell::new(false));
        let held = BusyGuard::acquire(&flag).expect("a free flag is taken");
        assert!(flag.get());
        assert!(
            BusyGuard::acquire(&flag).is_none(),
            "a second holder is refused"
        );
        assert!(flag.get(), "a refused acquire leaves the holder's flag set");
        drop(held);
        assert!(!flag.get());
        assert!(BusyGuard::acquire(&flag).is_some());
    }

    #[test]
    fn an_early_error_return_releases_the_flag() {
        fn run(flag: &Rc<Cell<bool>>, fail: bool) -> Result<u32, String> {
            let _busy = BusyGuard::acquire(flag).ok_or("busy")?;
            if fail {
                return Err("failed halfway".into());
            }
            Ok(1)
        }
        let flag = Rc::new(Cell::new(false));
        assert!(run(&flag, true).is_err());
        assert!(!flag.get(), "the error path cleared the flag");
        assert_eq!(run(&flag, false), Ok(1));
        assert!(!flag.get(), "the success path cleared the flag");
    }
}
