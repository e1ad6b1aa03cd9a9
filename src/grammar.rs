//! Structured output: a grammar (a JSON schema, any JSON object, or a Lark grammar) turned
//! into a mask over the vocabulary at every step, with llguidance, the library llama.cpp,
//! vLLM and SGLang use. [`Grammars`] is built once per model (the tokenizer's bytes per
//! token, in a trie); [`Constraint`] is one sequence's place in its grammar, and knows
//! nothing of the model: it masks logits before the sampler and follows the tokens drawn.

use crate::error::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use tokenizers::Tokenizer;

/// What a sequence's output must match.
#[derive(Debug, Clone)]
pub enum Spec {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A JSON schema (OpenAI's `json_schema`, `generate --json-schema`).
    JsonSchema(serde_json::Value),
    /// llguidance's Lark dialect (a `start` rule).
    Lark(String),
}

/// The compiler of [`Spec`]s for one model: its tokens as bytes and its EOS ids.
pub struct Grammars {
    factory: ParserFactory,
}

/// The tokenizer as llguidance reads it: the trie of token bytes, and encoding for the
/// tokens it forces.
struct TokenBytes {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for TokenBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer
                .encode(s, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

impl Grammars {
    /// For a model whose logits are `vocab_size` wide (at least the tokenizer's vocabulary)
    /// and which ends a sequence with any of `eos` (the first is the main one).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let bad = |e: String| Error::Invalid(format!("structured output: {e}"));
        let json = tokenizer.to_string(false).map_err(|e| bad(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| bad(e.to_string()))?;
        // llguidance's own reading of tokenizer.json: byte-level BPE and byte fallback.
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| bad(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(bad(format!(
                "the tokenizer has {} tokens but the model's vocabulary is {vocab_size}",
                words.len()
            )));
        }
        // Logits past the tokenizer's tokens: special-marked names no grammar produces.
        while words.len() < vocab_size {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let &first = eos
            .first()
            .ok_or_else(|| bad("the model has no EOS id".into()))?;
        let info = TokRxInfo::new(vocab_size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(TokenBytes {
            tokenizer: tokenizer.clone(),
            trie,
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| bad(e.to_string()))?;
        factory.quiet();
        // Each mask is computed on the server's scheduler thread, for a grammar a client
        // sent: a quarter of llguidance's defaults bounds a step to about 4 ms and a
        // matcher's lexer to about 100 MB; schemas that need more are refused or cut.
        let limits = factory.limits_mut();
        limits.step_lexer_fuel = 50_000;
        limits.step_max_items = 12_500;
        limits.max_lexer_states = 62_500;
        limits.max_grammar_size = 125_000;
        Ok(Self { factory })
    }

    /// Compiles `spec`; an error says what in it llguidance refused. JSON comes out
    /// compact (no whitespace between tokens: a small model can loop on free whitespace)
    /// unless the schema's own `x-guidance` options say otherwise.
    pub fn compile(&self, spec: &Spec) -> Result<Constraint> {
        let compact = |mut schema: serde_json::Value| {
            if let Some(obj) = schema.as_object_mut() {
                obj.entry("x-guidance")
                    .or_insert(serde_json::json!({"whitespace_flexible": false}));
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        let grammar = match spec {
            Spec::JsonObject => compact(serde_json::json!({"type": "object"})),
            Spec::JsonSchema(schema) => compact(schema.clone()),
            Spec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| Error::Invalid(format!("invalid grammar: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(Error::Invalid(format!("invalid grammar: {e}"))),
            None => Ok(Constraint { matcher }),
        }
    }
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    /// Whether the output is complete: the grammar allows no further token (the sequence
    /// ends here, as at an EOS).
    pub fn complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Sets every logit the grammar does not allow next to -inf (EOS is allowed where the
    /// output may end).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self.matcher.compute_mask().map_err(grammar_error)?;
        apply(mask.as_slice(), logits);
        Ok(())
    }

    /// Follows the token drawn from the masked logits.
    pub fn accept(&mut self, id: u32) -> Result<()> {
        self.matcher.consume_token(id).map_err(grammar_error)
    }
}

/// Sets the logits of tokens whose bit is clear to -inf: token i is bit i % 32 of word
/// i / 32 (past the words: clear). Whole words at a time, as most are all clear or all set.
fn apply(words: &[u32], logits: &mut [f32]) {
    for (chunk, i) in logits.chunks_mut(32).zip(0..) {
        match words.get(i).copied().unwrap_or(0) {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            word => {
                for (bit, l) in chunk.iter_mut().enumerate() {
                    if (word >> bit) & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

fn grammar_error(e: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("structured output: {e}"))
}

#[cfg(test)]
mod tests;
