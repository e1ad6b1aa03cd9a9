//! From a `--model` argument to a ready model: a local directory or a hub repo id becomes
//! files (config.json, one or many safetensors, tokenizer.json), which become a validated
//! config, memory-mapped weights and a tokenizer.

use crate::config::{HfConfig, ModelConfig, TokenIds};
use crate::error::{candle_message, Error, Result};
use crate::model::Transformer;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokenizers::Tokenizer;

/// The files of one checkpoint.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The directory (or hub id) the files came from, for messages.
    pub source: String,
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

/// A loaded model with what the CLI reports about it.
pub struct Loaded {
    pub model: Transformer,
    pub tokenizer: Option<Tokenizer>,
    pub num_parameters: usize,
    /// Bytes of the weights at the dtype they run in.
    pub weight_bytes: usize,
}

/// Parses `--dtype`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(Error::Invalid(format!(
            "unknown --dtype {other:?} (f32, f16, bf16)"
        ))),
    }
}

/// Parses `--device`; `cuda` needs a build with `--features cuda`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !candle_core::utils::cuda_is_available() => Err(Error::Invalid(
            "--device cuda: this build has no CUDA support (rebuild with --features cuda)".into(),
        )),
        "cuda" => Ok(Device::new_cuda(0)?),
        other => Err(Error::Invalid(format!(
            "unknown --device {other:?} (cpu, cuda)"
        ))),
    }
}

/// A local directory, or else a hub repo id (`owner/name`).
pub fn resolve(model: &str) -> Result<ModelFiles> {
    let path = Path::new(model);
    if path.is_dir() {
        return local_files(path);
    }
    let looks_like_repo = model.split('/').count() == 2
        && !model.starts_with(['.', '/', '~'])
        && !model.contains(char::is_whitespace);
    if path.exists() || !looks_like_repo {
        return Err(Error::file(path, "no such model directory (expected a directory with config.json, or a hub id like owner/name)"));
    }
    hub::files(model)
}

fn local_files(dir: &Path) -> Result<ModelFiles> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(Error::file(&config, "missing config.json"));
    }
    let index = dir.join("model.safetensors.index.json");
    let weights = if index.is_file() {
        let names = index_shards(&index)?;
        names.iter().map(|n| dir.join(n)).collect()
    } else {
        let single = dir.join("model.safetensors");
        let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::file(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        all.sort();
        match all.len() {
            _ if single.is_file() => vec![single],
            0 => return Err(Error::file(dir, "no *.safetensors weights in this directory")),
            1 => all,
            n => {
                return Err(Error::file(
                    dir,
                    format!("{n} safetensors files but no model.safetensors.index.json to say which tensors are where"),
                ))
            }
        }
    };
    let optional = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
    Ok(ModelFiles {
        source: dir.display().to_string(),
        config,
        weights,
        tokenizer: optional("tokenizer.json"),
        generation_config: optional("generation_config.json"),
    })
}

/// The distinct shard file names of a `model.safetensors.index.json`, in order.
pub(crate) fn index_shards(index: &Path) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(index).map_err(|e| Error::file(index, e))?;
    let idx: Index = serde_json::from_str(&text)
        .map_err(|e| Error::file(index, format!("not a valid index: {e}")))?;
    let mut names: Vec<String> = idx.weight_map.into_values().collect();
    names.sort();
    names.dedup();
    if names.iter().any(|n| n.contains("..") || n.starts_with('/')) {
        return Err(Error::file(
            index,
            "weight_map names a file outside the model directory",
        ));
    }
    Ok(names)
}

pub mod bundled;
mod hub;

/// Reads and validates config.json; `generation_config.json`'s EOS ids win when present.
pub fn load_config(files: &ModelFiles) -> Result<ModelConfig> {
    let mut cfg = ModelConfig::from_file(&files.config)?;
    if let Some(path) = &files.generation_config {
        #[derive(serde::Deserialize)]
        struct GenerationConfig {
            eos_token_id: Option<TokenIds>,
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?;
        let gen: GenerationConfig = serde_json::from_str(&text)
            .map_err(|e| Error::file(path, format!("not valid JSON: {e}")))?;
        if let Some(eos) = gen.eos_token_id {
            cfg.eos_token_ids = eos.to_vec();
        }
    }
    Ok(cfg)
}

pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path)
        .map_err(|e| Error::file(path, format!("not a valid tokenizer.json: {e}")))
}

