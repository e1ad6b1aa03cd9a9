//! GGUF files (llama.cpp's format) as input: `--model FILE.gguf` for the Llama and Qwen2
//! architectures. One file holds what a Hugging Face directory spreads over several: the
//! config is rebuilt from its metadata (`config`), the tokenizer from its vocabulary
//! (`tokenizer`), and its tensors are read under Hugging Face names (`tensors`), so the
//! result is the same [`Loaded`] a directory gives.
//!
//! With `--dtype auto` (the default) the projections and the LM head stay in the file's
//! block formats (on CPU every one we run on our kernels, the embedding too, which a tied
//! head shares; candle's kernels elsewhere), and the rest (norms, and the embedding off the
//! CPU) is dequantized to f32, or kept in f16/bf16 when the file stores those. `--dtype f32|bf16` dequantizes everything; `--dtype q8_0|q4_0` re-quantizes the
//! dequantized weights as for a checkpoint. Opening a file reads its metadata and tensor table
//! only; `info` reads no tensor data.

mod config;
mod metadata;
mod reader;
mod tensors;
mod tokenizer;

pub use config::Arch;
pub use tensors::{gguf_name, hf_name};

use super::headers::TensorInfo;
use super::{meta, DTypeArg, Description, GenerationConfig, Loaded, TextTokenizer};
use crate::config::{HfConfig, ModelConfig};
use crate::error::{candle_message, Error, Result};
use crate::model::linear::{our_format, Quantizer};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use metadata::Meta;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tensors::{is_blocks, keeps_blocks, GgufTensors};

/// Whether `path` names a GGUF file: `*.gguf`, or a file that starts with GGUF's magic.
pub fn is_gguf(path: &Path) -> bool {
    let named = path
        .extension()
        .is_some_and(|x| x.eq_ignore_ascii_case("gguf"));
    let mut magic = [0u8; 4];
    let starts = std::fs::File::open(path).is_ok_and(|mut f| f.read_exact(&mut magic).is_ok());
    named || (starts && &magic == b"GGUF")
}

/// An open GGUF file: its metadata and tensor table, no tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Arc<Content>,
    arch: Arch,
}

