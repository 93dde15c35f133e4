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

/// The cap a user set on the process's threads (`--threads`, a config's `threads`,
/// `FX_THREADS`); 0 while none is set.
static WORK_CAP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Makes [`work_threads`] stay within `threads` when the user set it (source `Config` or
/// `Env`); a count derived from the work (one thread for a small network's matmuls) sizes
/// candle's pool only and caps nothing else.
pub fn cap_work_threads(threads: &Sourced<usize>) {
    if matches!(threads.source, Source::Config | Source::Env(_)) {
        WORK_CAP.store(threads.value.max(1), std::sync::atomic::Ordering::Relaxed);
    }
}

/// Threads for this process's own parallel work (e.g. a panel's features): every usable
/// CPU, within the user's cap ([`cap_work_threads`]).
pub fn work_threads() -> usize {
    work_threads_within(WORK_CAP.load(std::sync::atomic::Ordering::Relaxed))
}

/// `f` of every item, on up to [`work_threads`] scoped threads (chunks of consecutive
/// items, one a thread), the results in the items' order: what one after another would
/// give, as fast as the host allows. A worker's panic (a bug) is an error with its message,
/// once every worker has ended, never a panic of the caller.
pub fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Result<Vec<R>, crate::Error> {
    let workers = work_threads().clamp(1, items.len().max(1));
    let chunk = items.len().div_ceil(workers).max(1);
    let joined: Vec<std::thread::Result<Vec<R>>> = std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> =
            items.chunks(chunk).map(|c| s.spawn(move || c.iter().map(f).collect::<Vec<R>>())).collect();
        // Every handle joined, so a panicked worker never makes the scope panic.
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut out = Vec::with_capacity(items.len());
    for part in joined {
        out.extend(part.map_err(|p| {
            let message = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            crate::Error::WorkerPanicked(message)
        })?);
    }
    Ok(out)
}

/// [`work_threads`] under `cap` (0: none).
fn work_threads_within(cap: usize) -> usize {
    if cap > 0 {
        cap
    } else {
        usable_cpus()
    }
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        /// The results are one after another's, in order, whatever the item count.
        #[test]
        fn par_map_is_map_in_order(items in proptest::collection::vec(proptest::num::u32::ANY, 0..300)) {
            let got = par_map(&items, |&x| u64::from(x) * 3 + 1).unwrap();
            proptest::prop_assert_eq!(got, items.iter().map(|&x| u64::from(x) * 3 + 1).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_worker_panic_is_an_error() {
        let items: Vec<u32> = (0..64).collect();
        let e = par_map(&items, |&x| if x == 40 { panic!("item {x} is bad") } else { x }).unwrap_err();
        assert!(e.to_string().contains("a worker thread panicked: item 40 is bad"), "{e}");
    }

    #[test]
    fn work_threads_are_the_users_cap_else_every_usable_cpu() {
        assert_eq!(work_threads_within(3), 3);
        assert_eq!(work_threads_within(1), 1);
        assert_eq!(work_threads_within(0), usable_cpus());
        // A derived count (a small network's one thread) caps nothing: left at no cap.
        cap_work_threads(&Sourced { value: 1, source: Source::Derived });
        assert_eq!(WORK_CAP.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}
