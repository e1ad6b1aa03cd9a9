//! Reading and writing one sequence's positions through its block table: [`Pages`] says
//! where positions `0..len` are in a pool's tensors, [`LayerView`] writes a step's rows there
//! and hands them back, on the CPU as views when the positions are one run (every cache of
//! its own), and otherwise as the pool's tensors with the table ([`Held`]) for the decode op,
//! for a batch gathered from one pool, or gathered alone.

use super::{LayerCache, BLOCK};
use candle_core::{Result, Tensor};
use std::sync::OnceLock;

/// Where a sequence's positions `0..len` are: `table[i]` is the block of positions
/// i·BLOCK.., so position p is at pool position table[p / BLOCK]·BLOCK + p % BLOCK.
#[derive(Debug)]
pub struct Pages {
    table: Vec<u32>,
    len: usize,
    /// The first block when the table is one ascending run (positions are then contiguous).
    run: Option<usize>,
    /// The pool positions of `0..len`, for gathering; made once per step, shared by layers.
    gather: OnceLock<Tensor>,
}

impl Pages {
    pub fn new(table: &[u32], len: usize) -> Self {
        let run = table
            .iter()
            .enumerate()
            .all(|(i, &b)| b as usize == table[0] as usize + i)
            .then(|| table.first().map_or(0, |&b| b as usize));
        Self {
            table: table.to_vec(),
            len,
            run,
            gather: OnceLock::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block table when the positions are not one run (`None`: they are).
    pub fn table(&self) -> Option<&[u32]> {
        match self.run {
            Some(_) => None,
            None => Some(&self.table),
        }
    }

    /// Whether every position `0..len` (at least one) is in a pool of `positions`.
    pub fn within(&self, positions: usize) -> bool {
        self.len > 0
            && self.len <= self.table.len() * BLOCK
            && self
                .table
                .iter()
                .all(|&b| (b as usize + 1) * BLOCK <= positions)
    }

    /// The pool position of position `p`.
    pub fn at(&self, p: usize) -> usize {
        self.table[p / BLOCK] as usize * BLOCK + p % BLOCK
    }

    /// Positions `0..len` of `t` (1, heads, pool positions, width): a view when they are
    /// one run, else a gathered copy.
    pub fn read(&self, t: &Tensor) -> Result<Tensor> {
        if let Some(first) = self.run {
            return t.narrow(2, first * BLOCK, self.len);
        }
        let index = match self.gather.get() {
            Some(index) => index,
            None => {
                let at: Vec<u32> = (0..self.len).map(|p| self.at(p) as u32).collect();
                let index = Tensor::new(at.as_slice(), t.device())?;
                self.gather.get_or_init(|| index)
            }
        };
        t.index_select(index, 2)
    }

    /// Runs of positions `from..to` that are adjacent in the pool: (pool position, count).
    pub fn runs(&self, from: usize, to: usize) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut p = from;
        while p < to {
            let n = (BLOCK - p % BLOCK).min(to - p);
            let at = self.at(p);
            match runs.last_mut() {
                Some((start, len)) if *start + *len == at => *len += n,
                _ => runs.push((at, n)),
            }
            p += n;
        }
        runs
    }
}

/// A sequence's positions in one layer after a write: `k` and `v` are exactly positions
/// `0..len` when `pages` is `None`, else the pool's whole tensors, read through `pages`.
pub struct Held<'a> {
    pub k: Tensor,
    pub v: Tensor,
    pub pages: Option<&'a Pages>,
    /// The latent cache: the values are the first `rank` columns of the rows `k`.
    rank: Option<usize>,
}

impl Held<'_> {
    /// Whether `self` and `other` hold their positions in the same pool tensors, read
    /// through their tables, keys and values each whole rows (not a latent's columns).
    pub fn pooled_with(&self, other: &Held) -> bool {
        let paged = |h: &Held| h.pages.is_some() && h.rank.is_none();
        paged(self) && paged(other) && self.k.id() == other.k.id() && self.v.id() == other.v.id()
    }

    /// `k` and `v` of positions `0..len` (gathered when paged).
    pub fn gathered(&self) -> Result<(Tensor, Tensor)> {
        let Some(pages) = self.pages else {
            return Ok((self.k.clone(), self.v.clone()));
        };
        let k = pages.read(&self.k)?;
        let v = match self.rank {
            Some(rank) => k.narrow(3, 0, rank)?,
            None => pages.read(&self.v)?,
        };
        Ok((k, v))
    }
}

/// One layer of a sequence's cache for one step.
pub struct LayerView<'a> {
    layer: &'a LayerCache,
    pages: &'a Pages,
}

impl<'a> LayerView<'a> {
    pub(super) fn new(layer: &'a LayerCache, pages: &'a Pages) -> Self {
        Self { layer, pages }
    }

