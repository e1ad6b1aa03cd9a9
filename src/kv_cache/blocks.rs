//! Which blocks of a [`super::KvPool`] are free, which sequences hold each, and the prefix
//! index: full blocks found by their tokens and everything before them, so that a request
//! whose prompt begins with what another has cached reuses those blocks instead of
//! prefilling them (vLLM's automatic prefix caching). A sequence that ends indexes its last,
//! partly filled block too, and a prompt may end its reuse with the first positions of any
//! indexed block (whole or not) that begins as its rest does: the next turn of a
//! conversation, or the same prompt again, reuses every token the turn before cached, as
//! llama-server's slots do, not only whole blocks. A reused block is never written: a
//! sequence that would write into one copies it first.
//!
//! A block is *held* while a sequence has it in its table (`refs` > 0), *idle* when none
//! does but it keeps an indexed prefix (reused when a prompt asks for it, evicted oldest
//! first when a block is needed), and *free* otherwise. An index entry names its block's
//! tokens and its parent block with the parent's epoch, the count of times that block was
//! taken for new content: an entry whose parent was evicted and refilled can never match
//! again, so lookups are exact (no hash is trusted) and the chain is the whole prefix.

use std::collections::{BTreeMap, HashMap};

/// What an index entry is looked up by: the block's tokens after its parent (block, epoch).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    parent: Option<(u32, u64)>,
    tokens: Box<[u32]>,
}

/// Blocks by state, counted for metrics and admission.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// In some sequence's table.
    pub held: usize,
    /// In no table, keeping an indexed prefix (evictable).
    pub cached: usize,
    /// Empty.
    pub free: usize,
}

#[derive(Debug)]
pub(super) struct Blocks {
    /// Positions per block.
    size: usize,
    refs: Vec<u32>,
    epoch: Vec<u64>,
    /// The index entry each block holds, if any.
    key: Vec<Option<Key>>,
    free: Vec<u32>,
    /// Idle blocks by when they became idle (oldest first), and each one's stamp.
    idle: BTreeMap<u64, u32>,
    idle_at: Vec<u64>,
    clock: u64,
    index: HashMap<Key, u32>,
    /// The indexed blocks after each parent (whole and partly filled), for the last block
    /// of a reuse, which may match only its first positions.
    children: HashMap<Option<(u32, u64)>, Vec<u32>>,
    /// Whether full blocks are indexed at all (a private cache never shares).
    sharing: bool,
}

impl Blocks {
    pub fn new(count: usize, size: usize, sharing: bool) -> Self {
        Self {
            size,
            refs: vec![0; count],
            epoch: vec![0; count],
            key: vec![None; count],
            // Popped from the end: block 0 first, so a fresh pool hands out ascending runs.
            free: (0..count as u32).rev().collect(),
            idle: BTreeMap::new(),
            idle_at: vec![0; count],
            clock: 0,
            index: HashMap::new(),
            children: HashMap::new(),
            sharing,
        }
    }

    pub fn usage(&self) -> Usage {
        let (cached, free) = (self.idle.len(), self.free.len());
        Usage {
            held: self.refs.len() - cached - free,
            cached,
            free,
        }
    }

