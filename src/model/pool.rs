//! A tiny persistent pool for our kernels (matrix products, decode attention): the calling
//! thread works too, helpers spin briefly between jobs and then sleep, and chunks are handed
//! out by an atomic counter.
//!
//! Why not rayon: a call from outside rayon's pool parks the caller on a latch and wakes a
//! worker, two context switches per product (measured 12-20 µs on a shared 2-core machine,
//! against ~210 products per token). Here a product costs one atomic store when a helper is
//! spinning, and if no helper shows up the caller simply does every chunk itself.

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper polls for the next job before it sleeps on the condvar. It polls with
/// `yield_now`, so on a busy machine it gives its core to whoever else is runnable.
const SPIN: Duration = Duration::from_micros(100);

/// One parallel loop: `f(i)` for every chunk `i < n`. Lives on the caller's stack.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// The next chunk to hand out.
    next: AtomicUsize,
    /// Chunks finished.
    done: AtomicUsize,
}

impl Job<'_> {
    /// Takes and runs chunks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n {
                return;
            }
            (self.f)(i);
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Shared {
    /// The current job, or null. Only read by a helper that has counted itself in `active`.
    job: AtomicPtr<Job<'static>>,
    /// Bumped for every job, so a helper knows there is something new.
    generation: AtomicU64,
    /// Helpers that may be holding the job pointer; the caller waits for 0 before returning.
    active: AtomicUsize,
    /// Helpers asleep (or about to sleep) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

pub struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
    /// One caller at a time; a second concurrent caller runs its loop alone.
    caller: Mutex<()>,
}

impl Pool {
    /// The process-wide pool: candle's thread count (`RAYON_NUM_THREADS` or the physical
    /// cores) minus the caller.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            Pool::with_helpers(candle_core::utils::get_num_threads().saturating_sub(1))
        })
    }

    /// A pool of its own with `helpers` threads besides the caller (fewer if the OS refuses
    /// some).
    pub fn with_helpers(helpers: usize) -> Pool {
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let spawned = (0..helpers)
            .filter(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("matvec-{i}"))
                    .spawn(move || helper(&s))
                    .is_ok()
            })
            .count();
        Pool {
            shared,
            helpers: spawned,
            caller: Mutex::new(()),
        }
    }

    /// Threads that run a job, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers + 1
    }

    /// Runs `f(i)` for `i in 0..n`, spread over the caller and the helpers; returns when all
    /// are done.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let job = Job {
            f,
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
        };
        let Ok(_guard) = self.caller.try_lock() else {
            return job.work();
        };
        if self.helpers == 0 || n <= 1 {
            return job.work();
        }
        let s = &self.shared;
        // SAFETY: the pointer is published only until the end of this call: it is cleared
        // below, and we wait for `active == 0`, so no helper dereferences it after `job` dies.
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        s.job.store(ptr, SeqCst);
        s.generation.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        job.work();
        // A helper may be descheduled mid-chunk: yield so it can run on this core.
        while job.done.load(SeqCst) < n {
            std::thread::yield_now();
        }
        s.job.store(std::ptr::null_mut(), SeqCst);
        while s.active.load(SeqCst) > 0 {
            std::thread::yield_now();
        }
    }
}

/// A helper's life: wait for a new generation (spin, then sleep), help with the job, repeat.
fn helper(s: &Shared) {
    let mut seen = s.generation.load(SeqCst);
    loop {
        let start = Instant::now();
        while s.generation.load(SeqCst) == seen && start.elapsed() < SPIN {
            std::thread::yield_now();
        }
        if s.generation.load(SeqCst) == seen {
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, SeqCst);
            while s.generation.load(SeqCst) == seen {
                l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, SeqCst);
        }
        seen = s.generation.load(SeqCst);
        s.active.fetch_add(1, SeqCst);
        let p = s.job.load(SeqCst);
        if !p.is_null() {
            // SAFETY: we counted ourselves in `active` before loading `p`, and the caller
            // clears `job` and then waits for `active == 0` before its `Job` goes out of
            // scope, so `p` points at a live Job for as long as we use it.
            unsafe { &*p }.work();
        }
        s.active.fetch_sub(1, SeqCst);
    }
}
