//! Grammars on tiny-gqa's tokenizer: random draws through a schema are valid JSON of it,
//! masks keep exactly their bits, bad grammars are refused; and a probe of a mask's cost.

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
