//! Work whose cost grows with what a client sent — parsing a large body,
//! rendering a chat template, tokenizing, detokenizing, counting a cached
//! answer's tokens — runs here, off the async workers, so that a client
//! sending huge inputs slows only its own requests: `/health`, streams and
//! every other request keep their workers. A fixed number of threads takes
//! the work; a bounded queue waits in front of them and refuses at once
//! when full.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tokio::sync::Semaphore;

/// Inputs up to this size are prepared inline on the async worker: their
/// cost is bounded by it (about a millisecond to tokenize 16 KiB of text).
pub const INLINE_BYTES: usize = 16 << 10;

/// Why a job did not run to the end.
#[derive(Debug, thiserror::Error)]
pub enum BlockingError {
    /// Every thread is busy and the queue is full.
    #[error("the server is busy preparing other requests ({0} are waiting); retry shortly")]
    Busy(usize),
    /// The job panicked or the runtime is shutting down.
    #[error("request preparation failed: {0}")]
    Failed(String),
}

/// A bounded pool for CPU-heavy request work.
pub struct BlockingPool {
    permits: Arc<Semaphore>,
    threads: usize,
    queue: usize,
    /// Jobs waiting or running.
    pending: AtomicUsize,
    refused: AtomicU64,
}

/// Takes one job off the pending count when the caller finishes or goes away.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl BlockingPool {
    /// `threads` jobs at once (0: half the cores, at least one), and at most
    /// `queue` more waiting.
    pub fn new(threads: usize, queue: usize) -> BlockingPool {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
            n => n,
        };
        BlockingPool {
            permits: Arc::new(Semaphore::new(threads)),
            threads,
            queue,
            pending: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Runs `work` for an input of `size` bytes: inline when the input is
    /// small enough that the work is bounded by a constant (a thread hop
    /// would cost more, and a small request must not queue behind huge
    /// ones), on the pool otherwise.
    pub async fn run_sized<T: Send + 'static>(
        &self,
        size: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, BlockingError> {
        if size <= INLINE_BYTES { Ok(work()) } else { self.run(work).await }
    }

    /// Runs `work` on a pool thread once one is free. A caller that goes
    /// away while waiting leaves the queue; one that goes away while its
    /// job runs lets the job finish (it holds its thread until then).
    pub async fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> Result<T, BlockingError> {
        let before = self.pending.fetch_add(1, Ordering::Relaxed);
        let _pending = Pending(&self.pending);
        if before >= self.threads + self.queue {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(BlockingError::Busy(before.saturating_sub(self.threads)));
        }
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| BlockingError::Failed("the pool is closed".into()))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .map_err(|e| BlockingError::Failed(e.to_string()))
    }

    /// Jobs waiting for a thread or running now.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// Jobs refused because the queue was full.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_frees_its_place_afterwards() {
        let pool = Arc::new(BlockingPool::new(1, 1));
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let running = tokio::spawn({
            let pool = pool.clone();
            async move { pool.run(move || wait.recv().is_ok()).await }
        });
        while pool.pending() < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let queued = tokio::spawn({
            let pool = pool.clone();
            async move { pool.run(|| 7).await }
        });
        while pool.pending() < 2 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(matches!(pool.run(|| 0).await, Err(BlockingError::Busy(1))));
        assert_eq!(pool.refused(), 1);
        release.send(()).expect("the job waits");
        assert!(running.await.expect("task").expect("ran"));
        assert_eq!(queued.await.expect("task").expect("ran"), 7);
        assert_eq!(pool.pending(), 0);
        assert_eq!(pool.run(|| 1).await.expect("room again"), 1);
    }
}
