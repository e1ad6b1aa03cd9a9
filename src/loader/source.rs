//! What `--model` names, opened: a checkpoint directory ([`files`]), a hub repo id (through
//! the HF cache), a GGUF file, or a model compiled into the binary; and the door through
//! which a conversion rewrites a checkpoint's config and tensors before the model is built.

use super::{bundled, files, gguf, headers, hub, weights};
use super::{
    bundled_config, bundled_headers, load_bundled_rewritten, load_config, load_rewritten,
    run_dtype, DTypeArg, Description, Loaded, ModelFiles,
};
use crate::config::{HfConfig, ModelConfig};
use crate::error::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::Device;
use candle_nn::var_builder::SimpleBackend;
use headers::TensorInfo;
use std::path::Path;

/// What `--model` names: checkpoint files, a GGUF file, or a model compiled into the binary.
pub enum Source {
    Files(ModelFiles),
    Gguf(gguf::GgufFile),
    Bundled(&'static bundled::Bundled),
}

/// A directory, a GGUF file, a hub id, or the name of a bundled model (`tiny-gqa`, ...); a
/// directory of that name wins over the bundled model. A GGUF file is opened here (metadata
/// and tensor table only).
pub fn open(model: &str) -> Result<Source> {
    let path = Path::new(model);
    if path.is_file() && gguf::is_gguf(path) {
        return gguf::GgufFile::open(path).map(Source::Gguf);
    }
    match (path.exists(), bundled::find(model)) {
        (false, Some(b)) => Ok(Source::Bundled(b)),
        _ => resolve(model).map(Source::Files),
    }
}

/// The one door through which a conversion (`--attention`, see `crate::convert`) enters a
/// model: it gets the validated config and the checkpoint's tensors before the model is
/// built, and returns the config and tensors to build instead. The forward path never knows.
pub type Rewrite<'a> = &'a dyn Fn(
    &ModelConfig,
    Box<dyn SimpleBackend>,
) -> Result<(ModelConfig, Box<dyn SimpleBackend>)>;

impl Source {
    pub fn load(&self, dtype: DTypeArg, device: &Device) -> Result<Loaded> {
        self.load_with(dtype, device, None)
    }

    /// [`Self::load`], with the config and tensors passed through `rewrite` first.
    pub fn load_with(
        &self,
        dtype: DTypeArg,
        device: &Device,
        rewrite: Option<Rewrite>,
    ) -> Result<Loaded> {
        match (self, rewrite) {
            (Source::Files(files), r) => load_rewritten(files, dtype, device, r),
            (Source::Gguf(file), None) => file.load(dtype, device),
            (Source::Gguf(_), Some(_)) => Err(Error::Invalid(
                "--attention does not apply to GGUF files yet: use the safetensors checkpoint"
                    .into(),
            )),
            (Source::Bundled(b), r) => load_bundled_rewritten(b, dtype, device, r),
        }
    }

    /// The model as its config and safetensors headers describe it, no weight read.
    pub fn describe(&self, dtype: DTypeArg, device: &Device) -> Result<Description> {
        let (hf, tensors) = match self {
            Source::Files(files) => (
                HfConfig::from_file(&files.config)?,
                headers::read_checked(&files.weights)?,
            ),
            Source::Bundled(b) => (bundled_config(b)?, bundled_headers(b)?),
            Source::Gguf(file) => return file.describe(dtype, device),
        };
        let cfg = hf.validate()?;
        let checkpoint_dtype = headers::main_float_dtype(&tensors);
        let run = run_dtype(dtype, &hf, checkpoint_dtype, device)?;
        let num_parameters = headers::count_parameters(&tensors, cfg.tie_word_embeddings);
        let ran = (dtype, run);
        Ok(Description::new(
            cfg,
            &tensors,
            num_parameters,
            ran,
            checkpoint_dtype,
        ))
    }
}

/// A checkpoint as it is stored, for writing a converted copy (`convert`): config.json as
/// written, the validated config, every tensor's header, and the tensors themselves.
pub struct Stored {
    pub config: serde_json::Value,
    pub cfg: ModelConfig,
    /// Sorted by name; their dtypes are the ones a converted copy keeps.
    pub tensors: Vec<TensorInfo>,
    pub backend: Box<dyn SimpleBackend>,
}

impl Source {
    /// The checkpoint's own files, unconverted and not built into a model.
    pub fn stored(&self) -> Result<Stored> {
        match self {
            Source::Files(files) => {
                let (_, cfg) = load_config(files)?;
                let text = std::fs::read_to_string(&files.config)
                    .map_err(|e| Error::file(&files.config, e))?;
                let config = serde_json::from_str(&text)
                    .map_err(|e| Error::file(&files.config, format!("not valid JSON: {e}")))?;
                let tensors = headers::read_checked(&files.weights)?;
                // SAFETY: as in `load_rewritten`: read-only, not written while mapped.
                let mapped = unsafe { MmapedSafetensors::multi(&files.weights) }?;
                let backend = Box::new(weights::Unmapping(mapped));
                Ok(Stored {
                    config,
                    cfg,
                    tensors,
                    backend,
                })
            }
            Source::Bundled(b) => Ok(Stored {
                config: serde_json::from_str(b.config)
                    .map_err(|e| Error::Invalid(format!("bundled {}: config.json: {e}", b.name)))?,
                cfg: bundled_config(b)?.validate()?,
                tensors: bundled_headers(b)?,
                backend: Box::new(candle_core::safetensors::SliceSafetensors::new(b.weights)?),
            }),
            Source::Gguf(_) => Err(Error::Invalid(
                "convert reads safetensors checkpoints, not GGUF files: use the model's Hugging \
                 Face directory"
                    .into(),
            )),
        }
    }
}

/// A local directory, or else a hub repo id (`owner/name`).
pub fn resolve(model: &str) -> Result<ModelFiles> {
    let path = Path::new(model);
    if path.is_dir() {
        return files::local_files(path);
    }
    let looks_like_repo = model.split('/').count() == 2
        && !model.starts_with(['.', '/', '~'])
        && !model.contains(char::is_whitespace);
    if path.exists() || !looks_like_repo {
        return Err(Error::file(path, "no such model directory (expected a directory with config.json, or a hub id like owner/name)"));
    }
    hub::files(model)
}
