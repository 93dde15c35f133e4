//! Background preparation of work items (batches) ahead of the consumer.
//! Worker threads take jobs from a shared source in turn (job `s` goes to
//! worker `s mod W`), run them, and hand results over a bounded crossbeam
//! channel per worker; the consumer reads the channels round-robin, so the
//! output is in job order whatever the worker count, and memory stays bounded
//! (at most `depth` finished items per worker plus one in progress). A worker
//! error (or panic) reaches the consumer as `Err` at that job's position,
//! after every earlier item, and ends the stream, never as a hang; dropping
//! the consumer stops the workers.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver};
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Prefetch settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefetchConfig {
    /// Finished items that may wait per worker (the prefetch depth).
    pub depth: usize,
    /// Worker threads.
    pub workers: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig { depth: 2, workers: 1 }
    }
}

/// The shared job source: jobs are handed out strictly in sequence.
struct Source<I> {
    next_seq: u64,
    jobs: I,
    /// No more jobs will be handed out (source ended, failed, or stopped).
    closed: bool,
}

struct Shared<I> {
    source: Mutex<Source<I>>,
    turn: Condvar,
    stop: AtomicBool,
}

/// The outcome of [`Prefetcher::try_next`].
#[derive(Debug)]
pub enum TryNext<T> {
    /// The next item (or the error that ends the stream).
    Ready(Result<T, Error>),
    /// The next item is still being prepared.
    Pending,
    /// The stream has ended.
    End,
}

/// Items produced in the background, consumed in job order (an iterator of
/// `Result<T, Error>`).
pub struct Prefetcher<T: Send + 'static> {
    rxs: Vec<Receiver<Result<T, Error>>>,
    stop: Box<dyn Fn() + Send + Sync>,
    handles: Vec<JoinHandle<()>>,
    next_seq: u64,
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
        let w_count = cfg.workers as u64;
        let shared = Arc::new(Shared {
            source: Mutex::new(Source { next_seq: 0, jobs, closed: false }),
            turn: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let work = Arc::new(work);
        let mut handles = Vec::with_capacity(cfg.workers);
        let mut rxs = Vec::with_capacity(cfg.workers);
        let sh = shared.clone();
        let stop: Box<dyn Fn() + Send + Sync> = Box::new(move || {
            sh.stop.store(true, Ordering::Release);
            sh.source.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
            sh.turn.notify_all();
        });
        for w in 0..w_count {
            let (tx, rx) = bounded::<Result<T, Error>>(cfg.depth);
            rxs.push(rx);
            let (shared, work) = (shared.clone(), work.clone());
            let spawned = std::thread::Builder::new().name(format!("fx-data-prefetch-{w}")).spawn(move || loop {
                // Wait for this worker's turn, then take the next job.
                let (seq, job) = {
                    let mut g = shared.source.lock().unwrap_or_else(|p| p.into_inner());
                    while !g.closed && g.next_seq % w_count != w {
                        // The timeout only guards against a missed wake-up.
                        g = shared.turn.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|p| p.into_inner()).0;
                    }
                    if g.closed || shared.stop.load(Ordering::Acquire) {
                        return;
                    }
                    let seq = g.next_seq;
                    let next = catch_unwind(AssertUnwindSafe(|| g.jobs.next()));
                    let job = match next {
                        Ok(Some(job)) => Ok(job),
                        Ok(None) => {
                            g.closed = true;
                            shared.turn.notify_all();
                            return;
                        }
                        Err(p) => Err(Error::Worker(format!("job source panicked: {}", panic_text(&*p)))),
                    };
                    g.next_seq += 1;
                    if job.is_err() {
                        g.closed = true;
                    }
                    shared.turn.notify_all();
                    (seq, job)
                };
                let result = job.and_then(|job| {
                    catch_unwind(AssertUnwindSafe(|| work(job)))
                        .unwrap_or_else(|p| Err(Error::Worker(format!("job {seq} panicked: {}", panic_text(&*p)))))
                });
                let failed = result.is_err();
                if failed {
                    // Jobs already handed out still finish; no new ones start.
                    shared.source.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
                    shared.turn.notify_all();
                }
                // A closed channel means the consumer is gone: stop.
                if tx.send(result).is_err() || failed {
                    return;
                }
            });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    stop();
                    return Err(Error::Worker(format!("cannot start a worker thread: {e}")));
                }
            }
        }
        Ok(Prefetcher { rxs, stop, handles, next_seq: 0, done: false })
    }

    /// The next item if it is already finished, without blocking.
    pub fn try_next(&mut self) -> TryNext<T> {
        if self.done || self.rxs.is_empty() {
            return TryNext::End;
        }
        let w = (self.next_seq % self.rxs.len() as u64) as usize;
        match self.rxs[w].try_recv() {
            Ok(item) => {
                self.next_seq += 1;
                if item.is_err() {
                    self.done = true;
                }
                TryNext::Ready(item)
            }
            Err(crossbeam_channel::TryRecvError::Empty) => TryNext::Pending,
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                self.done = true;
                TryNext::End
            }
        }
    }

    /// Finished items waiting in the channels (for diagnostics and tests).
    pub fn ready(&self) -> usize {
        self.rxs.iter().map(|r| r.len()).sum()
    }
}

impl<T: Send + 'static> Iterator for Prefetcher<T> {
    type Item = Result<T, Error>;

    /// Blocks until the next item in job order is ready; `None` at the end.
    fn next(&mut self) -> Option<Result<T, Error>> {
        if self.done || self.rxs.is_empty() {
            return None;
        }
        let w = (self.next_seq % self.rxs.len() as u64) as usize;
        match self.rxs[w].recv() {
            Ok(item) => {
                self.next_seq += 1;
                if item.is_err() {
                    self.done = true;
                }
                Some(item)
            }
            // The worker owning this position exited: the source has ended.
            Err(_) => {
                self.done = true;
                None
            }
        }
    }
}

impl<T: Send + 'static> Drop for Prefetcher<T> {
    fn drop(&mut self) {
        (self.stop)();
        // Closing the channels wakes workers blocked on a full channel.
        self.rxs.clear();
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
        assert!(ran.load(Ordering::Relaxed) <= 1 + cfg.workers * (cfg.depth + 1));
        let t = Instant::now();
        drop(p);
        assert!(t.elapsed() < Duration::from_secs(1));
        // The closure (and its captured Arc) is gone: every worker has exited.
        assert_eq!(Arc::strong_count(&alive), 1);
    }

    #[test]
    fn try_next_does_not_block() {
        let gate = Arc::new(AtomicBool::new(false));
        let g = gate.clone();
        let mut p = Prefetcher::spawn(&PrefetchConfig::default(), 0..3u32, move |j| {
            while !g.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(j)
        })
        .unwrap();
        assert!(matches!(p.try_next(), TryNext::Pending));
        gate.store(true, Ordering::Release);
        assert_eq!(p.next().unwrap().unwrap(), 0);
        let mut got = vec![];
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            match p.try_next() {
                TryNext::Ready(r) => got.push(r.unwrap()),
                TryNext::Pending => std::thread::yield_now(),
                TryNext::End => break,
            }
        }
        assert_eq!(got, vec![1, 2]);
    }

    #[test]
    fn refuses_zero_depth() {
        assert!(Prefetcher::spawn(&PrefetchConfig { depth: 0, workers: 1 }, 0..1, Ok::<i32, Error>).is_err());
    }
}