    pub fn layer(&self) -> &LayerCache {
        self.layer
    }

    /// Writes `a` and `b` (1, heads, T, width) at positions `pos..pos + T`, in the cache's
    /// dtype, and returns positions `0..pos + T` of both (for the latent cache: the rows'
    /// two parts). Gathered when paged.
    pub fn write(&self, a: &Tensor, b: &Tensor, pos: usize) -> Result<(Tensor, Tensor)> {
        let held = self.write_held(a, b, pos)?;
        match self.layer {
            LayerCache::Latent { rank, .. } => {
                let (rows, _) = held.gathered()?;
                let width = rows.dim(3)?;
                Ok((
                    rows.narrow(3, 0, *rank)?,
                    rows.narrow(3, *rank, width - rank)?,
                ))
            }
            LayerCache::Kv { .. } => held.gathered(),
        }
    }

    /// [`Self::write_held`] for each sequence of a step: `views[i]` takes tokens
    /// `start..start + len` of `a` and `b` (1, heads, N, width) after position `pos`, for
    /// `spans[i]` = (start, len, pos). Where every view is into one pool's layer (K and V, or
    /// MLA's latent rows) on the CPU and the spans are `a`'s tokens in order, one write a
    /// tensor for them all (`put.rs`) instead of one or two a sequence, each with its views
    /// and runs: SmolLM2-135M Q4_0 served to 8 streams (Zen 5), 7.4-7.7 -> 4.3 us a layer.
    pub fn write_held_all(
        views: &[LayerView<'a>],
        a: &Tensor,
        b: &Tensor,
        spans: &[(usize, usize, usize)],
    ) -> Result<Vec<Held<'a>>> {
        if let Some(helds) = Self::write_pooled(views, a, b, spans) {
            return helds;
        }
        (views.iter().zip(spans))
            .map(|(view, &(start, len, pos))| {
                view.write_held(&a.narrow(2, start, len)?, &b.narrow(2, start, len)?, pos)
            })
            .collect()
    }

    /// [`Self::write_held_all`]'s one write a tensor, or `None` where it does not apply.
    fn write_pooled(
        views: &[LayerView<'a>],
        a: &Tensor,
        b: &Tensor,
        spans: &[(usize, usize, usize)],
    ) -> Option<Result<Vec<Held<'a>>>> {
        let layer = views.first()?.layer;
        let one_pool = views.iter().all(|view| std::ptr::eq(view.layer, layer));
        let in_order = (spans.iter().scan(0, |next, &(start, len, _)| {
            let at = *next == start;
            *next = start + len;
            Some(at)
        }))
        .all(|at| at);
        if !one_pool || !in_order || views.len() != spans.len() {
            return None;
        }
        let mut positions = Vec::new();
        for (view, &(_, len, pos)) in views.iter().zip(spans) {
            for (at, n) in view.pages.runs(pos, pos + len) {
                positions.extend(at..at + n);
            }
        }
        if positions.len() != a.dim(2).ok()? {
            return None;
        }
        if let Err(e) = layer.put_in_place(a, b, &positions)? {
            return Some(Err(e));
        }
        Some(views.iter().map(LayerView::held).collect())
    }

    /// [`LayerView::write`], returning what it holds for the decode op to read in place:
    /// K and V, or for the latent cache the rows `[c_kv | k_pe]` as keys and their first
    /// `rank` columns as values.
    pub fn write_held(&self, a: &Tensor, b: &Tensor, pos: usize) -> Result<Held<'a>> {
        let t = a.dim(2)?;
        let mut done = 0;
        for (at, n) in self.pages.runs(pos, pos + t) {
            let (a, b) = (a.narrow(2, done, n)?, b.narrow(2, done, n)?);
            self.layer.put(&a, &b, at)?;
            done += n;
        }
        self.held()
    }

    /// What the view holds after a write, as [`Self::write_held`] returns it.
    fn held(&self) -> Result<Held<'a>> {
        let [k, v] = self.layer.tensors();
        let rank = match self.layer {
            LayerCache::Latent { rank, .. } => Some(*rank),
            LayerCache::Kv { .. } => None,
        };
        let v = match rank {
            Some(rank) => v.narrow(3, 0, rank)?,
            None => v.clone(),
        };
        let held = Held {
            k: k.clone(),
            v,
            pages: Some(self.pages),
            rank,
        };
        // Off the CPU the pool's tensors stay, one run or not: a batched step gathers its
        // sequences' positions from them together (`attention::spans`).
        if self.pages.table().is_some() || !k.device().is_cpu() {
            return Ok(held);
        }
        // One run: views of exactly the positions, as a flat cache would give.
        let (k, v) = held.gathered()?;
        Ok(Held {
            k,
            v,
            pages: None,
            rank,
        })
    }
}