    /// Blocks a sequence could take now (free, or idle and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// A block for new content, held once: a free one, else the idle one idle longest (its
    /// prefix forgotten). `None` when every block is held.
    pub fn take(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.idle.pop_first()?;
                self.forget(b);
                b
            }
        };
        self.epoch[b as usize] += 1;
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more sequence holds `b` (a cached prefix reused).
    pub fn hold(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.idle.remove(&self.idle_at[i]);
        }
        self.refs[i] += 1;
    }

    /// A sequence lets go of `b`: idle if it keeps a prefix, else free.
    pub fn release(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            // Released more often than held: a bug, but never a block on the free list twice.
            debug_assert!(false, "block {b} released more often than held");
            return;
        }
        self.refs[i] -= 1;
        if self.refs[i] > 0 {
            return;
        }
        match self.key[i].is_some() {
            true => {
                self.clock += 1;
                self.idle_at[i] = self.clock;
                self.idle.insert(self.clock, b);
            }
            false => self.free.push(b),
        }
    }

    /// Whether a sequence that holds `b` must copy it before writing into it: when another
    /// sequence holds it too, or an indexed block follows it (a block in the middle of a
    /// cached conversation, whose rest would be lost).
    pub fn must_copy(&self, b: u32) -> bool {
        let i = b as usize;
        let after = Some((b, self.epoch[i]));
        self.refs[i] != 1
            || (self.key[i].is_some() && self.children.get(&after).is_some_and(|c| !c.is_empty()))
    }

    /// Makes `b` the one holder's to write into, unless it [`Blocks::must_copy`] it (then
    /// false): out of the index if it was in (a sequence's own last block, indexed when it
    /// was preempted or ended), its epoch bumped so that nothing matches its old content.
    pub fn own(&mut self, b: u32) -> bool {
        if self.must_copy(b) {
            return false;
        }
        if self.key[b as usize].is_some() {
            self.forget(b);
            self.epoch[b as usize] += 1;
        }
        true
    }

    /// Indexes block `b` holding `tokens` (a full block, or the first positions of a
    /// sequence's last one) after `parent`. A block whose content is indexed already
    /// (another sequence prefilled the same prefix at the same time) stays out of the index.
    pub fn register(&mut self, b: u32, parent: Option<u32>, tokens: &[u32]) {
        if !self.sharing || self.key[b as usize].is_some() || tokens.is_empty() {
            return;
        }
        debug_assert!(tokens.len() <= self.size);
        let key = Key {
            parent: parent.map(|p| (p, self.epoch[p as usize])),
            tokens: tokens.into(),
        };
        if self.index.contains_key(&key) {
            return;
        }
        self.children.entry(key.parent).or_default().push(b);
        self.index.insert(key.clone(), b);
        self.key[b as usize] = Some(key);
    }

    /// The indexed blocks that hold the longest prefix of `ids[..max]`: whole blocks, then
    /// at most one partly filled. Returns them (not held by the caller yet) and the
    /// positions they hold.
    pub fn lookup(&self, ids: &[u32], max: usize) -> (Vec<u32>, usize) {
        let ids = &ids[..max.min(ids.len())];
        let mut found = Vec::new();
        let mut parent = None;
        let find = |parent, tokens: &[u32]| {
            let key = Key {
                parent,
                tokens: tokens.into(),
            };
            self.index.get(&key).copied()
        };
        for tokens in ids.chunks_exact(self.size) {
            let Some(b) = find(parent, tokens) else {
                break;
            };
            parent = Some((b, self.epoch[b as usize]));
            found.push(b);
        }
        // Then the first positions of the block after them that shares most with the rest.
        let (whole, rest) = ids.split_at(found.len() * self.size);
        let shared = |&b: &u32| {
            let tokens = self.key[b as usize]
                .as_ref()
                .map_or(&[][..], |k| &k.tokens[..]);
            (super::common_prefix(tokens, rest), b)
        };
        let children = self.children.get(&parent).map_or(&[][..], Vec::as_slice);
        match children.iter().map(shared).max() {
            Some((m, b)) if m > 0 => {
                found.push(b);
                (found, whole.len() + m)
            }
            _ => (found, whole.len()),
        }
    }

    /// Removes `b`'s index entry.
    fn forget(&mut self, b: u32) {
        if let Some(key) = self.key[b as usize].take() {
            if self.index.get(&key) == Some(&b) {
                self.index.remove(&key);
            }
            if let Some(children) = self.children.get_mut(&key.parent) {
                children.retain(|&c| c != b);
                if children.is_empty() {
                    self.children.remove(&key.parent);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_found_whole_and_exactly() {
        let mut b = Blocks::new(4, 2, true);
        let (x, y) = (b.take().unwrap(), b.take().unwrap());
        assert_eq!((x, y), (0, 1), "a fresh pool hands out ascending blocks");
        b.register(x, None, &[1, 2]);
        b.register(y, Some(x), &[3, 4]);
        assert_eq!(b.lookup(&[1, 2, 3, 4, 5], 8), (vec![x, y], 4));
        assert_eq!(
            b.lookup(&[1, 2, 3, 9], 8),
            (vec![x, y], 3),
            "y's first position"
        );
        assert_eq!(b.lookup(&[1, 2, 3, 4], 3), (vec![x, y], 3));
        assert_eq!(b.lookup(&[1, 2, 9], 8), (vec![x], 2));
        assert!(
            b.lookup(&[3, 4], 8).0.is_empty(),
            "a block is found only after its parent"
        );
        // Released, they stay cached; evicted oldest first once the free ones run out.
        b.release(x);
        b.release(y);
        assert_eq!(
            b.usage(),
            Usage {
                held: 0,
                cached: 2,
                free: 2
            }
        );
        let (_, _) = (b.take().unwrap(), b.take().unwrap());
        let z = b.take().unwrap();
        assert_eq!(z, x, "the block idle longest is evicted first");
        assert!(b.lookup(&[1, 2, 3, 4], 8).0.is_empty());
        // y's parent was refilled: y can never match again, even if x holds [1, 2] again.
        b.register(z, None, &[1, 2]);
        assert_eq!(b.lookup(&[1, 2, 3, 4], 8), (vec![z], 2));
        assert_eq!(
            b.lookup(&[1, 9], 8),
            (vec![z], 1),
            "a whole block's first position"
        );
    }

    #[test]
    fn a_partly_filled_last_block_is_found_after_the_whole_ones() {
        let mut b = Blocks::new(3, 4, true);
        let (x, y) = (b.take().unwrap(), b.take().unwrap());
        b.register(x, None, &[1, 2, 3, 4]);
        b.register(y, Some(x), &[5, 6]);
        assert_eq!(b.lookup(&[1, 2, 3, 4, 5, 6, 7], 9), (vec![x, y], 6));
        assert_eq!(
            b.lookup(&[1, 2, 3, 4, 5, 6, 7], 5),
            (vec![x, y], 5),
            "at most max"
        );
        assert_eq!(b.lookup(&[1, 2, 3, 4, 5, 9], 9), (vec![x, y], 5));
        assert_eq!(b.lookup(&[1, 2, 3, 4, 9], 9), (vec![x], 4));
    }

    #[test]
    fn a_block_is_written_in_place_only_by_its_one_holder_and_never_mid_prefix() {
        let mut b = Blocks::new(4, 2, true);
        let (x, y) = (b.take().unwrap(), b.take().unwrap());
        b.register(x, None, &[7, 7]);
        b.register(y, Some(x), &[8]);
        b.hold(y);
        assert!(!b.own(y), "held twice: copied");
        b.release(y);
        assert!(!b.own(x), "a cached prefix goes on after it: copied");
        assert!(b.own(y), "its own last block: written in place");
        assert_eq!(b.lookup(&[7, 7, 8], 8), (vec![x], 2), "and no longer found");
        // Once nothing indexed follows x, its holder may write it, and what was indexed
        // after its old content never matches its new one.
        b.register(y, Some(x), &[9, 9]);
        b.release(y);
        let _ = (b.take().unwrap(), b.take().unwrap());
        assert_eq!(b.take(), Some(y), "y evicted, the oldest idle block");
        assert!(b.own(x));
        b.register(x, None, &[7, 7]);
        assert_eq!(b.lookup(&[7, 7, 9, 9], 8), (vec![x], 2));
    }

    #[test]
    fn private_blocks_are_never_indexed() {
        let mut b = Blocks::new(1, 2, false);
        let x = b.take().unwrap();
        b.register(x, None, &[1, 2]);
        assert!(b.lookup(&[1, 2], 8).0.is_empty());
        b.release(x);
        assert_eq!(b.available(), 1);
        assert!(b.take().is_some() && b.take().is_none());
    }
}
