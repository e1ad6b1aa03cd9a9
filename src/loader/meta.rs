//! The files around the weights that say how a checkpoint is meant to be used:
//! `tokenizer_config.json` (which special tokens encoding adds, the BOS/EOS tokens, the
//! chat template), a separate `chat_template.jinja` (transformers 5 writes it there) and
//! `generation_config.json` (stop ids and sampling defaults). Read once at load and kept on
//! [`super::Loaded`].

use crate::config::GenerationConfig;
use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::Path;
use tokenizers::Tokenizer;

/// A special token as tokenizer_config.json writes it: a string, or an AddedToken object.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum SpecialToken {
    Text(String),
    Added { content: String },
}

impl SpecialToken {
    fn text(self) -> String {
        match self {
            SpecialToken::Text(s) | SpecialToken::Added { content: s } => s,
        }
    }
}

/// `chat_template`: one template, or named ones (`default`, `tool_use`, ...).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Clone, Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// tokenizer_config.json, the fields this engine honours.
#[derive(Debug, Clone, Default, Deserialize)]
struct HfTokenizerConfig {
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
    bos_token: Option<SpecialToken>,
    eos_token: Option<SpecialToken>,
    chat_template: Option<TemplateField>,
}

/// What the tokenizer's own files say beyond tokenizer.json.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerMeta {
    /// Whether encoding puts BOS first / EOS last. `None`: as tokenizer.json's
    /// post-processor does.
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The Jinja chat template: chat_template.jinja, else tokenizer_config.json's
    /// (its `default` entry when it names several).
    pub chat_template: Option<String>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not valid: {e}")))
}

impl TokenizerMeta {
    /// Reads tokenizer_config.json and chat_template.jinja where they exist.
    pub fn read(tokenizer_config: Option<&Path>, template_file: Option<&Path>) -> Result<Self> {
        let hf: HfTokenizerConfig = match tokenizer_config {
            Some(path) => read_json(path)?,
            None => HfTokenizerConfig::default(),
        };
        let from_config = match hf.chat_template {
            Some(TemplateField::One(t)) => Some(t),
            Some(TemplateField::Named(list)) => {
                let default = list.iter().position(|t| t.name == "default").unwrap_or(0);
                list.into_iter().nth(default).map(|t| t.template)
            }
            None => None,
        };
        let chat_template = match template_file {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?),
            None => from_config,
        };
        Ok(Self {
            add_bos_token: hf.add_bos_token,
            add_eos_token: hf.add_eos_token,
            bos_token: hf.bos_token.map(SpecialToken::text),
            eos_token: hf.eos_token.map(SpecialToken::text),
            chat_template,
        })
    }
}

/// The ids that end generation: every id of generation_config.json's `eos_token_id`, else
/// config.json's, else the tokenizer's `eos_token`. Empty when none says (generation then
/// runs to its length).
pub fn stop_ids(
    generation: &GenerationConfig,
    config_eos: &[u32],
    meta: &TokenizerMeta,
    tokenizer: Option<&Tokenizer>,
) -> Vec<u32> {
    if let Some(ids) = &generation.eos_token_id {
        return ids.to_vec();
    }
    if !config_eos.is_empty() {
        return config_eos.to_vec();
    }
    let eos = meta.eos_token.as_deref();
    eos.and_then(|t| tokenizer?.token_to_id(t))
        .into_iter()
        .collect()
}

/// A tokenizer that encodes text as transformers' `tokenizer(text)` does: tokenizer.json,
/// with BOS and EOS added as tokenizer_config.json's `add_bos_token`/`add_eos_token` say
/// where it says.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    /// `Some(id)` when BOS must come first / EOS last; `None` leaves it to tokenizer.json.
    bos: Option<Option<u32>>,
    eos: Option<Option<u32>>,
}

impl TextTokenizer {
    /// `meta`'s add_* flags need their tokens in the vocabulary; a flag whose token is
    /// missing is an error naming it.
    pub fn new(inner: Tokenizer, meta: &TokenizerMeta, what: &Path) -> Result<Self> {
        let id_of = |flag: Option<bool>, token: &Option<String>, field: &str| match flag {
            None => Ok(None),
            Some(false) => Ok(Some(None)),
            Some(true) => {
                let name = token.as_deref().unwrap_or_default();
                match inner.token_to_id(name) {
                    Some(id) => Ok(Some(Some(id))),
                    None => Err(Error::file(
                        what,
                        format!("add_{field}_token is set but {field}_token {name:?} is not in the vocabulary"),
                    )),
                }
            }
        };
        let bos = id_of(meta.add_bos_token, &meta.bos_token, "bos")?;
        let eos = id_of(meta.add_eos_token, &meta.eos_token, "eos")?;
        Ok(Self { inner, bos, eos })
    }

    /// Wraps a tokenizer.json alone: its post-processor decides the special tokens.
    pub fn plain(inner: Tokenizer) -> Self {
        Self {
            inner,
            bos: None,
            eos: None,
        }
    }

    /// The tokenizer.json underneath (for decoding and vocabulary look-ups).
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// `text` as transformers' `tokenizer(text)["input_ids"]`: with the special tokens the
    /// checkpoint's files ask for.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let by_post_processor = self.bos.is_none() && self.eos.is_none();
        let enc = self
            .inner
            .encode(text, by_post_processor)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if by_post_processor {
            return Ok(ids);
        }
        if let Some(Some(bos)) = self.bos {
            ids.insert(0, bos);
        }
        if let Some(Some(eos)) = self.eos {
            ids.push(eos);
        }
        Ok(ids)
    }

    /// `text` with no special tokens added (text that already holds them, such as a
    /// rendered chat template).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}
