//! Process exit while other threads are inside the library.
//!
//! `exit()` (and returning from `main`) runs the exit handlers and C++ static
//! destructors (MLX's, the kernels') on the exiting thread while other
//! threads may still be computing with them. So every entry point passes a
//! gate, and an exit handler, registered after MLX's statics exist (at each
//! model load and after the first generation), runs before their
//! destructors: it closes the gate, cancels every running generation, and
//! waits until no other thread is inside the library (running calls return
//! at their next cancellation point; callbacks in progress return first).
//! After that no thread touches MLX again: new calls fail with
//! `MLXCEL_ERR_EXITING`, and frees succeed and leak.

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::{Condvar, Mutex, MutexGuard, Once};

struct Gate {
    exiting: bool,
    /// Calls inside the library, on all threads (callbacks in progress included).
    active: usize,
}

static GATE: Mutex<Gate> = Mutex::new(Gate {
    exiting: false,
    active: 0,
});
/// Signalled when `active` drops once exiting.
static DRAINED: Condvar = Condvar::new();

thread_local! {
    /// This thread's calls inside the library: more than 0 when `exit()` is
    /// called from a callback, and the exit handler must not wait for itself.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

fn gate() -> MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Proof that this thread is counted inside the library; leaves on drop.
pub(crate) struct Inside(());

impl Drop for Inside {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
        let mut g = gate();
        g.active -= 1;
        if g.exiting {
            DRAINED.notify_all();
        }
    }
}

/// Enters the library, or `None` once the process is exiting.
pub(crate) fn enter() -> Option<Inside> {
    let mut g = gate();
    if g.exiting {
        return None;
    }
    g.active += 1;
    DEPTH.with(|d| d.set(d.get() + 1));
    Some(Inside(()))
}

/// Registers the exit handler (again): it runs before the static destructors
/// registered before this call. Called after each model load and after the
/// first generation, when MLX's lazily created statics exist.
pub(crate) fn register_exit_handler() {
    extern "C" {
        fn atexit(f: extern "C" fn()) -> c_int;
    }
    // SAFETY: `on_exit` is a plain function that stays valid for the process's life.
    unsafe {
        atexit(on_exit);
    }
}

/// [`register_exit_handler`] once, after the first generation.
pub(crate) fn register_after_first_generation() {
    static ONCE: Once = Once::new();
    ONCE.call_once(register_exit_handler);
}

extern "C" fn on_exit() {
    // A panic must not unwind into libc; the handler runs once per registration.
    let _ = std::panic::catch_unwind(|| {
        {
            let mut g = gate();
            if g.exiting {
                return;
            }
            g.exiting = true;
        }
        crate::cancel_all_runs();
        let own = DEPTH.with(Cell::get);
        {
            let mut g = gate();
            while g.active > own {
                g = DRAINED.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        // The models' scheduler threads, which run every generation's rows.
        mlxcel_engine::shutdown(std::time::Duration::from_secs(10));
    });
}
