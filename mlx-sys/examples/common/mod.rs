//! Shared by the kernel benchmarks in this directory.

/// CPU seconds (user + system) this process has used, to microseconds: unlike
/// wall time it leaves out time spent descheduled, so it stays meaningful on a
/// loaded machine.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(usage.ru_utime) + t(usage.ru_stime)
}
