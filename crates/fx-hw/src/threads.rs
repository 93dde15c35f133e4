//! CPU threads for candle's CPU kernels, sized by the work and by the CPUs this process may
//! use. candle sizes its pool by the machine (and pins its threads to cores), so a small
//! network on a 16-core box pays for 16 threads on every tiny matmul (measured: a DQN CPU
//! run at batch 230 trains at 14.5k samples/s with the default pool, 36.6k on one thread,
//! 1.2k pinned to one core with `taskset`). The choice here is applied once at start-up,
//! before candle builds its pool.

use crate::overrides::{Source, Sourced};

/// CPUs this process may run on: the affinity mask and the cgroup CPU quota, as
/// `std::thread::available_parallelism` reads them (at least 1).
pub fn usable_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The thread count for a run: `requested` (a flag or config value) if given, else
/// `FX_THREADS`, else one thread for small networks (the RL agents' MLPs: splitting their
/// matmuls costs more than it saves), else every usable CPU. Never more than the usable
/// CPUs unless explicitly requested.
pub fn cpu_threads(requested: Option<usize>, small_network: bool) -> Result<Sourced<usize>, crate::Error> {
    if let Some(n) = requested.filter(|&n| n > 0) {
        return Ok(Sourced { value: n, source: Source::Config });
    }
    if let Ok(v) = std::env::var("FX_THREADS") {
        let n = v.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| crate::Error::InvalidOverride {
            what: "threads",
            source_name: "FX_THREADS".into(),
            value: v.clone(),
            expected: "a positive thread count",
        })?;
        return Ok(Sourced { value: n, source: Source::Env("FX_THREADS".into()) });
    }
    if small_network {
        return Ok(Sourced { value: 1, source: Source::Derived });
    }
    Ok(Sourced { value: usable_cpus(), source: Source::Detected })
}

/// Makes candle (and rayon) use `n` threads: sets `CANDLE_NUM_THREADS` and
/// `RAYON_NUM_THREADS`, which they read when their pools are first built. Call before any
/// CPU tensor work, from the main thread while no other thread runs.
pub fn apply_cpu_threads(n: usize) {
    let n = n.max(1).to_string();
    std::env::set_var("CANDLE_NUM_THREADS", &n);
    std::env::set_var("RAYON_NUM_THREADS", &n);
}

/// Threads for this process's own parallel work (e.g. a panel's features): the count
/// [`apply_cpu_threads`] set, so a run stays inside what it was given, else every usable CPU.
pub fn work_threads() -> usize {
    work_threads_from(std::env::var("RAYON_NUM_THREADS").ok().as_deref())
}

/// [`work_threads`] from the variable's value (`None`: unset).
fn work_threads_from(applied: Option<&str>) -> usize {
    applied.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or_else(usable_cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requested_then_small_then_usable() {
        assert_eq!(cpu_threads(Some(3), true).unwrap().value, 3);
        if std::env::var_os("FX_THREADS").is_none() {
            let small = cpu_threads(None, true).unwrap();
            assert_eq!((small.value, small.source), (1, Source::Derived));
            let big = cpu_threads(None, false).unwrap();
            assert_eq!(big.value, usable_cpus());
            assert!(big.value >= 1);
        }
    }

    #[test]
    fn work_threads_are_the_applied_count_else_every_usable_cpu() {
        assert_eq!(work_threads_from(Some("3")), 3);
        assert_eq!(work_threads_from(Some(" 1\n")), 1);
        for unusable in [None, Some(""), Some("0"), Some("many")] {
            assert_eq!(work_threads_from(unusable), usable_cpus(), "{unusable:?}");
        }
    }
}
