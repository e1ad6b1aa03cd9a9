//! The command line's shape (clap derive): commands, their flags and defaults. Names follow
//! DESIGN.md's contract.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "tiny-decoder",
    version,
    about = "A small, readable decoder-only transformer engine"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Generate text from a prompt (streams to stdout, statistics to stderr).
    Generate(GenerateArgs),
    /// Mean negative log-likelihood and perplexity of a text file.
    Eval(EvalArgs),
    /// Describe a model from its config and safetensors headers (no weights are read).
    Info {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        json: bool,
    },
    /// Time prefill and decode on synthetic ids (a checkpoint, or random weights from a config).
    Bench(BenchArgs),
}

/// Where the model comes from and how it runs.
#[derive(Args)]
pub struct ModelArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model name (tiny-gqa, ...).
    #[arg(short, long)]
    pub model: String,
    #[command(flatten)]
    pub placement: Placement,
}

#[derive(Args, Clone)]
pub struct Placement {
    /// auto (the checkpoint's own dtype; f16 runs as f32 on CPU), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// cpu, or cuda in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score (UTF-8).
    #[arg(long)]
    pub file: PathBuf,
    /// Window length in tokens (default: the model's context length).
    #[arg(long)]
    pub context: Option<usize>,
    /// Tokens between window starts (default: --context minus 1, so windows overlap by one
    /// token and every token after the first is scored once).
    #[arg(long)]
    pub stride: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct BenchArgs {
    #[arg(
        short,
        long,
        conflicts_with = "config",
        required_unless_present = "config"
    )]
    pub model: Option<String>,
    /// A config.json: random weights, no checkpoint needed.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub placement: Placement,
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// MLA models: cache `latent` (default) or the up-projected per-head K/V (`expanded`).
    #[arg(long, default_value = "latent", value_parser = ["latent", "expanded"])]
    pub mla_cache: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct GenerateArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model: tiny-mha, tiny-gqa
    /// (the default), tiny-mqa, tiny-mla.
    #[arg(short, long)]
    pub model: Option<String>,
    #[arg(short, long)]
    pub prompt: String,
    #[arg(short = 'n', long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// 0 is greedy decoding.
    #[arg(short, long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    #[arg(short, long, default_value_t = 299792458)]
    pub seed: u64,
    #[command(flatten)]
    pub placement: Placement,
    #[arg(long)]
    pub json: bool,
}
