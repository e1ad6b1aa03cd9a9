//! Hub repo ids through hf-hub's sync API (0.4, the one candle's examples use). Files come
//! from the HF cache (`HF_HOME`, `HF_HUB_CACHE`) when present; `HF_HUB_OFFLINE=1` never
//! touches the network and says what is missing.

use super::files::{index_shards, ModelFiles};
use crate::error::{Error, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};
use std::path::PathBuf;

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "yes" | "on"))
}

fn cache() -> Cache {
    match std::env::var("HF_HUB_CACHE") {
        Ok(dir) if !dir.is_empty() => Cache::new(PathBuf::from(dir)),
        _ => Cache::from_env(),
    }
}

/// Fetches (or finds in the cache) the files of `repo_id`.
pub fn files(repo_id: &str) -> Result<ModelFiles> {
    let repo = Repo::model(repo_id.to_string());
    let cached = cache().repo(repo.clone());
    let api = if offline() {
        None
    } else {
        let api = ApiBuilder::from_cache(cache()).with_progress(true).build();
        Some(
            api.map_err(|e| {
                Error::Invalid(format!("{repo_id}: cannot start the hub client: {e}"))
            })?
            .repo(repo),
        )
    };
    let get = |name: &str, required: bool| -> Result<Option<PathBuf>> {
        if let Some(path) = cached.get(name) {
            return Ok(Some(path));
        }
        match &api {
            None if required => Err(Error::Invalid(format!(
                "{repo_id}: {name} is not in the HF cache ({}) and HF_HUB_OFFLINE is set: \
                 download it once online, or pass a local directory",
                cache().path().display()
            ))),
            None => Ok(None),
            Some(api) => match api.get(name) {
                Ok(path) => Ok(Some(path)),
                Err(e) if required => Err(Error::Invalid(format!(
                    "{repo_id}: cannot fetch {name}: {e}"
                ))),
                Err(_) => Ok(None),
            },
        }
    };
    let config = get("config.json", true)?.unwrap_or_default();
    let weights = match get("model.safetensors.index.json", false)? {
        Some(index) => index_shards(&index)?
            .iter()
            .map(|name| get(name, true).map(Option::unwrap_or_default))
            .collect::<Result<Vec<_>>>()?,
        None => vec![get("model.safetensors", true)?.unwrap_or_default()],
    };
    Ok(ModelFiles {
        source: repo_id.to_string(),
        config,
        weights,
        tokenizer: get("tokenizer.json", false)?,
        tokenizer_config: get("tokenizer_config.json", false)?,
        chat_template: get("chat_template.jinja", false)?,
        generation_config: get("generation_config.json", false)?,
    })
}
