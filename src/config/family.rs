//! The model families the engine runs, and their `model_type` names.

use crate::error::{Error, Result};

/// The model families the engine loads; `model_type` selects one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    DeepseekV2,
    DeepseekV3,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::Llama,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
        Family::DeepseekV2,
        Family::DeepseekV3,
    ];

    /// The `model_type` of config.json.
    pub fn model_type(&self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::DeepseekV2 => "deepseek_v2",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }

    /// The family a config.json `model_type` names.
    pub fn of(model_type: &str) -> Result<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
            .ok_or_else(|| {
                let known: Vec<_> = Family::ALL.iter().map(|f| f.model_type()).collect();
                let msg = format!(
                    "unknown model_type {:?} (supported: {})",
                    model_type,
                    known.join(", ")
                );
                Error::Config(msg)
            })
    }
}
