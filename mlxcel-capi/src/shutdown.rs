//! Process exit while other threads are inside the library.
//!
//! `exit()` (and returning from `main`) runs the exit handlers and C++ static
//! destructors (MLX's, the kernels') on the exiting thread while other
//! threads may still be computing with them. So every entry point passes a
//! gate, and an exit handler, registered after MLX's statics exist (at each
//! model load and after the first generation), runs before their
//! destructors: it closes the gate, cancels every running generation, and
//! waits until no thread is inside the library, except threads in a user
//! callback. After that no thread touches MLX again: new calls fail with
//! `MLXCEL_ERR_EXITING` (frees succeed and leak), and a callback that returns
//! parks its thread until the process is gone.

use std::ffi::c_int;
use std::sync::{Condvar, Mutex, MutexGuard, Once};

struct Gate {
    exiting: bool,
    /// Calls inside the library, not counting those in a user callback.
    active: usize,
}

static GATE: Mutex<Gate> = Mutex::new(Gate { exiting: false, active: 0 });
/// Signalled when `active` drops to 0.
static DRAINED: Condvar = Condvar::new();
/// Never signalled: threads that must not run on after exit began wait on it.
static PARKED: Condvar = Condvar::new();

fn gate() -> MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Proof that this thread is counted inside the library; leaves on drop.
pub(crate) struct Inside(());

impl Drop for Inside {
    fn drop(&mut self) {
        leave(&mut gate());
    }
}

fn leave(g: &mut Gate) {
    g.active -= 1;
    if g.active == 0 && g.exiting {
        DRAINED.notify_all();
    }
}

/// Enters the library, or `None` once the process is exiting.
pub(crate) fn enter() -> Option<Inside> {
    let mut g = gate();
    if g.exiting {
        return None;
    }
    g.active += 1;
    Some(Inside(()))
}

/// Runs user code (a callback) from inside the library without holding up
/// exit. If the process began exiting meanwhile, the thread never returns
/// to the library: it waits here until the process is gone.
pub(crate) fn outside<R>(_inside: &Inside, f: impl FnOnce() -> R) -> R {
    leave(&mut gate());
    let result = f();
    let mut g = gate();
    while g.exiting {
        g = PARKED.wait(g).unwrap_or_else(|e| e.into_inner());
    }
    g.active += 1;
    result
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
        let mut g = gate();
        while g.active > 0 {
            g = DRAINED.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    });
}
