//! generation_config.json: the stop ids and the sampling a checkpoint's authors chose. It
//! lives with config.json's types so that sampling, below the loader, can read it.

use super::TokenIds;
use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// generation_config.json: stop ids and the sampling its authors chose.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct GenerationConfig {
    pub eos_token_id: Option<TokenIds>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<i64>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
}

impl GenerationConfig {
    /// The file's settings, or none when the checkpoint has no generation_config.json.
    pub fn read(path: Option<&Path>) -> Result<Self> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not valid: {e}")))
    }
}
