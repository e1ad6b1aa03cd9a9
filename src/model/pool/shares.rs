//! [`Pool::run_shares`]: a loop over pieces that stream their data, one run of adjacent
//! pieces a thread, the first thread done taking the others' last pieces from their backs.

use super::Pool;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};

impl Pool {
    /// `f(p)` for every piece `p < pieces`, each once, over the caller and the helpers as
    /// [`run`](Self::run), for loops that stream their data: the pieces fall in one run of
    /// adjacent pieces a thread, which the first thread to come takes front to back (one
    /// stream, as one chunk a thread reads it); a thread done with its own run takes what
    /// is left of another's from its back, a piece at a time. So a thread that came late,
    /// runs slower or was descheduled mid-product holds the product up by a piece, not by
    /// its whole run. A piece that panics reaches the caller as in `run`, once the other
    /// threads are done with the pieces they could still take.
    pub fn run_shares(&self, pieces: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(pieces <= u32::MAX as usize, "run_shares: {pieces} pieces");
        let shares = self.threads().min(pieces);
        if shares <= 1 {
            return (0..pieces).for_each(f);
        }
        let runs: Vec<Run> = (0..shares)
            .map(|s| Run::new(s * pieces / shares, (s + 1) * pieces / shares))
            .collect();
        let owners = AtomicUsize::new(0);
        // Every call takes a run of its own while one is left, then pieces from the others'
        // backs until none is left: a call that comes after the rest are taken does nothing.
        self.run(shares, &|_| {
            loop {
                let s = owners.fetch_add(1, SeqCst);
                let Some(run) = runs.get(s) else { break };
                while let Some(p) = run.take(true) {
                    f(p);
                }
            }
            while let Some(run) = runs
                .iter()
                .max_by_key(|r| r.left())
                .filter(|r| r.left() > 0)
            {
                if let Some(p) = run.take(false) {
                    f(p);
                }
            }
        });
    }
}

/// What is left of a thread's run of pieces in [`Pool::run_shares`]: `front << 32 | back`,
/// pieces `front..back`, alone on its cache line.
#[repr(align(128))]
struct Run(AtomicU64);

impl Run {
    fn new(front: usize, back: usize) -> Run {
        Run(AtomicU64::new(((front as u64) << 32) | back as u64))
    }

    fn left(&self) -> u64 {
        let v = self.0.load(SeqCst);
        (v & u32::MAX as u64).saturating_sub(v >> 32)
    }

    /// The piece at the front (`true`) or the back, taken, or `None` if none is left.
    fn take(&self, front: bool) -> Option<usize> {
        let mut v = self.0.load(SeqCst);
        loop {
            let (a, b) = (v >> 32, v & u32::MAX as u64);
            if a >= b {
                return None;
            }
            let (next, p) = match front {
                true => (((a + 1) << 32) | b, a),
                false => ((a << 32) | (b - 1), b - 1),
            };
            match self.0.compare_exchange(v, next, SeqCst, SeqCst) {
                Ok(_) => return Some(p as usize),
                Err(now) => v = now,
            }
        }
    }
}