/// Loads config, weights (memory-mapped) and tokenizer.
pub fn load(files: &ModelFiles, dtype: DType, device: &Device) -> Result<Loaded> {
    let cfg = load_config(files)?;
    for path in &files.weights {
        if !path.is_file() {
            return Err(Error::file(path, "missing weights file"));
        }
        // Parse every header up front so a broken file is named in the error.
        // SAFETY: the mapping is read-only; the file must not change while the model lives.
        // candle's message already names the file.
        unsafe { MmapedSafetensors::new(path) }.map_err(|e| Error::Weights(candle_message(&e)))?;
    }
    // SAFETY: as above.
    let tensors = unsafe { MmapedSafetensors::multi(&files.weights) }?;
    let loaded = build(&cfg, Box::new(Unmapping(tensors)), dtype, device)
        .map_err(|e| Error::Weights(format!("{}: {e}", files.source)))?;
    let tokenizer = match &files.tokenizer {
        Some(path) => {
            let tok = load_tokenizer(path)?;
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
            Some(tok)
        }
        None => None,
    };
    Ok(Loaded {
        tokenizer,
        ..loaded
    })
}

/// Loads a model compiled into the binary (see [`bundled`]).
pub fn load_bundled(b: &bundled::Bundled, dtype: DType, device: &Device) -> Result<Loaded> {
    let hf: HfConfig = serde_json::from_str(b.config)
        .map_err(|e| Error::Invalid(format!("bundled {}: config.json: {e}", b.name)))?;
    let cfg = hf.validate()?;
    let tensors = candle_core::safetensors::SliceSafetensors::new(b.weights)?;
    let loaded = build(&cfg, Box::new(tensors), dtype, device)?;
    let tokenizer = Tokenizer::from_bytes(b.tokenizer)
        .map_err(|e| Error::Tokenizer(format!("bundled {}: {e}", b.name)))?;
    Ok(Loaded {
        tokenizer: Some(tokenizer),
        ..loaded
    })
}

/// A model with random weights from a config alone (for `bench --config`): N(0, 0.02), norms 1.
pub fn random(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Loaded> {
    build(cfg, Box::new(RandomWeights), dtype, device)
}

fn build(
    cfg: &ModelConfig,
    backend: Box<dyn SimpleBackend>,
    dtype: DType,
    device: &Device,
) -> Result<Loaded> {
    let params = Arc::new(AtomicUsize::new(0));
    let counting = Counting {
        inner: backend,
        params: params.clone(),
    };
    let vb = VarBuilder::from_backend(Box::new(counting), dtype, device.clone());
    let model = Transformer::new(cfg, vb)?;
    let num_parameters = params.load(Ordering::Relaxed);
    Ok(Loaded {
        model,
        tokenizer: None,
        num_parameters,
        weight_bytes: num_parameters * dtype.size_in_bytes(),
    })
}

/// Counts the elements of every tensor the model takes, so the parameter count is what was
/// actually loaded (a tied LM head counts once).
struct Counting {
    inner: Box<dyn SimpleBackend>,
    params: Arc<AtomicUsize>,
}

impl SimpleBackend for Counting {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.inner.get(s, name, h, dtype, dev)?;
        self.params.fetch_add(t.elem_count(), Ordering::Relaxed);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.inner.get_unchecked(name, dtype, dev)?;
        self.params.fetch_add(t.elem_count(), Ordering::Relaxed);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// The memory-mapped checkpoint, with each tensor's pages dropped from this process once
/// candle has copied it out. candle's CPU tensors own their memory, so every weight is copied
/// from the map; without this the resident peak is the weights twice (the copies plus the
/// mapped file: 1,085 MB for SmolLM-135M's 538 MB in f32), with it about once.
struct Unmapping(MmapedSafetensors);

impl Unmapping {
    fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Ok(view) = self.0.get(name) {
            let data = view.data();
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
            let start = (data.as_ptr() as usize).next_multiple_of(page);
            let end = (data.as_ptr() as usize + data.len()) / page * page;
            if end > start {
                // SAFETY: the whole pages in [start, end) belong to a read-only private map
                // of the file that outlives this call; after MADV_DONTNEED a read faults the
                // same bytes back in from the file, so nothing observable changes.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED)
                };
            }
        }
    }
}

impl SimpleBackend for Unmapping {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = SimpleBackend::get(&self.0, s, name, h, dtype, dev)?;
        self.release(name);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.0.get_unchecked(name, dtype, dev)?;
        self.release(name);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}

struct RandomWeights;

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if name.ends_with("norm.weight") {
            return Tensor::ones(s, dtype, dev);
        }
        Tensor::randn(0f32, 0.02, s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights need a shape for {name}")
    }

    /// Only the fused-expert layout and optional tensors are asked about: say no.
    fn contains_tensor(&self, _: &str) -> bool {
        false
    }
}
