//! A conversation that keeps its KV cache between turns. Each turn renders the whole
//! conversation through the chat template, as transformers would, and prefills only the
//! tokens after the longest prefix already in the cache: turn N costs its new tokens, not
//! the history. When the conversation outgrows the cache, the oldest turns are dropped (the
//! system message stays) and the caller is told.

use super::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::generate::{self, Generation, Options};
use crate::kv_cache::{common_prefix, KvCache};
use crate::loader::TextTokenizer;
use crate::model::Transformer;
use crate::sampling::Sampler;

pub struct Conversation<'a> {
    model: &'a Transformer,
    tokenizer: &'a TextTokenizer,
    template: ChatTemplate,
    /// The system message, if any, then alternating user and assistant messages.
    messages: Vec<Message>,
    /// Holds the ids of the turns so far ([`KvCache::ids`]); a turn keeps the prefix its
    /// prompt shares with them, as the server's pool keeps a conversation's blocks.
    cache: KvCache,
}

/// What a turn did besides generating.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnNotes {
    /// Old messages dropped to make room (user and assistant, oldest first).
    pub dropped_messages: usize,
}

fn message(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}

impl<'a> Conversation<'a> {
    /// A conversation in a cache of `context` positions (at most the model's).
    pub fn new(
        model: &'a Transformer,
        tokenizer: &'a TextTokenizer,
        template: ChatTemplate,
        system: Option<&str>,
        context: usize,
    ) -> Result<Self> {
        let cfg = model.config();
        let context = context.min(cfg.max_position_embeddings);
        let cache = model.new_cache(context)?;
        Ok(Self {
            model,
            tokenizer,
            template,
            messages: system.map(|s| message("system", s)).into_iter().collect(),
            cache,
        })
    }

    /// Forgets every turn (the system message stays); the cache keeps its memory.
    pub fn clear(&mut self) {
        self.messages.retain(|m| m.role == "system");
        self.cache.reset();
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Adds the user's message, generates the reply into the conversation and returns it.
    /// On an error the conversation is as it was before the turn.
    pub fn turn(
        &mut self,
        user: &str,
        opts: Options<'_>,
        sampler: &mut Sampler,
        on_text: impl FnMut(&str),
    ) -> Result<(Generation, TurnNotes)> {
        let before = self.messages.clone();
        self.messages.push(message("user", user));
        let result = self.fit(opts.max_new_tokens).and_then(|(ids, notes)| {
            self.cache.truncate(common_prefix(self.cache.ids(), &ids));
            let g = generate::generate_in(
                self.model,
                self.tokenizer.inner(),
                &mut self.cache,
                &ids,
                opts,
                sampler,
                on_text,
            )?;
            Ok((g, notes))
        });
        match result {
            Ok((g, notes)) => {
                self.messages.push(message("assistant", &g.text));
                Ok((g, notes))
            }
            Err(e) => {
                self.messages = before;
                // The cache may hold part of a failed prefill: trust none of it.
                self.cache.reset();
                Err(e)
            }
        }
    }

    /// The conversation's prompt ids, after dropping the oldest turns until they leave room
    /// for the reply (`max_new` tokens, or half the cache when that is less).
    fn fit(&mut self, max_new: usize) -> Result<(Vec<u32>, TurnNotes)> {
        let capacity = self.cache.capacity();
        let mut notes = TurnNotes::default();
        loop {
            let text = self.template.render(&self.messages, true)?;
            let ids = self.tokenizer.encode_plain(&text)?;
            if ids.len() + max_new.min(capacity / 2) <= capacity {
                return Ok((ids, notes));
            }
            let first = usize::from(self.messages.first().is_some_and(|m| m.role == "system"));
            // Only the new user message is left after the system one: nothing more to drop.
            if self.messages.len() - first <= 1 {
                return Err(Error::Invalid(format!(
                    "the message is {} tokens with the chat template, and the context holds \
                     {capacity} with room for the reply: shorten it, or raise --context",
                    ids.len()
                )));
            }
            // Drop a whole exchange (user and assistant) so that roles keep alternating.
            let n = (self.messages.len() - first - 1).min(2);
            self.messages.drain(first..first + n);
            notes.dropped_messages += n;
        }
    }
}
