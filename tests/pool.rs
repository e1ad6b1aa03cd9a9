//! The kernels' thread pool under panics: a chunk that panics on a helper or on the caller
//! reaches the caller as a panic, never a hang; `run` returns or unwinds only once every
//! helper is out of the job; and the pool keeps working for later jobs. Each test has its
//! own `Pool::with_helpers`, and runs under a deadline so that a hang fails instead of
//! stalling the suite.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};
use tiny_decoder::model::pool::Pool;

/// How long a test may take before it counts as hung.
const DEADLINE: Duration = Duration::from_secs(30);
/// How long a test waits for something to happen inside a job (less than [`DEADLINE`], so
/// the failure names what did not happen).
const WAIT: Duration = Duration::from_secs(10);

/// Whether the current thread is one of the pool's helpers (they are named `matvec-N`).
fn on_helper() -> bool {
    thread::current()
        .name()
        .is_some_and(|n| n.starts_with("matvec-"))
}

/// Runs `test` on its own thread and fails if it has not finished within [`DEADLINE`].
fn within_deadline<T: Send + 'static>(test: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(test());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("hung for more than {DEADLINE:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test thread panicked"),
    }
}

/// Spins until `cond` holds or [`WAIT`] passes; returns whether it held.
fn wait_for(cond: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > WAIT {
            return false;
        }
        thread::yield_now();
    }
    true
}

/// The message of a panic payload.
fn message(p: &(dyn std::any::Any + Send)) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "<not a string>".into(),
    }
}

/// A job of `n` chunks on `pool` in which a helper must take at least one chunk: a chunk on
/// the caller waits (up to [`WAIT`]) until a helper has started one. Returns how many
/// chunks helpers ran, and panics unless every chunk ran exactly once.
fn healthy_job(pool: &Pool, n: usize) -> usize {
    let ran: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
    let on_helpers = AtomicUsize::new(0);
    pool.run(n, &|i| {
        if on_helper() {
            on_helpers.fetch_add(1, SeqCst);
        } else {
            wait_for(|| on_helpers.load(SeqCst) > 0);
        }
        ran[i].fetch_add(1, SeqCst);
    });
    let counts: Vec<usize> = ran.iter().map(|c| c.load(SeqCst)).collect();
    assert!(
        counts.iter().all(|&c| c == 1),
        "chunk run counts {counts:?}"
    );
    on_helpers.load(SeqCst)
}

#[test]
fn a_panic_on_a_helper_reaches_the_caller() {
    within_deadline(|| {
        let pool = Pool::with_helpers(1);
        let entered = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(4, &|_| {
                if on_helper() {
                    entered.fetch_add(1, SeqCst);
                    panic!("helper chunk failed");
                }
                // The caller's chunks wait for the helper, so it surely takes one.
                assert!(
                    wait_for(|| entered.load(SeqCst) > 0),
                    "no helper took a chunk"
                );
            })
        }));
        let err = result.expect_err("run returned normally though a chunk panicked");
        assert_eq!(message(err.as_ref()), "helper chunk failed");
        // The helper survived: the next job runs, with its help, to the end.
        assert!(
            healthy_job(&pool, 8) > 0,
            "no helper ran a chunk after the panic"
        );
    })
}

#[test]
fn a_panic_on_the_caller_waits_for_helpers() {
    within_deadline(|| {
        let pool = Pool::with_helpers(1);
        // Helpers currently inside a chunk; they sleep there, then leave.
        let inside = AtomicUsize::new(0);
        let entered = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(2, &|_| {
                if on_helper() {
                    inside.fetch_add(1, SeqCst);
                    entered.fetch_add(1, SeqCst);
                    thread::sleep(Duration::from_millis(300));
                    inside.fetch_sub(1, SeqCst);
                } else {
                    assert!(
                        wait_for(|| entered.load(SeqCst) > 0),
                        "no helper took a chunk"
                    );
                    panic!("caller chunk failed");
                }
            })
        }));
        // Read before anything else: a helper still inside the job would be using the
        // caller's `Job` after `run` unwound past it.
        let still_inside = inside.load(SeqCst);
        let err = result.expect_err("run returned normally though a chunk panicked");
        assert_eq!(message(err.as_ref()), "caller chunk failed");
        assert_eq!(
            still_inside, 0,
            "run unwound while a helper was inside the job"
        );
        assert!(
            healthy_job(&pool, 8) > 0,
            "no helper ran a chunk after the panic"
        );
    })
}

