//! A single-value channel whose receiver is a future: how a `map_async` callback hands its
//! result to async code, on native targets and in browsers alike.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
    /// The sender was dropped (with or without sending).
    closed: bool,
}

pub struct Sender<T>(Arc<Mutex<Slot<T>>>);

/// Resolves to the sent value, or `None` when the sender was dropped without sending.
pub struct Receiver<T>(Arc<Mutex<Slot<T>>>);

pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let slot = Arc::new(Mutex::new(Slot {
        value: None,
        waker: None,
        closed: false,
    }));
    (Sender(slot.clone()), Receiver(slot))
}

impl<T> Sender<T> {
    pub fn send(self, value: T) {
        if let Ok(mut slot) = self.0.lock() {
            slot.value = Some(value);
        }
        // Drop wakes the receiver.
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = match self.0.lock() {
            Ok(mut slot) => {
                slot.closed = true;
                slot.waker.take()
            }
            Err(_) => None,
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Future for Receiver<T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let Ok(mut slot) = self.0.lock() else {
            return Poll::Ready(None);
        };
        if let Some(v) = slot.value.take() {
            return Poll::Ready(Some(v));
        }
        if slot.closed {
            return Poll::Ready(None);
        }
        slot.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivers_a_value_sent_before_or_after_the_first_poll() {
        let (tx, rx) = channel();
        tx.send(7);
        assert_eq!(pollster::block_on(rx), Some(7));
        let (tx, rx) = channel();
        let t = std::thread::spawn(move || tx.send("late"));
        assert_eq!(pollster::block_on(rx), Some("late"));
        t.join().unwrap();
        let (tx, rx) = channel::<u8>();
        drop(tx);
        assert_eq!(pollster::block_on(rx), None);
    }
}
