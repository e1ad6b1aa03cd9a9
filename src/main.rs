//! The `tiny-decoder` command line: generate, eval, info, bench ([`cli`]). Errors end here
//! as one line on stderr and a non-zero exit; clap's own messages are printed whole.

mod cli;

use clap::Parser;
use cli::args::{Cli, Command};

fn run() -> anyhow::Result<i32> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print to stdout and exit 0; usage errors print their whole
        // message (which argument, what was expected, the usage line) and exit 2.
        Err(e) => e.exit(),
    };
    match cli.command {
        Command::Generate(a) => cli::run_generate(a),
        Command::Eval(a) => cli::run_eval(a).map(|_| 0),
        Command::Info { model, json } => cli::run_info(model, json).map(|_| 0),
        Command::Bench(b) => cli::run_bench(b).map(|_| 0),
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
    pin_thread_count();
    std::panic::set_hook(Box::new(|info| {
        eprintln!(
            "error: internal error: {}",
            info.to_string().replace('\n', " ")
        );
    }));
    match run() {
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