impl GgufFile {
    /// Reads the metadata and the tensor table, checked as llama.cpp checks them
    /// (`reader`): a truncated or inconsistent file is refused here, naming the tensor or key.
    pub fn open(path: &Path) -> Result<Self> {
        let content = reader::read(path)?;
        let meta = Meta {
            path,
            map: &content.metadata,
        };
        let arch = Arch::of(&meta)?;
        Ok(Self {
            path: path.to_path_buf(),
            content: Arc::new(content),
            arch,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    fn meta(&self) -> Meta<'_> {
        Meta {
            path: &self.path,
            map: &self.content.metadata,
        }
    }

    /// The config.json transformers would write for this file, and its validated form; a
    /// rejected value is named with the file.
    pub fn config(&self) -> Result<(HfConfig, ModelConfig)> {
        let hf = config::hf_config(&self.meta(), self.arch, &self.content.tensor_infos)?;
        let cfg = hf.validate().map_err(|e| match e {
            Error::Config(msg) => Error::file(&self.path, format!("metadata: {msg}")),
            other => other,
        })?;
        Ok((hf, cfg))
    }

    /// The Hugging Face names of the tensors the file holds, sorted.
    pub fn hf_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .content
            .tensor_infos
            .keys()
            .filter_map(|n| hf_name(n))
            .collect();
        names.sort();
        names
    }

    fn tensors(&self, cfg: &ModelConfig) -> GgufTensors {
        let permute = match (self.arch, &cfg.attention) {
            (Arch::Llama, crate::config::AttentionConfig::Gqa { num_kv_heads, .. }) => {
                Some((cfg.num_attention_heads, *num_kv_heads))
            }
            _ => None,
        };
        GgufTensors {
            path: self.path.clone(),
            content: self.content.clone(),
            permute,
            defer_blocks: false,
        }
    }

    /// One tensor by its Hugging Face name, dequantized to f32 in Hugging Face's layout.
    pub fn tensor(&self, hf: &str, device: &Device) -> Result<Tensor> {
        let (_, cfg) = self.config()?;
        self.tensors(&cfg)
            .read(hf, device)
            .map_err(|e| Error::file(&self.path, candle_message(&e)))
    }

    /// The tokenizer built from the file's vocabulary, encoding as transformers' tokenizer
    /// for this file does; `None` when the file has none.
    pub fn tokenizer(&self) -> Result<Option<TextTokenizer>> {
        match tokenizer::build(&self.meta())? {
            Some((t, m)) => Ok(Some(TextTokenizer::new(t, &m, &self.path)?)),
            None => Ok(None),
        }
    }

    /// The dtype of most of the file's bytes, when that is a float type the engine runs
    /// (f32, f16, bf16); `None` for a file of mostly quantized blocks.
    fn stored_dtype(&self) -> Option<DType> {
        let mut bytes: [(Option<DType>, u64); 4] = [
            (Some(DType::F32), 0),
            (Some(DType::F16), 0),
            (Some(DType::BF16), 0),
            (None, 0),
        ];
        for t in self.content.tensor_infos.values() {
            let d = t.ggml_dtype;
            let slot = match d {
                GgmlDType::F32 => 0,
                GgmlDType::F16 => 1,
                GgmlDType::BF16 => 2,
                _ => 3,
            };
            bytes[slot].1 += reader::byte_size(t).unwrap_or_default(); // checked at open
        }
        bytes
            .into_iter()
            .max_by_key(|&(_, b)| b)
            .and_then(|(d, _)| d)
    }

    fn num_parameters(&self) -> usize {
        let infos = &self.content.tensor_infos;
        let taken = infos.iter().filter(|(n, _)| hf_name(n).is_some());
        taken.map(|(_, t)| t.shape.elem_count()).sum()
    }

    /// The model as the metadata and tensor table describe it (`info`): no tensor read.
    pub fn describe(&self, dtype: DTypeArg, device: &Device) -> Result<Description> {
        let (_, cfg) = self.config()?;
        let checkpoint_dtype = self.stored_dtype();
        let run = dtype.resolve(None, checkpoint_dtype, device);
        // The tensor table by Hugging Face names, as a checkpoint's headers would list it.
        let infos: Vec<TensorInfo> = (self.content.tensor_infos.iter())
            .filter_map(|(n, t)| {
                Some(TensorInfo {
                    name: hf_name(n)?,
                    dtype: String::new(),
                    shape: t.shape.dims().to_vec(),
                })
            })
            .collect();
        let n = self.num_parameters();
        let tied = cfg.tie_word_embeddings;
        let mut description = Description::new(cfg, &infos, n, (dtype, run), checkpoint_dtype);
        if let Some(q) = self.kept_blocks(dtype, &description.cfg) {
            description.quantization = Some(q.label());
            let dense = (n * run.size_in_bytes()) as isize;
            let saved = self.kept_blocks_saved(run, tied, device.is_cpu());
            description.weight_bytes = (dense - saved) as usize;
        }
        Ok(description)
    }

    /// What keeps the file's blocks with `dtype` (`auto`, when the file has blocks to keep).
    fn kept_blocks(&self, dtype: DTypeArg, cfg: &ModelConfig) -> Option<GgufTensors> {
        let tensors = self.tensors(cfg);
        let kept = dtype == DTypeArg::Auto && tensors.main_block_format().is_some();
        kept.then_some(tensors)
    }

    /// Bytes the file's blocks save against dense weights in `run`, by the rule the
    /// [`GgufTensors`] quantizer applies: every projection and LM head stored in blocks
    /// keeps them; on CPU the embedding too, which a tied head shares; elsewhere a tied
    /// head's blocks come beside the dense embedding.
    fn kept_blocks_saved(&self, run: DType, tied: bool, cpu: bool) -> isize {
        let infos = self.content.tensor_infos.iter();
        let kept = infos.filter_map(|(n, t)| Some((hf_name(n)?, t)));
        kept.filter(|(h, t)| keeps_blocks(h) && is_blocks(t.ggml_dtype))
            .map(|(h, t)| {
                let elems = t.shape.elem_count();
                let stored = super::dtype::quantized_bytes(t.ggml_dtype, elems) as isize;
                match h.as_str() {
                    "model.embed_tokens.weight" if cpu && our_format(t.ggml_dtype).is_some() => {
                        (elems * run.size_in_bytes()) as isize - stored
                    }
                    "model.embed_tokens.weight" if tied => -stored,
                    "model.embed_tokens.weight" => 0,
                    _ => (elems * run.size_in_bytes()) as isize - stored,
                }
            })
            .sum()
    }

    /// The model, its tokenizer and what the file says about using them.
    pub fn load(&self, dtype: DTypeArg, device: &Device) -> Result<Loaded> {
        let (_, mut cfg) = self.config()?;
        let built = tokenizer::build(&self.meta())?;
        let tokenizer_meta = built.as_ref().map(|(_, m)| m.clone()).unwrap_or_default();
        let generation = GenerationConfig::default();
        let tok = built.as_ref().map(|(t, _)| t);
        cfg.eos_token_ids = meta::stop_ids(&generation, &cfg.eos_token_ids, &tokenizer_meta, tok);
        let checkpoint_dtype = self.stored_dtype();
        let dtype_arg = dtype;
        let dtype = dtype.resolve(None, checkpoint_dtype, device);
        let made = dtype_arg.quantization();
        let kept = self.kept_blocks(dtype_arg, &cfg);
        let quant: Option<&dyn Quantizer> = match (&made, &kept) {
            (Some(q), _) => Some(q),
            (None, Some(kept)) => Some(kept),
            (None, None) => None,
        };
        let tensors = Box::new(GgufTensors {
            defer_blocks: made.is_none() && kept.is_some(),
            ..self.tensors(&cfg)
        });
        let (model, num_parameters) = super::weights::build(&cfg, tensors, dtype, quant, device)
            .map_err(|e| Error::Weights(format!("{}: {e}", self.path.display())))?;
        let tokenizer = match built {
            Some((t, m)) => {
                let t = super::checked_tokenizer(t, model.config(), &self.path)?;
                Some(TextTokenizer::new(t, &m, &self.path)?)
            }
            None => None,
        };
        Ok(Loaded {
            tokenizer,
            meta: tokenizer_meta,
            generation,
            ..Loaded::bare(model, num_parameters, checkpoint_dtype)
        })
    }
}
