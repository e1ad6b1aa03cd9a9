//! The `tiny-decoder` command line: generate, chat, eval, info, bench, serve, convert
//! ([`cli`]). Errors end here as one line on stderr and a non-zero exit; clap's own
//! messages are printed whole.

mod cli;

use clap::Parser;
use cli::args::{Cli, Command};

/// Keeps glibc's malloc from handing freed activation buffers back to the kernel. Each
/// forward allocates and frees buffers of a few MB (a prompt chunk's activations); by
/// default glibc serves them with fresh `mmap`s or trims its heap after each free, so every
/// forward page-faults its buffers in again (a third of prefill's time went to the kernel's
/// page-fault and page-clearing paths). With fixed thresholds freed memory is reused; the
/// peak RSS stays the same (it is set by the largest forward), it is only not given back.
/// SmolLM2-135M prefill of 512 tokens on the AVX2 host: bf16 290 -> 395 tok/s, f32 280 -> 300-390
/// (alternating runs). mimalloc was as fast but raised the peak RSS by 60 MB (356 -> 414).
///
/// `convert` (whose `--heal` trains: a step's autograd graph holds some 3 GB of activations
/// for SmolLM2, freed at once after the backward, above any trim threshold) never trims
/// (the peak is the same; the kernel no longer zeroes those pages again every step: a
/// quarter of the end-to-end training's time, 126 s -> 95 s for 15 steps).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory(convert: bool) {
    // glibc takes at most 32 MiB (half its heap size) for the mmap threshold on 64-bit.
    const MMAP: libc::c_int = 32 << 20;
    // -1: never trim (mallopt(3)).
    let trim: libc::c_int = if convert { -1 } else { 1 << 30 };
    // SAFETY: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory(_convert: bool) {}

/// candle's CPU ops run on its own pool, whose worker spins for 25,000 rounds after each op
/// before it sleeps, on the same cores that our pool and `gemm`'s rayon threads need next.
/// Every command sets the limit to 0 unless it is set (2 Zen 5 cores, alternating runs):
/// - `convert`, SmolLM2 `mla:64` with 15 steps of end-to-end training: 147 s -> 118 s, and
///   the calibration forwards 104 s -> 97 s;
/// - `bench`, SmolLM2 bf16: prefill of 512 tokens 1,577-1,620 -> 1,702-1,768 tok/s, of 8
///   prompts of 64 at once 1,853-1,922 -> 2,059-2,074; Q4_K_M 512 tokens 1,682-1,725 ->
///   1,758-1,837; decode unchanged within the noise.
fn quiet_candle_pool() {
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_none() {
        std::env::set_var(VAR, "0");
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Generate(a) => cli::run_generate(a),
        Command::Chat(a) => cli::run_chat(a).map(|_| 0),
        Command::Eval(a) => cli::run_eval(a).map(|_| 0),
        Command::Info { model, json } => cli::run_info(model, json).map(|_| 0),
        Command::Bench(b) => cli::run_bench(b).map(|_| 0),
        Command::Serve(a) => cli::run_serve(a).map(|_| 0),
        Command::Convert(a) => cli::run_convert(a).map(|_| 0),
    }
}

/// candle asks for its thread count on every matmul and, unless `RAYON_NUM_THREADS` is set,
/// works it out again by parsing /proc/cpuinfo: about 60 times per decode step here, 10% of
/// decode time on a 135M model. Count once, before any thread exists, and pin the answer.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print to stdout and exit 0; usage errors print their whole
        // message (which argument, what was expected, the usage line) and exit 2.
        Err(e) => e.exit(),
    };
    let convert = matches!(cli.command, Command::Convert(_));
    keep_freed_memory(convert);
    quiet_candle_pool();
    pin_thread_count();
    std::panic::set_hook(Box::new(|info| {
        eprintln!(
            "error: internal error: {}",
            info.to_string().replace('\n', " ")
        );
    }));
    match run(cli) {
        Ok(0) => {}
        Ok(code) => {
            use std::io::Write;
            let _ = std::io::stdout().flush();
            std::process::exit(code);
        }
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            std::process::exit(1);
        }
    }
}
