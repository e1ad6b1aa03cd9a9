//! tiny-decoder: a small, readable inference engine for decoder-only transformers.
//!
//! One [`model::Transformer`] whose attention is chosen by config (MHA, MQA and GQA through
//! `num_key_value_heads`, or DeepSeek's MLA), a per-layer [`kv_cache::KvCache`] owned by the
//! caller, a seeded [`sampling::Sampler`] and a [`generate`] loop. Checkpoints are Hugging Face
//! directories (config.json, safetensors, tokenizer.json) or hub repo ids ([`loader`]).

pub mod bench;
pub mod chat;
pub mod config;
pub mod convert;
pub mod error;
pub mod eval;
pub mod generate;
pub mod kv_cache;
pub mod loader;
pub mod model;
pub mod sampling;
pub mod serve;

pub use config::ModelConfig;
pub use error::{Error, Result};
pub use kv_cache::KvCache;
pub use model::Transformer;
