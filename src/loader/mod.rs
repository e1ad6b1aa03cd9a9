//! From a `--model` argument to a ready model: a local directory or a hub repo id becomes
//! files (config.json, one or many safetensors, tokenizer files, generation_config.json),
//! which become a validated config, memory-mapped weights at the chosen dtype, a tokenizer
//! and what the checkpoint's own files say about using it ([`meta`]). Quantized or exotic
//! checkpoints are refused from their config and safetensors headers before any weight is
//! read ([`headers`]). A GGUF file gives the same from one file ([`gguf`]).

pub mod bundled;
mod dtype;
mod files;
pub mod gguf;
pub mod headers;
mod hub;
pub mod meta;
mod source;
mod weights;

use crate::config::GenerationConfig;
pub use dtype::{label as dtype_label, name as dtype_name, parse_device, DTypeArg};
pub use files::ModelFiles;
pub use meta::{TextTokenizer, TokenizerMeta};
pub use source::{open, resolve, Rewrite, Source, Stored};

use crate::config::{HfConfig, ModelConfig};
use crate::error::{candle_message, Error, Result};
use crate::model::Transformer;
use candle_core::quantized::GgmlDType;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use candle_nn::var_builder::SimpleBackend;
use headers::TensorInfo;
use std::path::Path;
use tokenizers::Tokenizer;

/// A model described from its files alone (`info`).
#[derive(Debug, Clone)]
pub struct Description {
    pub cfg: ModelConfig,
    pub num_parameters: usize,
    /// Bytes the weights would take as run (quantized projections counted in blocks).
    pub weight_bytes: usize,
    /// The dtype it would run in, and the one its safetensors hold.
    pub dtype: DType,
    /// The block format of the layers' projections with `--dtype q8_0|q4_0`.
    pub quantization: Option<GgmlDType>,
    pub checkpoint_dtype: Option<DType>,
}

impl Description {
    /// `tensors` (by their Hugging Face names) run at `dtype` resolved to `run`: the bytes
    /// count quantized projections in blocks, by the rule the loader applies.
    fn new(
        cfg: ModelConfig,
        tensors: &[TensorInfo],
        num_parameters: usize,
        (dtype, run): (DTypeArg, DType),
        checkpoint_dtype: Option<DType>,
    ) -> Self {
        let saved = match dtype.quantization() {
            Some(q) => headers::quantization_saved_bytes(tensors, run, q, cfg.tie_word_embeddings),
            None => 0,
        };
        Self {
            num_parameters,
            weight_bytes: ((num_parameters * run.size_in_bytes()) as isize - saved) as usize,
            dtype: run,
            quantization: dtype.quantization(),
            checkpoint_dtype,
            cfg,
        }
    }
}

/// A loaded model with what the CLI reports about it.
pub struct Loaded {
    pub model: Transformer,
    pub tokenizer: Option<TextTokenizer>,
    /// tokenizer_config.json and chat_template.jinja: special tokens, chat template.
    pub meta: TokenizerMeta,
    /// generation_config.json (its stop ids are already in the model's config).
    pub generation: GenerationConfig,
    pub num_parameters: usize,
    /// The floating-point dtype most of the checkpoint's bytes are stored in.
    pub checkpoint_dtype: Option<DType>,
}

impl Loaded {
    /// A model with nothing around it: no tokenizer, no tokenizer or generation files.
    fn bare(model: Transformer, num_parameters: usize, checkpoint_dtype: Option<DType>) -> Self {
        Self {
            model,
            tokenizer: None,
            meta: TokenizerMeta::default(),
            generation: GenerationConfig::default(),
            num_parameters,
            checkpoint_dtype,
        }
    }

    /// Bytes of the weights at the dtype (and block format) they run in.
    pub fn weight_bytes(&self) -> usize {
        let dense = self.num_parameters * self.model.dtype().size_in_bytes();
        (dense as isize - self.model.quantization_saved_bytes()) as usize
    }

    /// What `--json` reports as `dtype`: `q8_0`/`q4_0` when quantized, else `f32`, `bf16`...
    pub fn dtype_label(&self) -> &'static str {
        dtype::label(self.model.dtype(), self.model.quantization())
    }
}

/// `--dtype` resolved for a checkpoint whose config is `hf` and whose bytes are mostly
/// `stored` (see [`DTypeArg::resolve`]).
fn run_dtype(dtype: DTypeArg, hf: &HfConfig, stored: Option<DType>, dev: &Device) -> Result<DType> {
    Ok(dtype.resolve(hf.declared_dtype()?, stored, dev))
}

/// Reads and validates config.json; refuses quantized checkpoints by their config.
fn load_config(files: &ModelFiles) -> Result<(HfConfig, ModelConfig)> {
    let hf = HfConfig::from_file(&files.config)?;
    let cfg = hf.validate().map_err(|e| match e {
        Error::Config(msg) => Error::file(&files.config, msg),
        other => other,
    })?;
    Ok((hf, cfg))
}

pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path)
        .map_err(|e| Error::file(path, format!("not a valid tokenizer.json: {e}")))
}

/// Loads config, weights (memory-mapped) at `dtype` (`auto`: the checkpoint's), tokenizer
/// and the checkpoint's tokenizer and generation files.
pub fn load(files: &ModelFiles, dtype: impl Into<DTypeArg>, device: &Device) -> Result<Loaded> {
    load_rewritten(files, dtype.into(), device, None)
}

