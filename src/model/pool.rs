//! A tiny persistent pool for our kernels (matrix products, decode attention): the calling
//! thread works too, helpers spin briefly between jobs and then sleep, and chunks are handed
//! out by an atomic counter. A chunk that panics stops the job: the panic is caught where
//! it happens and resumed in the caller once no helper is inside the job any more.
//! [`Pool::run_shares`] (`shares.rs`) hands out a streaming loop's pieces in one run a thread
//! instead, the first thread done taking over the others' last pieces.
//!
//! Why not rayon: a call from outside rayon's pool parks the caller on a latch and wakes a
//! worker, two context switches per product (measured 12-20 µs on a shared 2-core machine,
//! against ~210 products per token). Here a product costs one atomic store when a helper is
//! spinning, and if no helper shows up the caller simply does every chunk itself.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

mod shares;

/// How long a helper polls for the next job before it sleeps on the condvar. It polls with
/// `yield_now`, so on a busy machine it gives its core to whoever else is runnable, after its
/// first [`PAUSES`] polls.
const SPIN: Duration = Duration::from_micros(100);

/// Polls with the CPU's spin-wait hint (`pause`) before the first `yield_now`: a batched step
/// hands the pool ~150 jobs, each after a few microseconds of the caller's work, and a helper
/// inside `sched_yield` (a system call, slower still in a VM) saw each one late. SmolLM2-135M
/// Q4_0 `bench --batch 8` (Zen 5, 8 alternating rounds, medians): 1311 -> 1360 tok/s, one
/// sequence unchanged (406 / 406).
const PAUSES: u32 = 512;

/// One parallel loop: `f(i)` for every chunk `i < n`. Lives on the caller's stack.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// The next chunk to hand out; set to `n` after a panic, so the rest are skipped.
    next: AtomicUsize,
    /// The first chunk's panic, caught, for the caller to resume.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    fn new(f: &(dyn Fn(usize) + Sync), n: usize) -> Job<'_> {
        Job {
            f,
            n,
            next: AtomicUsize::new(0),
            panic: Mutex::new(None),
        }
    }

    /// Takes and runs chunks until none are left. A panic in a chunk is caught and kept, so
    /// it never unwinds out of a helper (which would then never finish) or out of the
    /// caller's share while helpers still use the job.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                self.next.store(self.n, SeqCst);
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert(p);
            }
        }
    }

    /// Resumes the first panic of a chunk, if any, in the caller.
    fn finish(self) {
        let panic = self.panic.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

/// Takes a job back from the helpers when dropped, on unwinding too: clears the published
/// pointer and waits until no helper can still hold it.
struct Retire<'a>(&'a Shared);

impl Drop for Retire<'_> {
    fn drop(&mut self) {
        self.0.job.store(std::ptr::null_mut(), SeqCst);
        // A helper may be descheduled mid-chunk: yield so it can run on this core.
        while self.0.active.load(SeqCst) > 0 {
            std::thread::yield_now();
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
    /// Set when the pool is dropped: helpers leave at the next generation.
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Shared {
    /// A new generation: wakes the helpers, spinning or asleep.
    fn bump(&self) {
        self.generation.fetch_add(1, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _l = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }
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
            stop: AtomicBool::new(false),
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
    /// are done. If a chunk panics, the chunks not yet started are skipped and the panic is
    /// resumed here, once no helper is inside the job any more.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let job = Job::new(f, n);
        // Poisoned only if a panic escaped an earlier `run` while holding it (none should):
        // the pool is fine either way.
        let guard = match self.caller.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if guard.is_some() && self.helpers > 0 && n > 1 {
            let s = &self.shared;
            // SAFETY: the pointer is published only until `_retire` drops, at the end of
            // this block or while unwinding from it: it clears the pointer and waits for
            // `active == 0`, so no helper dereferences it after `job` dies.
            let _retire = Retire(s);
            s.job
                .store(&job as *const Job<'_> as *mut Job<'static>, SeqCst);
            s.bump();
            job.work();
        } else {
            job.work();
        }
        drop(guard);
        job.finish()
    }
}

impl Drop for Pool {
    /// Lets the helpers go (they exit at their next wake-up).
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        self.shared.bump();
    }
}

/// A helper's life: wait for a new generation (spin, then sleep), help with the job, repeat.
fn helper(s: &Shared) {
    // Generation 0 is the pool's start: a job posted before this thread ran is still new.
    let mut seen = 0;
    loop {
        let start = Instant::now();
        let mut polls = 0u32;
        while s.generation.load(SeqCst) == seen && start.elapsed() < SPIN {
            polls += 1;
            match polls < PAUSES {
                true => std::hint::spin_loop(),
                false => std::thread::yield_now(),
            }
        }
        if s.generation.load(SeqCst) == seen {
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, SeqCst);
            while s.generation.load(SeqCst) == seen {
                l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, SeqCst);
        }
        if s.stop.load(SeqCst) {
            return;
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

/// Rows below this many values run in the caller alone in [`each_row`].
const PARALLEL_FROM: usize = 64 * 1024;

/// `f(r, row)` on each row `r` of `d` values of `out`, in place: in the caller, or over
/// the global [`Pool`] when there are many.
pub fn each_row(out: &mut [f32], d: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    each_rows(out, d, 1, |r, row| f(r, row))
}

/// `f(r, rows)` on each run of `n` rows of `d` values of `out` (fewer at the end) from row
/// `r`, in place: in the caller, or over the global [`Pool`] when there are many.
pub fn each_rows(out: &mut [f32], d: usize, n: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if d == 0 || n == 0 {
        return; // no rows, and no values to touch
    }
    let rows = out.len() / d;
    if out.len() < PARALLEL_FROM {
        // Whole rows only, as in the pool's share below.
        out[..rows * d]
            .chunks_mut(n * d)
            .enumerate()
            .for_each(|(c, rows)| f(c * n, rows));
        return;
    }
    let per = (PARALLEL_FROM / 4 / d + 1).next_multiple_of(n);
    let shared = Disjoint(out.as_mut_ptr());
    Pool::global().run(rows.div_ceil(per), &|c| {
        for r in (c * per..((c + 1) * per).min(rows)).step_by(n) {
            let len = n.min(rows - r) * d;
            // SAFETY: chunk c alone touches rows c·per.. of `out`, which holds rows · d values.
            f(r, unsafe {
                std::slice::from_raw_parts_mut(shared.at(r * d), len)
            });
        }
    });
}

/// An output that a job's chunks write in disjoint parts, each its own (what its user
/// vouches for where it writes through [`Disjoint::at`]).
pub struct Disjoint(pub *mut f32);
// SAFETY: its users write disjoint parts only, each from one chunk.
unsafe impl Sync for Disjoint {}

impl Disjoint {
    /// A method, not the field: a closure would capture the bare pointer, which is not Sync.
    pub fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}
