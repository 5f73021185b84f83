//! Locking the process's small shared states (counters, caches, the limiter's window).

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`. Each state it guards is whole after every statement, so a holder that
/// panicked left it usable: it is taken as it is rather than passing the panic on.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
