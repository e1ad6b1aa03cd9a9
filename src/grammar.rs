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
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use serde_json::{json, Value};

    fn tiny_tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        Tokenizer::from_file(dir.join("models/tiny-gqa/tokenizer.json")).unwrap()
    }

    fn tiny() -> (Tokenizer, Grammars) {
        let tok = tiny_tokenizer();
        // The model's logits are wider than the tokenizer here: the padding is never allowed.
        let grammars = Grammars::new(&tok, tok.get_vocab_size(true) + 40, &[1]).unwrap();
        (tok, grammars)
    }

    /// Draws tokens from random logits through `c` until the grammar is complete (or an
    /// allowed EOS is drawn); returns the text.
    fn run(tok: &Tokenizer, mut c: Constraint, width: usize, seed: u64) -> String {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ids = Vec::new();
        for _ in 0..400 {
            if c.complete() {
                break;
            }
            let mut logits: Vec<f32> = (0..width).map(|_| rng.random::<f32>() * 4.0).collect();
            c.mask(&mut logits).unwrap();
            let allowed: Vec<usize> = (0..width).filter(|&i| logits[i].is_finite()).collect();
            assert!(
                allowed.iter().all(|&i| i < tok.get_vocab_size(true)),
                "padding allowed"
            );
            let id = crate::sampling::argmax(&logits);
            c.accept(id).unwrap();
            if id == 1 {
                break;
            }
            ids.push(id);
        }
        tok.decode(&ids, true).unwrap()
    }

    #[test]
    fn random_draws_through_a_schema_are_valid_json_of_that_schema() {
        let (tok, grammars) = tiny();
        let width = tok.get_vocab_size(true) + 40;
        let schema = json!({"type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
            "required": ["name", "age"], "additionalProperties": false});
        for seed in 0..20 {
            let c = grammars.compile(&Spec::JsonSchema(schema.clone())).unwrap();
            let text = run(&tok, c, width, seed);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(
                v["name"].as_str().is_some_and(|n| n.chars().count() <= 8),
                "{text}"
            );
            assert!(
                v["age"]
                    .as_f64()
                    .is_some_and(|a| (0.0..=120.0).contains(&a)),
                "{text}"
            );
            let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
            assert!(
                keys.iter()
                    .all(|k| ["name", "age", "tags"].contains(&k.as_str())),
                "{text}"
            );
            assert!(!text.contains(": "), "compact: {text}");
        }
        // Any object: random draws never close one, but the first token must open it.
        let mut c = grammars.compile(&Spec::JsonObject).unwrap();
        let mut logits = vec![0.0; width];
        c.mask(&mut logits).unwrap();
        for (id, _) in logits.iter().enumerate().filter(|(_, l)| l.is_finite()) {
            let piece = tok.decode(&[id as u32], false).unwrap();
            assert!(
                piece.trim_start().starts_with('{'),
                "{piece:?} may open an object"
            );
        }
        let c = grammars
            .compile(&Spec::Lark("start: \"yes\" | \"no\"".into()))
            .unwrap();
        assert!(["yes", "no"].contains(&run(&tok, c, width, 3).as_str()));
    }

    #[test]
    fn a_mask_keeps_exactly_the_set_bits() {
        let words = [0b1010u32, u32::MAX, 0];
        let mut logits = vec![1.0f32; 100];
        apply(&words, &mut logits);
        let kept: Vec<usize> = (0..100).filter(|&i| logits[i].is_finite()).collect();
        let want: Vec<usize> = [1, 3].into_iter().chain(32..64).collect();
        assert_eq!(kept, want);
    }

    #[test]
    fn bad_grammars_are_refused_with_the_reason() {
        let (_, grammars) = tiny();
        let e = grammars.compile(&Spec::JsonSchema(json!({"type": "object", "not": {}})));
        assert!(e.unwrap_err().to_string().contains("not"));
        let e = grammars.compile(&Spec::Lark("root ::= \"x\"".into()));
        assert!(e.unwrap_err().to_string().starts_with("invalid grammar"));
        let tok = tiny_tokenizer();
        assert!(Grammars::new(&tok, 10, &[1]).is_err());
        assert!(Grammars::new(&tok, 2000, &[]).is_err());
    }

    /// The cost of a mask and its application per step, on SmolLM2's 49k vocabulary under
    /// the schema `scripts/bench_serve.py --constrained` uses. A probe, not a check:
    /// `cargo test --release --lib probe_mask_cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn probe_mask_cost() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target/models/smollm2-135m-instruct/tokenizer.json");
        let Ok(tok) = Tokenizer::from_file(&dir) else {
            eprintln!("SKIPPED: no {}", dir.display());
            return;
        };
        let width = 49152;
        let t = std::time::Instant::now();
        let grammars = Grammars::new(&tok, width, &[2, 0]).unwrap();
        eprintln!(
            "grammars for {width} tokens: {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let schema = json!({"type": "array", "minItems": 1000,
                            "items": {"type": "string", "maxLength": 24}});
        let mut c = grammars.compile(&Spec::JsonSchema(schema)).unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let (mut mask_s, mut apply_s) = (0.0, 0.0);
        let steps = 500;
        for _ in 0..steps {
            let mut logits: Vec<f32> = (0..width).map(|_| rng.random::<f32>()).collect();
            let t = std::time::Instant::now();
            let mask = c.matcher.compute_mask().unwrap();
            mask_s += t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            apply(mask.as_slice(), &mut logits);
            apply_s += t.elapsed().as_secs_f64();
            c.accept(crate::sampling::argmax(&logits)).unwrap();
        }
        let us = |s: f64| s * 1e6 / steps as f64;
        eprintln!(
            "per step: mask {:.1} us, applying it {:.1} us",
            us(mask_s),
            us(apply_s)
        );
    }
}
