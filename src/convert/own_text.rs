//! The calibration text a model writes itself, for `--heal` without `--calibration`: the
//! original model samples continuations of varied short prompts in batches, so healing fits
//! the converted model on what the original actually says, with no corpus to ship. Half the
//! prompts ask through the chat template (when the model has one), half are the openings of
//! texts of other kinds (an article, a story, a letter, a poem, a dialogue) for the model to
//! go on as it was pretrained to: healed on chat answers alone, a model lost as much again on
//! a play as on prose (SmolLM2 `mla:64`, docs/conversion.md).

use crate::chat::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::generate::{self, Options, Sequence};
use crate::kv_cache::{KvCache, KvPool, BLOCK};
use crate::loader::Loaded;
use crate::sampling::{Sampler, SamplingParams};

/// What the prompts are about: everyday, technical, historical and story subjects.
const TOPICS: &[&str] = &[
    "the history of the printing press",
    "how volcanoes form",
    "a day in the life of a lighthouse keeper",
    "the rules of chess",
    "how to bake bread",
    "the water cycle",
    "a detective solving a mystery in a small town",
    "the benefits of regular exercise",
    "how airplanes fly",
    "the French Revolution",
    "a friendship between a robot and a child",
    "photosynthesis",
    "how to learn a new language",
    "the planets of the solar system",
    "a recipe for vegetable soup",
    "how the immune system works",
    "the importance of sleep",
    "how bees make honey",
    "a journey across the desert",
    "the basics of personal finance",
    "the life of Marie Curie",
    "how a compiler turns code into a program",
    "a lost dog finding its way home",
    "the invention of the telephone",
    "how to write a good essay",
    "the creatures of the deep ocean",
    "why the sky is blue",
    "the Roman Empire",
    "how to plant a vegetable garden",
    "how the internet sends a message",
    "a storm at sea",
    "the causes of climate change",
];

/// How a chat model is asked (`{}`: the topic).
const ASKS: &[&str] = &[
    "Tell me about {}.",
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "Write an essay on {}.",
];

/// Openings of texts of other kinds, for the model to continue without a template (`{}`: the
/// topic, `{T}`: the topic capitalised).
const OPENINGS: &[&str] = &[
    "{T}\n\n{T} is",
    "Chapter One\n\nNobody in the village had ever thought much about {}, until",
    "Dear Margaret,\n\nI promised to write to you about {}, so here it is.",
    "A poem on {}\n\n",
    "A conversation about {}.\n\nANNA: I have never understood {}.\nTOM:",
];

/// A prompt: a question through the chat template, or the opening of a text.
#[derive(Debug, PartialEq)]
enum Prompt {
    Chat(String),
    Opening(String),
}

/// Sequences sampled together on the CPU, and on a GPU. SmolLM2's 36k tokens on an H200: 46.5 s
/// in batches of 64, 50 s in batches of 16 (2026-11-27); a step's cost there grows with its
/// sequences (80 against 22 ms), so per-sequence work bounds it, not the shared layers. The
/// prompts and seeds are the same either way: 32k tokens is 128 sequences.
const BATCH_CPU: usize = 16;
const BATCH_GPU: usize = 64;
/// New tokens per sequence at most (a window and a bit, so most windows are one answer).
const NEW_TOKENS: usize = 288;

/// Sequences to sample together for `wanted` more tokens: [`BATCH_CPU`] on the CPU; off it up
/// to [`BATCH_GPU`], but no more of the CPU's batches than `wanted` needs at least (a sequence
/// writes at most [`NEW_TOKENS`]), so that a short text is not several times what was asked.
fn batch(cpu: bool, wanted: usize) -> usize {
    match cpu {
        true => BATCH_CPU,
        false => (wanted.div_ceil(NEW_TOKENS).next_multiple_of(BATCH_CPU)).min(BATCH_GPU),
    }
}

/// The i-th prompt: with `chat`, questions and openings by turns, else openings only; each
/// kind goes through topic and ask (or opening) pairs in an order that varies both.
fn prompt(i: usize, chat: bool) -> Prompt {
    let n = if chat { i / 2 } else { i };
    let topic = TOPICS[n % TOPICS.len()];
    let round = n / TOPICS.len() + n;
    if chat && i.is_multiple_of(2) {
        return Prompt::Chat(ASKS[round % ASKS.len()].replace("{}", topic));
    }
    let mut capital = topic.to_string();
    if let Some(first) = capital.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    let opening = OPENINGS[round % OPENINGS.len()];
    Prompt::Opening(opening.replace("{T}", &capital).replace("{}", topic))
}