fn load_rewritten(
    files: &ModelFiles,
    dtype: DTypeArg,
    device: &Device,
    rewrite: Option<Rewrite>,
) -> Result<Loaded> {
    let (hf, mut cfg) = load_config(files)?;
    for path in &files.weights {
        if !path.is_file() {
            return Err(Error::file(path, "missing weights file"));
        }
    }
    let tensors = headers::read_checked(&files.weights)?;
    for path in &files.weights {
        // Parse every header up front so a broken file is named in the error.
        // SAFETY: the mapping is read-only; the file must not change while the model lives.
        // candle's message already names the file.
        unsafe { MmapedSafetensors::new(path) }.map_err(|e| Error::Weights(candle_message(&e)))?;
    }
    let meta = TokenizerMeta::read(
        files.tokenizer_config.as_deref(),
        files.chat_template.as_deref(),
    )?;
    let generation = GenerationConfig::read(files.generation_config.as_deref())?;
    let tokenizer = match &files.tokenizer {
        Some(path) => Some(load_tokenizer(path)?),
        None => None,
    };
    cfg.eos_token_ids = meta::stop_ids(&generation, &cfg.eos_token_ids, &meta, tokenizer.as_ref());
    let checkpoint_dtype = headers::main_float_dtype(&tensors);
    let quant = dtype.quantization();
    let dtype = run_dtype(dtype, &hf, checkpoint_dtype, device)?;
    // SAFETY: as above.
    let mapped = unsafe { MmapedSafetensors::multi(&files.weights) }?;
    let backend: Box<dyn SimpleBackend> = Box::new(weights::Unmapping(mapped));
    let (cfg, backend) = match rewrite {
        Some(rewrite) => rewrite(&cfg, backend)?,
        None => (cfg, backend),
    };
    let (model, num_parameters) =
        weights::build(&cfg, backend, dtype, quant.as_ref().map(|q| q as _), device)
            .map_err(|e| Error::Weights(format!("{}: {e}", files.source)))?;
    // Checked after the weights, whose own mismatch (a tensor's shape) names more.
    let tokenizer = match (tokenizer, &files.tokenizer) {
        (Some(t), Some(path)) => Some(TextTokenizer::new(
            checked_tokenizer(t, model.config(), path)?,
            &meta,
            path,
        )?),
        _ => None,
    };
    Ok(Loaded {
        tokenizer,
        meta,
        generation,
        ..Loaded::bare(model, num_parameters, checkpoint_dtype)
    })
}

/// A tokenizer whose vocabulary fits the model's.
fn checked_tokenizer(tok: Tokenizer, cfg: &ModelConfig, path: &Path) -> Result<Tokenizer> {
    let n = tok.get_vocab_size(true);
    if n > cfg.vocab_size {
        return Err(Error::file(
            path,
            format!(
                "the tokenizer has {n} tokens but vocab_size in config.json is {}",
                cfg.vocab_size
            ),
        ));
    }
    Ok(tok)
}

fn bundled_config(b: &bundled::Bundled) -> Result<HfConfig> {
    serde_json::from_str(b.config)
        .map_err(|e| Error::Invalid(format!("bundled {}: config.json: {e}", b.name)))
}

fn bundled_headers(b: &bundled::Bundled) -> Result<Vec<TensorInfo>> {
    headers::read_bytes(b.weights, Path::new(b.name))
}

/// Loads a model compiled into the binary (see [`bundled`]); it is stored in f32.
pub fn load_bundled(
    b: &bundled::Bundled,
    dtype: impl Into<DTypeArg>,
    device: &Device,
) -> Result<Loaded> {
    load_bundled_rewritten(b, dtype.into(), device, None)
}

fn load_bundled_rewritten(
    b: &bundled::Bundled,
    dtype: DTypeArg,
    device: &Device,
    rewrite: Option<Rewrite>,
) -> Result<Loaded> {
    let hf = bundled_config(b)?;
    let cfg = hf.validate()?;
    let checkpoint_dtype = headers::main_float_dtype(&bundled_headers(b)?);
    let quant = dtype.quantization();
    let dtype = run_dtype(dtype, &hf, checkpoint_dtype, device)?;
    let tensors = candle_core::safetensors::SliceSafetensors::new(b.weights)?;
    let backend: Box<dyn SimpleBackend> = Box::new(tensors);
    let (cfg, backend) = match rewrite {
        Some(rewrite) => rewrite(&cfg, backend)?,
        None => (cfg, backend),
    };
    let quant = quant.as_ref().map(|q| q as _);
    let (model, num_parameters) = weights::build(&cfg, backend, dtype, quant, device)?;
    let tokenizer = Tokenizer::from_bytes(b.tokenizer)
        .map_err(|e| Error::Tokenizer(format!("bundled {}: {e}", b.name)))?;
    Ok(Loaded {
        tokenizer: Some(TextTokenizer::plain(tokenizer)),
        ..Loaded::bare(model, num_parameters, checkpoint_dtype)
    })
}

/// A model with random weights from a config alone (for `bench --config`): N(0, 0.02),
/// norms 1. Refused up front when the weights would not fit this machine's memory.
pub fn random(
    cfg: &ModelConfig,
    dtype: DType,
    quant: Option<GgmlDType>,
    device: &Device,
) -> Result<Loaded> {
    let bytes = cfg
        .parameter_estimate()
        .saturating_mul(dtype.size_in_bytes());
    crate::config::check_fits(
        bytes,
        "random weights for this config",
        "lower vocab_size, hidden_size, intermediate_size or num_hidden_layers",
    )?;
    let quant = quant.as_ref().map(|q| q as _);
    let (model, num_parameters) =
        weights::build(cfg, Box::new(weights::RandomWeights), dtype, quant, device)?;
    Ok(Loaded::bare(model, num_parameters, None))
}
