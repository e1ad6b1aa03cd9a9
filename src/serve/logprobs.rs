//! OpenAI's `logprobs`: each generated token's log-probability, and its most likely
//! alternatives, as token text and bytes, in chat's shape (`{"content": [...]}`) or the
//! completions' (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

use crate::sampling::TokenLogprob;
use serde_json::{json, Map, Value};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

/// One token as a client reads it: its text, its bytes, its log-probability.
#[derive(Debug, Clone)]
pub struct Scored {
    /// The bytes as text; a token that is part of a UTF-8 character shows U+FFFD.
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A generated token and its alternatives.
#[derive(Debug, Clone)]
pub struct Logprobs {
    pub chosen: Scored,
    pub top: Vec<Scored>,
}

/// OpenAI's stand-in for a log-probability of -inf (JSON has no infinities).
const FLOOR: f32 = -9999.0;

impl Logprobs {
    pub fn new(tokenizer: &Tokenizer, lp: &TokenLogprob) -> Self {
        let scored = |id: u32, logprob: f32| {
            let bytes = token_bytes(tokenizer, id);
            Scored {
                token: String::from_utf8_lossy(&bytes).into_owned(),
                bytes,
                logprob: logprob.max(FLOOR),
            }
        };
        Logprobs {
            chosen: scored(lp.id, lp.logprob),
            top: lp.top.iter().map(|&(id, l)| scored(id, l)).collect(),
        }
    }
}

/// The bytes a token stands for. Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) spells
/// each byte as one character of its byte-to-unicode table; SentencePiece spells a space
/// `▁` and a byte it has no piece for `<0xNN>`. Added tokens are their text.
fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    let Some(piece) = tokenizer.id_to_token(id) else {
        return Vec::new();
    };
    // (`Tokenizer::get_added_tokens_decoder` clones the whole map: this one is borrowed.)
    let added = tokenizer
        .get_added_vocabulary()
        .get_added_tokens_decoder()
        .contains_key(&id);
    if !added && matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
        if let Some(bytes) = piece.chars().map(byte_level).collect::<Option<Vec<u8>>>() {
            return bytes;
        }
    }
    let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
    if let Some(byte) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
        return vec![byte];
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// The byte of one character of GPT-2's byte-to-unicode table: the printable bytes stand
/// for themselves, the other 68 (0-32, 127-160, 173) for U+0100 onwards, in order.
fn byte_level(c: char) -> Option<u8> {
    let printable = |b: u32| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let c = c as u32;
    if printable(c) {
        return Some(c as u8);
    }
    let n = c.checked_sub(256)? as usize;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(n)
        .map(|b| b as u8)
}

/// `choices[i].logprobs` of `/v1/chat/completions`, whole or one chunk's tokens.
pub fn chat(tokens: &[Logprobs]) -> Value {
    let entry = |s: &Scored| json!({"token": s.token, "logprob": s.logprob, "bytes": s.bytes});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.chosen);
            e["top_logprobs"] = t.top.iter().map(entry).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// `choices[i].logprobs` of `/v1/completions`; `offset` is the completion's text length
/// before these tokens (their `text_offset` counts from the completion's start).
pub fn completion(tokens: &[Logprobs], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.chosen.token.chars().count();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let map: Map<String, Value> = t
                .top
                .iter()
                .map(|s| (s.token.clone(), json!(s.logprob)))
                .collect();
            Value::Object(map)
        })
        .collect();
    json!({"tokens": tokens.iter().map(|t| &t.chosen.token).collect::<Vec<_>>(),
           "token_logprobs": tokens.iter().map(|t| t.chosen.logprob).collect::<Vec<_>>(),
           "top_logprobs": top, "text_offset": text_offset})
}

#[cfg(test)]
mod tests {
    use super::byte_level;

    #[test]
    fn byte_level_table_inverts_gpt2s() {
        // GPT-2's bytes_to_unicode: 'Ġ' (U+0120) is the space, 'Ċ' (U+010A) the newline.
        assert_eq!(byte_level('Ġ'), Some(b' '));
        assert_eq!(byte_level('Ċ'), Some(b'\n'));
        assert_eq!(byte_level('a'), Some(b'a'));
        assert_eq!(byte_level('\u{0100}'), Some(0));
        assert_eq!(byte_level('\u{0143}'), Some(173)); // the 68th and last
        assert_eq!(byte_level('\u{0144}'), None);
        let all: std::collections::BTreeSet<u8> = (0u32..0x200)
            .filter_map(char::from_u32)
            .filter_map(byte_level)
            .collect();
        assert_eq!(all.len(), 256);
    }
}
