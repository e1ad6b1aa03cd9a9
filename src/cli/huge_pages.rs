//! The loaded weights moved into 2 MiB pages (Linux's transparent huge pages), once, after
//! the load. Decode reads every weight once a token, and in 4 KiB pages each 4 KiB of it is
//! a TLB miss, a page walk that on a virtual machine walks the host's tables too: one
//! thread summing a 256 MiB buffer on the 2-core Zen 4 VM read 16.5 GB/s in 4 KiB pages and
//! 32 GB/s in 2 MiB ones (two threads 24 and 34). Most distributions give huge pages only
//! to memory that asks (`transparent_hugepage/enabled = madvise`), and a weight of SmolLM2
//! (0.2-2 MB) is a piece of malloc's heap, not an allocation of its own: so the heap and
//! malloc's own mappings of large blocks are collapsed into huge pages where they stand
//! (`MADV_COLLAPSE`, Linux 6.1; elsewhere nothing changes). Not asked for later faults
//! (`MADV_HUGEPAGE`): a prompt's fresh buffers would then wait for whole huge pages, which
//! on this VM cost more than small ones where the host had not backed them yet (256 MiB
//! touched: 0.59 s against 0.14 s).
//!
//! The cost is copying the pages: 0.06 s for 256 MiB where the VM had huge pages at hand,
//! up to 0.5 s where the host had to back them first, and ~10 s for a 1.7B model's 3.4 GB
//! of bf16 there. So `bench` waits for it (it measures the steady state), and the commands
//! that start work at once (generate, chat, eval, serve) leave it to a thread of its own:
//! the pages move while the model runs (the kernel keeps their contents; a read of a page
//! being moved waits for it), and decode speeds up as they land.
//!
//! `serve` starts it once its KV pool is allocated and written (`serve::Options::allocated`),
//! so that the pool moves too (started at the load, it read the process's map before the pool
//! was in it: 112 of 867 MB in huge pages against 850): a batched step reads every sequence's
//! cache a block of 32 positions at a time, a page each. SmolLM2-135M Q4_0,
//! `bench_serve.py --burst 8 --rounds 6` (Zen 5), two runs each, 8 streams: 1474 and 1425 ->
//! 1481 and 1503 tok/s.
//!
//! `bench`'s read of the machine's bandwidth goes through the same pages, so that decode's
//! read compares with it.
//!
//! Done here, in the command line, not in the library: it acts on the whole process's
//! memory, which is the program's business, not a library's.

/// Collapses the heap and the anonymous mappings of at least [`MMAP_MIN`] (malloc's own
/// mappings of large blocks) into huge pages. Thread stacks (smaller) and files are left
/// alone. Failures are ignored: the memory stays as it was.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn into_huge_pages() {
    const HUGE: usize = 2 << 20;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return;
    };
    for (start, end) in maps.lines().filter_map(anonymous_region) {
        let (start, end) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if end <= start {
            continue;
        }
        let p = start as *mut libc::c_void;
        // SAFETY: advice on pages this process maps read-write, privately and anonymously
        // (its heap or malloc's mappings); collapsing keeps their contents.
        unsafe {
            libc::madvise(p, end - start, libc::MADV_COLLAPSE);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn into_huge_pages() {}

/// [`into_huge_pages`] on a thread of its own (see the file's header); nothing if the
/// thread cannot start.
pub(super) fn in_background() {
    let _ = std::thread::Builder::new()
        .name("huge-pages".into())
        .spawn(into_huge_pages);
}

/// Anonymous mappings below this are not malloc's (main.rs sets its mmap threshold to 32
/// MiB); thread stacks are among them.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_MIN: usize = 32 << 20;

/// A line of /proc/self/maps (`start-end perms offset dev inode [path]`) as (start, end)
/// when it is the heap, or a private read-write anonymous mapping of at least
/// [`MMAP_MIN`] bytes.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn anonymous_region(line: &str) -> Option<(usize, usize)> {
    let mut fields = line.split_whitespace();
    let (range, perms) = (fields.next()?, fields.next()?);
    let path = fields.nth(3);
    let (a, b) = range.split_once('-')?;
    let (a, b) = (
        usize::from_str_radix(a, 16).ok()?,
        usize::from_str_radix(b, 16).ok()?,
    );
    let wanted = match path {
        Some("[heap]") => true,
        None => b.saturating_sub(a) >= MMAP_MIN,
        Some(_) => false,
    };
    (wanted && perms == "rw-p").then_some((a, b))
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn takes_the_heap_and_large_anonymous_mappings_only() {
        let big = format!(
            "7f0000000000-{:x} rw-p 00000000 00:00 0",
            0x7f00_0000_0000usize + MMAP_MIN
        );
        assert_eq!(
            anonymous_region(&big),
            Some((0x7f00_0000_0000, 0x7f00_0000_0000 + MMAP_MIN))
        );
        let heap = "55d0a1c00000-55d0a5000000 rw-p 00000000 00:00 0  [heap]";
        assert_eq!(
            anonymous_region(heap),
            Some((0x55d0_a1c0_0000, 0x55d0_a500_0000))
        );
        for other in [
            "7f0000000000-7f0000200000 rw-p 00000000 00:00 0", // a thread stack
            "7ffd00000000-7ffd04000000 rw-p 00000000 00:00 0  [stack]",
            "7f1000000000-7f1010000000 r--p 00000000 08:01 1234  /m/model.gguf", // a file
            "7f2000000000-7f2010000000 r--p 00000000 00:00 0",                   // not writable
            "garbage",
        ] {
            assert_eq!(anonymous_region(other), None, "{other}");
        }
    }
}
