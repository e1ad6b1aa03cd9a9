//! The caches the scheduler lends to requests, each remembering the tokens it holds, so
//! that a request whose prompt begins with them does not prefill them again (llama-server's
//! slot prompt cache): a chat client re-sends the whole conversation every turn, and the
//! turn before is still in the cache it ran in. A request takes the free cache that shares
//! the longest prefix with its prompt; among caches sharing none, the one used longest ago,
//! so that recent conversations keep theirs.

use crate::kv_cache::KvCache;

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Fewest shared tokens for a cache's prefix to be worth reusing over an empty cache.
const WORTH_KEEPING: usize = 32;

/// A cache and what it holds.
pub struct Slot {
    pub cache: KvCache,
    /// The tokens in the cache's first `cache.len()` positions, one per position.
    ids: Vec<u32>,
    /// When it was last given back (a counter): older slots are taken first.
    returned: u64,
}

/// The free caches.
#[derive(Default)]
pub struct Slots {
    free: Vec<Slot>,
    clock: u64,
}

impl Slots {
    pub fn len(&self) -> usize {
        self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }

    /// Gives back a cache whose first `cache.len()` positions hold `ids[..cache.len()]`
    /// (a finished request's prompt and completion); `None` forgets what it holds.
    pub fn give_back(&mut self, mut cache: KvCache, ids: Option<&[u32]>) {
        let ids = match ids {
            Some(ids) if ids.len() >= cache.len() => ids[..cache.len()].to_vec(),
            _ => {
                cache.reset();
                Vec::new()
            }
        };
        self.clock += 1;
        self.free.push(Slot {
            cache,
            ids,
            returned: self.clock,
        });
    }

    /// The longest prefix of `prompt` a free cache holds.
    pub fn longest_prefix(&self, prompt: &[u32]) -> usize {
        let shared = |s: &Slot| common_prefix(&s.ids, prompt);
        self.free.iter().map(shared).max().unwrap_or(0)
    }

    /// Takes the free cache that holds the longest prefix of `prompt`, cut to that prefix:
    /// the request then prefills only the rest. A prefix shorter than [`WORTH_KEEPING`]
    /// tokens (a chat template's opening, shared by every conversation) counts as none: then
    /// an empty cache, else the one used longest ago, rather than cut a cached conversation.
    pub fn take(&mut self, prompt: &[u32]) -> Option<KvCache> {
        let shared = |s: &Slot| common_prefix(&s.ids, prompt);
        let worth = |s: &Slot| Some(shared(s)).filter(|&n| n >= WORTH_KEEPING).unwrap_or(0);
        let (at, _) = self
            .free
            .iter()
            .enumerate()
            .max_by_key(|(_, s)| (worth(s), s.ids.is_empty(), std::cmp::Reverse(s.returned)))?;
        let slot = self.free.swap_remove(at);
        let n = shared(&slot);
        let mut cache = slot.cache;
        cache.truncate(n);
        Some(cache)
    }
}
