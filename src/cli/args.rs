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
    /// Talk to an instruct model: one line per turn, /clear starts over, /exit or EOF ends.
    Chat(ChatArgs),
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
    /// An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health) that batches concurrent requests.
    Serve(ServeArgs),
    /// Convert a checkpoint's attention (--attention) and write it as a Hugging Face
    /// directory that transformers and this program load.
    Convert(ConvertArgs),
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
    /// The KV cache's dtype: auto (the weights' own; bf16 for block-quantized weights on
    /// CPU, as llama.cpp's 16-bit cache), f32 or bf16 (other than the weights' on CPU only).
    #[arg(long, value_name = "DTYPE", default_value = "auto")]
    pub kv_dtype: String,
    /// Convert the checkpoint's attention at load: mha, mqa, gqa:G (G K/V heads) with
    /// ,method=mean|aware, or lowrank:R (a rank-R latent of the keys and values) with
    /// ,method=svd|aware [default: aware, fitted on the calibration text].
    #[arg(long, value_name = "SPEC")]
    pub attention: Option<String>,
    /// The text method=aware calibrates on (and --heal trains on): a file, or a directory
    /// of them; repeat for more [default: the technical prose that ships with the program].
    #[arg(long, value_name = "PATH", requires = "attention")]
    pub calibration: Vec<PathBuf>,
    #[command(flatten)]
    pub heal: HealArgs,
}

#[derive(Args, Clone)]
pub struct HealArgs {
    /// After a lossy conversion (gqa:G, mqa, lowrank:R, mla:R), fit each layer's new
    /// attention to the original's output (least squares and AdamW, layer by layer), then
    /// train them all together towards the original's next-token distribution, on text the
    /// original writes itself unless --calibration is given (14-19 minutes for a 135M model
    /// on 2 cores).
    #[arg(long)]
    pub heal: bool,
    /// Optimiser steps per layer for --heal.
    #[arg(long, value_name = "N", default_value_t = tiny_decoder::convert::heal::STEPS, requires = "heal")]
    pub heal_steps: usize,
    /// Optimiser steps of --heal's end-to-end training after the layer-wise fit (every
    /// converted layer at once, towards the original's next-token distribution); 0: none.
    #[arg(long, value_name = "N", default_value_t = tiny_decoder::convert::heal::E2E_STEPS, requires = "heal")]
    pub heal_e2e_steps: usize,
    /// The learning rate of --heal's end-to-end training at its first step (AdamW; it
    /// decays linearly to a tenth by the last) [default: 3e-4, for mla:R and lowrank:R 1e-4].
    #[arg(long, value_name = "LR", requires = "heal")]
    pub heal_lr: Option<f64>,
    /// Tokens of text the original model writes itself (batched sampling from varied short
    /// prompts: questions through its chat template, and openings of articles, stories,
    /// letters, poems and dialogues) for --heal without --calibration.
    #[arg(long, value_name = "N", default_value_t = tiny_decoder::convert::heal::TOKENS, requires = "heal")]
    pub heal_tokens: usize,
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
    /// Sequences decoded together (each with its own prompt and cache): the report gives
    /// aggregate and per-sequence decode tok/s.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// MLA models: cache `latent` (default) or the up-projected per-head K/V (`expanded`).
    #[arg(long, default_value = "latent", value_parser = ["latent", "expanded"])]
    pub mla_cache: String,
    #[arg(long)]
    pub json: bool,
}

