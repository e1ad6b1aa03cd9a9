//! The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built with the tokenizers
//! crate's own models the way transformers builds it from the same file
//! (`integrations/gguf/gguf_tokenizer_mapping.py`), so the ids equal transformers':
//!
//! - `gpt2`: byte-level BPE from `tokens` and `merges` (tokens outside the byte alphabet
//!   respelled in it), GPT-2's byte-level pre-tokenizer, or the split regex that
//!   `tokenizer.ggml.pre` names (Llama 3, Qwen2, ...) before it.
//! - `llama`: SentencePiece-style BPE with byte fallback, its merges recovered from the
//!   `scores` (transformers' `generate_merges`), a `▁` prefix on the first word.
//!
//! Control tokens (`token_type` 3) and the named BOS/EOS/UNK/PAD tokens become special added
//! tokens, user-defined ones (4) plain added tokens, so they stay whole in text.
//!
//! Over 300 lines on purpose: the two models are read against transformers' one mapping
//! file, and side by side their shared steps (added tokens, special tokens) show.

use super::metadata::Meta;
use crate::error::{Error, Result};
use crate::loader::TokenizerMeta;
use std::collections::{HashMap, HashSet};
use tokenizers::decoders::{byte_fallback::ByteFallback, fuse::Fuse, strip::Strip};
use tokenizers::decoders::{sequence::Sequence as DecoderSequence, DecoderWrapper};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// `token_type` values (llama.cpp's `LLAMA_TOKEN_TYPE_*`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values whose split regex differs from GPT-2's (transformers'
/// `GGUF_PRE_TOKENIZER_SPLITS`, the Llama 3 and Qwen2 families); others keep GPT-2's.
fn split_regex(pre: &str) -> Option<&'static str> {
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => Some(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => Some(QWEN2_SPLIT),
        _ => None,
    }
}

/// The longest token accepted (real vocabularies stay under a few hundred bytes).
const MAX_TOKEN_BYTES: usize = 1024;

/// The tokenizer and what the file says about using it; `None` when the file has no
/// `tokenizer.ggml.model`.
pub(super) fn build(meta: &Meta) -> Result<Option<(Tokenizer, TokenizerMeta)>> {
    const MODEL: &str = "tokenizer.ggml.model";
    let Some(model) = meta.opt_str(MODEL)? else {
        return Ok(None);
    };
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    // Merges rebuilt from scores cost the square of a token's length: bound it first.
    if let Some((id, t)) = (tokens.iter().enumerate()).find(|(_, t)| t.len() > MAX_TOKEN_BYTES) {
        let msg = format!(
            "has token {id} of {} bytes, more than {MAX_TOKEN_BYTES}",
            t.len()
        );
        return Err(meta.error("tokenizer.ggml.tokens", msg));
    }
    let types = meta
        .opt_ints("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    let token = |key: &str| -> Result<Option<String>> {
        match meta.opt_index(key)? {
            None => Ok(None),
            Some(id) => match tokens.get(id) {
                Some(t) => Ok(Some(t.to_string())),
                None => Err(meta.error(key, format!("is {id}, past the {} tokens", tokens.len()))),
            },
        }
    };
    let named: Vec<String> = ["bos", "eos", "unknown", "padding"]
        .iter()
        .map(|k| token(&format!("tokenizer.ggml.{k}_token_id")))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let (mut tokenizer, byte_level) = match model {
        "gpt2" => (byte_level_bpe(meta, &tokens)?, true),
        "llama" => (sentencepiece_bpe(meta, &tokens)?, false),
        other => {
            let msg = format!("is {other:?}, a tokenizer this loader does not build (gpt2, llama)");
            return Err(meta.error(MODEL, msg));
        }
    };
    add_special_tokens(meta, &mut tokenizer, &tokens, &types, &named, byte_level)?;
    let tokenizer_meta = TokenizerMeta {
        // llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos_token: Some(
            meta.opt_bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(!byte_level),
        ),
        add_eos_token: Some(
            meta.opt_bool("tokenizer.ggml.add_eos_token")?
                .unwrap_or(false),
        ),
        bos_token: token("tokenizer.ggml.bos_token_id")?,
        eos_token: token("tokenizer.ggml.eos_token_id")?,
        chat_template: meta.opt_str("tokenizer.chat_template")?.map(String::from),
    };
    Ok(Some((tokenizer, tokenizer_meta)))
}

/// GPT-2's byte alphabet: the printable character each byte is spelled with.
fn byte_alphabet() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| match printable(b) {
            true => char::from(b),
            false => {
                next += 1;
                char::from_u32(next - 1).unwrap_or('?')
            }
        })
        .collect()
}

fn bpe_error(meta: &Meta, e: impl std::fmt::Display) -> Error {
    Error::file(meta.path, format!("cannot build the tokenizer: {e}"))
}

/// `tokenizer.ggml.merges` as pairs; `None` when the file has none.
fn file_merges(meta: &Meta) -> Result<Option<Vec<(String, String)>>> {
    const KEY: &str = "tokenizer.ggml.merges";
    let Some(merges) = meta.opt_strings(KEY)? else {
        return Ok(None);
    };
    let pairs = merges
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) if !b.contains(' ') => Ok((a.to_string(), b.to_string())),
            _ => Err(meta.error(
                KEY,
                format!("entry {i} ({m:?}) is not two tokens split by a space"),
            )),
        });
    pairs.collect::<Result<Vec<_>>>().map(Some)
}

