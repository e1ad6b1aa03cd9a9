//! A local checkpoint directory as files: config.json, the safetensors shards (one file, or
//! those a `model.safetensors.index.json` names), the tokenizer and generation files.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The files of one checkpoint.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The directory (or hub id) the files came from, for messages.
    pub source: String,
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

pub fn local_files(dir: &Path) -> Result<ModelFiles> {
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
        tokenizer_config: optional("tokenizer_config.json"),
        chat_template: optional("chat_template.jinja"),
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
