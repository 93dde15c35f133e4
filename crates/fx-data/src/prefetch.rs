//! Background preparation of work items (batches) ahead of the consumer.
//! Worker threads take jobs in order from a shared source, run them, and hand
//! results over a bounded crossbeam channel; the consumer re-orders them so
//! the output order is the job order whatever the worker count. A worker
//! error (or panic) reaches the consumer as `Err` at that job's position and
//! ends the stream, never as a hang; dropping the consumer stops the workers.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver};
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Prefetch settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefetchConfig {
    /// Finished items that may wait in the channel (the prefetch depth).
    pub depth: usize,
    /// Worker threads.
    pub workers: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig { depth: 2, workers: 1 }
    }
}

type Msg<T> = (u64, Result<T, Error>);

/// Items produced in the background, consumed in job order (an iterator of
/// `Result<T, Error>`).
pub struct Prefetcher<T: Send + 'static> {
    rx: Option<Receiver<Msg<T>>>,
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<()>>,
    next_seq: u64,
    pending: BTreeMap<u64, Result<T, Error>>,
    done: bool,
}

impl<T: Send + 'static> std::fmt::Debug for Prefetcher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("workers", &self.handles.len())
            .field("next_seq", &self.next_seq)
            .field("done", &self.done)
            .finish()
    }
}

impl<T: Send + 'static> Prefetcher<T> {
    /// Starts `cfg.workers` threads running `work` on the jobs of `jobs`.
    pub fn spawn<J, I, F>(cfg: &PrefetchConfig, jobs: I, work: F) -> Result<Self, Error>
    where
        J: Send + 'static,
        I: Iterator<Item = J> + Send + 'static,
        F: Fn(J) -> Result<T, Error> + Send + Sync + 'static,
    {
        if cfg.depth == 0 || cfg.workers == 0 {
            return Err(Error::config("prefetch", "depth and workers must be > 0".to_string()));
        }
        let (tx, rx) = bounded::<Msg<T>>(cfg.depth);
        let stop = Arc::new(AtomicBool::new(false));
        let source = Arc::new(Mutex::new((0u64, jobs)));
        let work = Arc::new(work);
        let mut handles = Vec::with_capacity(cfg.workers);
        for w in 0..cfg.workers {
            let (tx, stop, source, work) = (tx.clone(), stop.clone(), source.clone(), work.clone());
            let h = std::thread::Builder::new()
                .name(format!("fx-data-prefetch-{w}"))
                .spawn(move || loop {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    // Take the next job (and its sequence number) under the lock.
                    let next = catch_unwind(AssertUnwindSafe(|| {
                        let mut g = source.lock().unwrap_or_else(|p| p.into_inner());
                        let seq = g.0;
                        let job = g.1.next();
                        if job.is_some() {
                            g.0 += 1;
                        }
                        job.map(|j| (seq, j))
                    }));
                    let (seq, result) = match next {
                        Ok(None) => break,
                        Ok(Some((seq, job))) => {
                            let r = catch_unwind(AssertUnwindSafe(|| work(job))).unwrap_or_else(|p| {
                                Err(Error::Worker(format!("job {seq} panicked: {}", panic_text(&*p))))
                            });
                            (seq, r)
                        }
                        Err(p) => {
                            // The source itself panicked: report at the position it failed.
                            let seq = source.lock().unwrap_or_else(|p| p.into_inner()).0;
                            (seq, Err(Error::Worker(format!("job source panicked: {}", panic_text(&*p)))))
                        }
                    };
                    let failed = result.is_err();
                    if failed {
                        // Nothing after a failure will be consumed: let the others stop.
                        stop.store(true, Ordering::Release);
                    }
                    // A closed channel means the consumer is gone: stop.
                    if tx.send((seq, result)).is_err() || failed {
                        break;
                    }
                })
                .map_err(|e| Error::Worker(format!("cannot start a worker thread: {e}")))?;
            handles.push(h);
        }
        Ok(Prefetcher { rx: Some(rx), stop, handles, next_seq: 0, pending: BTreeMap::new(), done: false })
    }

    /// Items handed over but not yet consumed (for diagnostics and tests).
    pub fn ready(&self) -> usize {
        self.rx.as_ref().map_or(0, |r| r.len()) + self.pending.len()
    }

    fn finish(&mut self, item: Result<T, Error>) -> Option<Result<T, Error>> {
        if item.is_err() {
            self.done = true;
        }
        self.next_seq += 1;
        Some(item)
    }
}