/// Sampling flags; one left out takes generation_config.json's value, else llama.cpp's
/// default (`tiny_decoder::sampling::defaults`).
#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// 0 is greedy decoding [default: generation_config.json's, else 0.8].
    #[arg(short, long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens, 0: off [default: generation_config.json's, else 40].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens up to this probability mass [default: ..., else 0.95].
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one [default: 0.05].
    #[arg(long, allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// Penalty on tokens already in the sequence, 1: off [default: ..., else 1].
    #[arg(long, allow_negative_numbers = true)]
    pub repeat_penalty: Option<f32>,
    /// Random seed [default: a random one, reported on stderr and in --json].
    #[arg(short, long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn requested(&self) -> tiny_decoder::sampling::Requested {
        tiny_decoder::sampling::Requested {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
        }
    }
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "messages"])))]
pub struct GenerateArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model: tiny-mha, tiny-gqa
    /// (the default), tiny-mqa, tiny-mla.
    #[arg(short, long)]
    pub model: Option<String>,
    /// The prompt: one user message when the model has a chat template; `-` reads stdin.
    /// Repeated, the prompts run as one batch.
    #[arg(short, long)]
    pub prompt: Vec<String>,
    /// Read prompts from a file, one per line, run as one batch.
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    /// An OpenAI-style JSON list of {"role", "content"} messages (needs a chat template).
    #[arg(long, conflicts_with = "raw")]
    pub messages: Option<PathBuf>,
    /// A system message before the prompt (needs a chat template).
    #[arg(long, conflicts_with_all = ["raw", "messages"])]
    pub system: Option<String>,
    /// Send the prompt as plain text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    #[arg(short = 'n', long, default_value_t = 256)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// End generation when the text contains STR (repeatable); STR is not printed.
    #[arg(long, value_name = "STR")]
    pub stop: Vec<String>,
    /// The output must be JSON valid under the JSON schema in FILE (masked each step).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// The output must match the Lark grammar in FILE (llguidance's dialect: a `start` rule).
    #[arg(long, value_name = "FILE", conflicts_with = "json_schema")]
    pub grammar: Option<PathBuf>,
    #[command(flatten)]
    pub placement: Placement,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ChatArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model (default tiny-gqa).
    #[arg(short, long)]
    pub model: Option<String>,
    /// The system message, kept when old turns are dropped to fit the context.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Tokens the conversation may hold (default: the model's context, at most 4096).
    #[arg(long)]
    pub context: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// End a reply when its text contains STR (repeatable).
    #[arg(long, value_name = "STR")]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub placement: Placement,
    /// One JSON object per turn (JSON lines) instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ServeArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model (default tiny-gqa).
    #[arg(short, long)]
    pub model: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port; the address is printed on stderr once bound.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests that run at once, sharing the KV pool (--kv-memory).
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Requests that may wait to be admitted; more are answered 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Tokens per request, prompt and completion (default: the model's context, at most 4096).
    #[arg(long)]
    pub context: Option<usize>,
    /// Bytes of the KV pool the running requests share, in blocks of 32 positions (e.g. 2G,
    /// 512M); at least one --context [default: --max-batch x --context positions].
    #[arg(long, value_name = "BYTES", value_parser = super::serve::parse_bytes)]
    pub kv_memory: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1/* [default: $TINY_DECODER_API_KEY, else none].
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Seconds a request may wait to be admitted; longer, it is answered 408 and dropped.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Connections open at once (kept below the file limit); more wait to be accepted.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a connection may take to send a request's head, or stay idle between
    /// requests; then it is closed.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub header_timeout: f64,
    /// Seconds a request's body may take to arrive; then it is answered 408.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub body_timeout: f64,
    /// Seconds running requests get to finish after SIGINT/SIGTERM; then they are cancelled.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub shutdown_timeout: f64,
    #[command(flatten)]
    pub placement: Placement,
}

#[derive(Args)]
pub struct ConvertArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model (safetensors only).
    #[arg(short, long)]
    pub model: String,
    /// The attention to convert to: mha, mqa, gqa:G with ,method=mean|aware, or lowrank:R
    /// with ,method=svd|aware [default: aware].
    #[arg(long, value_name = "SPEC")]
    pub attention: String,
    /// The text method=aware calibrates on (and --heal trains on): a file, or a directory
    /// of them; repeat for more [default: the technical prose that ships with the program].
    #[arg(long, value_name = "PATH")]
    pub calibration: Vec<PathBuf>,
    #[command(flatten)]
    pub heal: HealArgs,
    /// auto (each tensor in the checkpoint's dtype), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Where calibration and --heal run: cpu, or cuda in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The directory to write (must not exist, or be empty).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// One JSON object on stdout instead of a line of text.
    #[arg(long)]
    pub json: bool,
}