fn byte_level_bpe(meta: &Meta, tokens: &[&str]) -> Result<Tokenizer> {
    let alphabet = byte_alphabet();
    let spelled: HashSet<char> = alphabet.iter().copied().collect();
    let vocab: Vocab = (0u32..)
        .zip(tokens)
        .map(|(id, t)| match t.chars().all(|c| spelled.contains(&c)) {
            true => (t.to_string(), id),
            false => (t.bytes().map(|b| alphabet[b as usize]).collect(), id),
        })
        .collect();
    let merges = match file_merges(meta)? {
        Some(m) => m,
        None => return Err(meta.error("tokenizer.ggml.merges", "is missing")),
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .build()
        .map_err(|e| bpe_error(meta, e))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = meta.opt_str("tokenizer.ggml.pre")?.unwrap_or_default();
    let pre_tokenizer: PreTokenizerWrapper = match split_regex(pre) {
        None => ByteLevel::new(false, true, true).into(),
        Some(regex) => {
            let split = Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| bpe_error(meta, e))?;
            Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into()
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    Ok(tokenizer)
}

fn sentencepiece_bpe(meta: &Meta, tokens: &[&str]) -> Result<Tokenizer> {
    let vocab: Vocab = (0u32..)
        .zip(tokens)
        .map(|(id, t)| (t.to_string(), id))
        .collect();
    let merges = match file_merges(meta)? {
        Some(m) => m,
        None => {
            let scores = meta.opt_floats("tokenizer.ggml.scores")?;
            let scores = scores.ok_or_else(|| {
                meta.error(
                    "tokenizer.ggml.scores",
                    "is missing (and so are the merges)",
                )
            })?;
            if scores.len() != tokens.len() {
                let msg = format!("has {} entries for {} tokens", scores.len(), tokens.len());
                return Err(meta.error("tokenizer.ggml.scores", msg));
            }
            // Every split of every token is looked up: bound the whole (real vocabularies
            // need a few million; 2^28 is about a second).
            let work: u64 = tokens.iter().map(|t| (t.len() as u64).pow(2)).sum();
            if work > 1 << 28 {
                let msg = format!(
                    "are too long to rebuild merges from (the squares of their lengths sum \
                     to {work}, more than 2^28)"
                );
                return Err(meta.error("tokenizer.ggml.tokens", msg));
            }
            merges_from_scores(tokens, &scores, &vocab)
        }
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| bpe_error(meta, e))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, false)));
    let replace = Replace::new("▁", " ").map_err(|e| bpe_error(meta, e))?;
    let decoders: Vec<DecoderWrapper> = vec![
        replace.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
        Strip::new(' ', 1, 0).into(),
    ];
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// transformers' `generate_merges(vocab, scores)`: every split of every token into two tokens
/// of the vocabulary, best score first (ties: shorter left piece, then shorter right piece,
/// then the order found, i.e. by token, then by the pieces' ids).
fn merges_from_scores(tokens: &[&str], scores: &[f64], vocab: &Vocab) -> Vec<(String, String)> {
    // (left, right, score), in the order transformers builds them
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    // A token listed twice is split once, with its last score (a Python dict).
    let last_score: HashMap<&str, f64> =
        tokens.iter().copied().zip(scores.iter().copied()).collect();
    let mut seen = HashSet::new();
    for token in tokens {
        if !seen.insert(*token) {
            continue;
        }
        let score = last_score[token];
        let mut local: Vec<(&str, &str, f64)> = token
            .char_indices()
            .skip(1)
            .map(|(i, _)| token.split_at(i))
            .filter(|(l, r)| vocab.contains_key(*l) && vocab.contains_key(*r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|(l, r, _)| (vocab[*l], vocab[*r]));
        merges.extend(local);
    }
    // Python's stable `sorted(..., key=(score, len l, len r), reverse=True)`.
    let key = |m: &(&str, &str, f64)| (m.2, m.0.chars().count(), m.1.chars().count());
    merges.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0)
            .then(kb.1.cmp(&ka.1))
            .then(kb.2.cmp(&ka.2))
    });
    merges
        .into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
}

/// Control tokens and the named special tokens as special added tokens, user-defined ones as
/// plain added tokens (all matched whole in the text, never normalized). In a byte-level
/// vocabulary a control token spelled outside the byte alphabet is a llama.cpp mislabel and
/// is skipped, as transformers skips it.
fn add_special_tokens(
    meta: &Meta,
    tokenizer: &mut Tokenizer,
    tokens: &[&str],
    types: &[i64],
    named: &[String],
    byte_level: bool,
) -> Result<()> {
    let spelled: HashSet<char> = byte_alphabet().into_iter().collect();
    let of_type = |kind: i64| {
        tokens
            .iter()
            .zip(types)
            .filter(move |(_, &t)| t == kind)
            .map(|(tok, _)| *tok)
    };
    // The special tokens transformers' tokenizer classes name by default (GPT2Tokenizer,
    // LlamaTokenizer) are made special too where the vocabulary has them.
    let defaults: &[&str] = match byte_level {
        true => &["<|endoftext|>"],
        false => &["<unk>", "<s>", "</s>"],
    };
    let in_vocab: HashSet<&str> = tokens.iter().copied().collect();
    let control = of_type(CONTROL)
        .filter(|t| !byte_level || t.chars().all(|c| spelled.contains(&c)))
        .chain(defaults.iter().copied().filter(|t| in_vocab.contains(t)))
        .map(String::from)
        .chain(named.iter().cloned());
    let special: Vec<AddedToken> = control
        .map(|t| AddedToken::from(t, true).normalized(false))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| bpe_error(meta, e))?;
    let vocab = tokenizer.get_vocab(true);
    let user: Vec<AddedToken> = of_type(USER_DEFINED)
        .filter(|t| vocab.contains_key(*t))
        .map(|t| AddedToken::from(t, false).normalized(false))
        .collect();
    tokenizer.add_tokens(user).map_err(|e| bpe_error(meta, e))?;
    Ok(())
}
