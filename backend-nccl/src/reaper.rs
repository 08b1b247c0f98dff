//! The process's reaper: a thread that drops what it is given. Dropping an
//! op or a buffer may free device memory, and freeing device memory waits
//! for the device (P8 of [`crate::guard`]); the device may be waiting for
//! something only the dropping thread would do next (issue a copy, an op, a
//! host message). So no buffer's memory is freed where it is dropped
//! (`BufState`'s drop in `crate::ctx`, wherever its last holder is: an op,
//! a sync's snapshot, a copy lane): it is handed here, and nothing ever
//! waits for this thread.

use std::any::Any;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Mutex, OnceLock};

type Item = Box<dyn Any + Send>;

/// Hands `items` to the reaper thread, which drops them. If the thread
/// cannot be started, they are leaked (never freed under the device, P6).
pub fn reap<T: Send + 'static>(items: Vec<T>) {
    if items.is_empty() {
        return;
    }
    static REAPER: OnceLock<Option<Mutex<Sender<Item>>>> = OnceLock::new();
    let tx = REAPER.get_or_init(|| {
        let (tx, rx) = channel::<Item>();
        std::thread::Builder::new()
            .name("duplex reaper".into())
            .spawn(move || {
                while let Ok(item) = rx.recv() {
                    drop(item);
                }
            })
            .ok()
            .map(|_| Mutex::new(tx))
    });
    let item: Item = Box::new(items);
    let refused = match tx {
        Some(tx) => tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(item)
            .err()
            .map(|e| e.0),
        None => Some(item),
    };
    if let Some(item) = refused {
        std::mem::forget(item);
    }
}
