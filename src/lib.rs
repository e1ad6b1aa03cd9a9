//! tiny-decoder: a small, readable inference engine for decoder-only transformers.
//!
//! One [`model::Transformer`] whose attention is chosen by config (MHA, MQA and GQA through
//! `num_key_value_heads`, or DeepSeek's MLA), a per-layer [`kv_cache::KvCache`] owned by the
//! caller, a seeded [`sampling::Sampler`] and a [`generate`] loop. Checkpoints are Hugging Face
//! directories (config.json, safetensors, tokenizer.json) or hub repo ids ([`loader`]).
//!
//! The rooms import one way, top to bottom (tests/layers.rs holds them to it, and
//! docs/architecture.md draws them): the front-ends, the loader (a checkpoint in, a ready
//! model out), the engine, and the facts every room shares.

// Front-ends (with the binary's `cli`): what a user runs.
pub mod bench;
pub mod chat;
pub mod convert;
pub mod eval;
pub mod serve;

// Loading: files or a hub id -> config, weights at a dtype, tokenizer, a ready Transformer.
pub mod loader;

// The engine: the generation loop, the sampler, the stateless model and its cache.
pub mod generate;
pub mod grammar;
pub mod kv_cache;
pub mod model;
pub mod sampling;

// Shared facts: the validated config and the one error type.
pub mod config;
pub mod error;

pub use config::ModelConfig;
pub use error::{Error, Result};
pub use kv_cache::KvCache;
pub use model::Transformer;