impl<T: Send + 'static> Iterator for Prefetcher<T> {
    type Item = Result<T, Error>;

    /// Blocks until the next item in job order is ready; `None` at the end.
    fn next(&mut self) -> Option<Result<T, Error>> {
        if self.done {
            return None;
        }
        loop {
            if let Some(item) = self.pending.remove(&self.next_seq) {
                return self.finish(item);
            }
            let rx = self.rx.as_ref()?;
            match rx.recv() {
                Ok((seq, item)) if seq == self.next_seq => return self.finish(item),
                Ok((seq, item)) => {
                    self.pending.insert(seq, item);
                }
                // All workers have exited: a clean end unless an item is missing.
                Err(_) => {
                    self.done = true;
                    if self.pending.is_empty() {
                        return None;
                    }
                    return Some(Err(Error::Worker(format!(
                        "item {} was never produced (a worker exited early)",
                        self.next_seq
                    ))));
                }
            }
        }
    }
}

impl<T: Send + 'static> Drop for Prefetcher<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Closing the channel wakes workers blocked on a full channel.
        self.rx = None;
        self.pending.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    #[test]
    fn order_is_job_order_with_many_workers() {
        for workers in [1, 3] {
            let cfg = PrefetchConfig { depth: 2, workers };
            let p = Prefetcher::spawn(&cfg, 0..200u64, |j| {
                // Uneven work so workers finish out of order.
                if j % 7 == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                Ok(j * 2)
            })
            .unwrap();
            let got: Vec<u64> = p.map(|r| r.unwrap()).collect();
            assert_eq!(got, (0..200).map(|j| j * 2).collect::<Vec<_>>());
        }
    }

    #[test]
    fn worker_error_surfaces_and_ends_the_stream() {
        let cfg = PrefetchConfig { depth: 2, workers: 2 };
        let mut p = Prefetcher::spawn(&cfg, 0..1_000_000u64, |j| {
            if j == 5 {
                Err(Error::Worker("disk on fire".into()))
            } else {
                Ok(j)
            }
        })
        .unwrap();
        for j in 0..5 {
            assert_eq!(p.next().unwrap().unwrap(), j);
        }
        let e = p.next().unwrap().unwrap_err();
        assert!(e.to_string().contains("disk on fire"), "{e}");
        assert!(p.next().is_none());
    }

    #[test]
    fn worker_panic_surfaces_as_error() {
        let mut p = Prefetcher::spawn(&PrefetchConfig::default(), 0..10u32, |j| {
            assert!(j != 2, "boom at {j}");
            Ok(j)
        })
        .unwrap();
        assert_eq!(p.next().unwrap().unwrap(), 0);
        assert_eq!(p.next().unwrap().unwrap(), 1);
        let e = p.next().unwrap().unwrap_err();
        assert!(e.to_string().contains("boom at 2"), "{e}");
        assert!(p.next().is_none());
    }

    #[test]
    fn dropping_the_consumer_stops_the_workers() {
        let ran = Arc::new(AtomicUsize::new(0));
        let alive = Arc::new(());
        let (r, a) = (ran.clone(), alive.clone());
        let cfg = PrefetchConfig { depth: 2, workers: 2 };
        // An endless job source: only stopping can end it.
        let mut p = Prefetcher::spawn(&cfg, 0u64.., move |j| {
            let _keep = &a;
            r.fetch_add(1, Ordering::Relaxed);
            Ok(j)
        })
        .unwrap();
        assert_eq!(p.next().unwrap().unwrap(), 0);
        // Workers fill the channel and then block; they must not run ahead unboundedly.
        std::thread::sleep(Duration::from_millis(20));
        assert!(ran.load(Ordering::Relaxed) <= 1 + cfg.depth + cfg.workers + 1);
        let t = Instant::now();
        drop(p);
        assert!(t.elapsed() < Duration::from_secs(1));
        // The closure (and its captured Arc) is gone: every worker has exited.
        assert_eq!(Arc::strong_count(&alive), 1);
    }

    #[test]
    fn refuses_zero_depth() {
        assert!(Prefetcher::spawn(&PrefetchConfig { depth: 0, workers: 1 }, 0..1, Ok::<i32, Error>).is_err());
    }
}