/// About `tokens` tokens (at least) of text `loaded` writes from its prompts, with each
/// prompt's tokens before its continuation, sampled at temperature 0.9 (top-p 0.95) from
/// `seed`; `progress(tokens so far, tokens)` after each batch.
pub fn write(
    loaded: &Loaded,
    tokens: usize,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<u32>> {
    let model = &loaded.model;
    let tokenizer = loaded.tokenizer.as_ref().ok_or_else(|| {
        Error::Invalid("--heal: the model's own calibration text needs its tokenizer.json".into())
    })?;
    let template = ChatTemplate::from_meta(&loaded.meta)?;
    let mut out = Vec::with_capacity(tokens + BATCH_GPU * NEW_TOKENS);
    let mut next = 0;
    while out.len() < tokens {
        let size = batch(model.device().is_cpu(), tokens - out.len());
        let prompts = (next..next + size)
            .map(|i| match (prompt(i, template.is_some()), &template) {
                (Prompt::Chat(ask), Some(t)) => {
                    let m = [Message {
                        role: "user".into(),
                        content: ask,
                    }];
                    tokenizer.encode_plain(&t.render(&m, true)?)
                }
                (Prompt::Chat(text) | Prompt::Opening(text), _) => tokenizer.encode(&text),
            })
            .collect::<Result<Vec<_>>>()?;
        // One pool for the batch, as the server's: off the CPU its single new tokens then
        // attend together (`attention::spans`), not a sequence at a time. (On the CPU the
        // decode op reads the pool's tables: SmolLM2's 4k tokens took 10.2-11.0 s so,
        // 10.0-10.2 s in caches of their own, Zen 5.)
        let cfg = model.config();
        let capacity = |p: &Vec<u32>| generate::capacity(model, p.len(), NEW_TOKENS);
        let blocks: usize = prompts.iter().map(|p| capacity(p).div_ceil(BLOCK)).sum();
        let per_token = cfg.kv_bytes_per_token(model.cache_dtype().size_in_bytes());
        let pool = KvPool::new(
            cfg,
            blocks * BLOCK * per_token,
            model.cache_dtype(),
            model.device(),
        )?;
        let mut caches: Vec<KvCache> = prompts.iter().map(|p| pool.sequence(capacity(p))).collect();
        let mut samplers = (next..next + size)
            .map(|i| {
                Sampler::new(&SamplingParams {
                    temperature: 0.9,
                    top_p: 0.95,
                    seed: seed.wrapping_add(i as u64),
                    ..Default::default()
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut seqs = prompts
            .iter()
            .zip(caches.iter_mut().zip(samplers.iter_mut()))
            .map(|(p, (cache, sampler))| {
                let opts = Options::new(NEW_TOKENS);
                Sequence::new(model, tokenizer.inner(), cache, p, opts, sampler)
            })
            .collect::<Result<Vec<_>>>()?;
        generate::run(model, &mut seqs, None, |_, _| {})?;
        for (p, seq) in prompts.iter().zip(&seqs) {
            out.extend_from_slice(p);
            out.extend_from_slice(seq.generated());
        }
        next += size;
        progress(out.len().min(tokens), tokens);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_gpu_batch_is_no_larger_than_the_text_needs() {
        assert_eq!(batch(true, 32768), BATCH_CPU);
        assert_eq!(batch(true, 10), BATCH_CPU);
        assert_eq!(batch(false, 32768), BATCH_GPU);
        // 4,096 tokens need at least 15 sequences: one CPU batch, not four.
        assert_eq!(batch(false, 4096), BATCH_CPU);
        assert_eq!(batch(false, 10), BATCH_CPU);
        assert_eq!(batch(false, 17 * NEW_TOKENS), 2 * BATCH_CPU);
    }

    #[test]
    fn prompts_vary_topic_and_kind() {
        let n = 2 * TOPICS.len() * ASKS.len() * OPENINGS.len();
        let (mut chats, mut openings) = (HashSet::new(), HashSet::new());
        for i in 0..n {
            match prompt(i, true) {
                Prompt::Chat(ask) => chats.insert(ask),
                Prompt::Opening(text) => openings.insert(text),
            };
        }
        assert_eq!(chats.len(), TOPICS.len() * ASKS.len());
        assert_eq!(openings.len(), TOPICS.len() * OPENINGS.len());
        assert_eq!(
            prompt(1, true),
            Prompt::Opening(
                "The history of the printing press\n\nThe history of the printing press is".into()
            )
        );
        // Without a template every prompt is an opening.
        assert!((0..n).all(|i| matches!(prompt(i, false), Prompt::Opening(_))));
    }
}