#[test]
fn a_panic_in_a_serial_job_reaches_the_caller() {
    within_deadline(|| {
        let pool = Pool::with_helpers(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(3, &|i| assert_ne!(i, 1, "chunk 1 failed"))
        }));
        assert!(result.is_err());
        let ran = AtomicUsize::new(0);
        pool.run(5, &|_| {
            ran.fetch_add(1, SeqCst);
        });
        assert_eq!(ran.load(SeqCst), 5);
    })
}

#[test]
fn many_jobs_run_every_chunk_once() {
    within_deadline(|| {
        let pool = Pool::with_helpers(2);
        for n in [0, 1, 2, 3, 7, 64, 1000] {
            let ran: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                ran[i].fetch_add(1, SeqCst);
            });
            assert!(ran.iter().all(|c| c.load(SeqCst) == 1), "n = {n}");
        }
    })
}

/// Threads of this process named `matvec-*` (Linux; 0 elsewhere).
fn helper_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("matvec-"))
        .count()
}

#[test]
fn a_dropped_pool_lets_its_helpers_go() {
    within_deadline(|| {
        for _ in 0..20 {
            let pool = Pool::with_helpers(2);
            assert_eq!(pool.threads(), 3);
            assert!(
                healthy_job(&pool, 4) > 0,
                "no helper ran a chunk of a new pool"
            );
        }
        // 40 helpers were started; the other tests' pools hold at most 4 at a time.
        let gone = wait_for(|| helper_threads() <= 8);
        assert!(gone, "{} helper threads still alive", helper_threads());
    })
}

#[test]
fn shares_run_every_piece_once() {
    within_deadline(|| {
        for helpers in [0, 1, 2] {
            let pool = Pool::with_helpers(helpers);
            for n in [0, 1, 2, 3, 7, 64, 1000] {
                let ran: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run_shares(n, &|i| {
                    ran[i].fetch_add(1, SeqCst);
                });
                let counts: Vec<usize> = ran.iter().map(|c| c.load(SeqCst)).collect();
                assert!(
                    counts.iter().all(|&c| c == 1),
                    "{helpers} helpers, n = {n}: {counts:?}"
                );
            }
        }
    })
}

/// A helper held up in its first piece (as a descheduled thread is) does not hold the
/// product up: the caller, done with its own run, takes the rest of the helper's from its
/// back. One chunk a thread, the caller would wait for the helper's run instead, and the
/// helper here waits (up to [`WAIT`]) for the caller to have run 12 of the 16 pieces; the
/// caller waits for the helper to start one first, so that each holds a run of its own.
#[test]
fn shares_of_a_held_up_thread_are_taken_over() {
    within_deadline(|| {
        let pool = Pool::with_helpers(1);
        let ran: Vec<AtomicUsize> = (0..16).map(|_| AtomicUsize::new(0)).collect();
        let (on_caller, held) = (AtomicUsize::new(0), AtomicUsize::new(0));
        pool.run_shares(16, &|i| {
            if on_helper() && held.fetch_add(1, SeqCst) == 0 {
                wait_for(|| on_caller.load(SeqCst) >= 12);
            } else if !on_helper() {
                // Until the helper holds a run of its own, the caller's first piece waits.
                wait_for(|| held.load(SeqCst) > 0);
                on_caller.fetch_add(1, SeqCst);
            }
            ran[i].fetch_add(1, SeqCst);
        });
        assert!(ran.iter().all(|c| c.load(SeqCst) == 1));
        assert!(
            on_caller.load(SeqCst) >= 12,
            "the caller ran {} of 16 pieces",
            on_caller.load(SeqCst)
        );
    })
}

#[test]
fn a_panic_in_a_share_reaches_the_caller() {
    within_deadline(|| {
        let pool = Pool::with_helpers(1);
        for bad in [0, 7, 15] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run_shares(16, &|i| assert_ne!(i, bad, "piece {bad}"));
            }));
            let p = r.expect_err("the panic was lost");
            assert!(message(p.as_ref()).contains(&format!("piece {bad}")));
        }
        assert!(healthy_job(&pool, 4) > 0, "the pool stopped working");
    })
}
