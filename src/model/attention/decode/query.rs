//! A decode step's query heads in the form the key kernel of their cache reads.
//!
//! An f32 cache's keys meet the query as it is. A bf16 cache's keys are multiplied either as
//! bf16 pairs by a query rounded to bf16 (where the CPU has AVX-512 BF16: one `vdpbf16ps`
//! per 16 pairs, as llama.cpp's bf16 cache multiplies them; `vcvtneps2bf16` flushes a
//! subnormal query value to 0, which the prompt's rounding by candle keeps: the two differ
//! there alone), or widened in registers against the f32 query in [`simd::pair_layout`].

use crate::model::linear::simd::{self, Isa};
use std::ops::Range;

/// The query heads, row after row of Dk, in one of the three forms.
#[derive(Debug, Clone, Copy)]
pub(in crate::model::attention) enum Query<'a> {
    /// As they are, for an f32 cache.
    F32(&'a [f32]),
    /// In [`simd::pair_layout`], for a bf16 cache's widening kernel.
    Paired(&'a [f32]),
    /// Rounded to bf16 (raw bits, natural order), for a bf16 cache's pairs kernel.
    Bf16(&'a [u16]),
}

impl Query<'_> {
    /// How many values: heads × Dk.
    pub fn len(&self) -> usize {
        match self {
            Query::F32(q) | Query::Paired(q) => q.len(),
            Query::Bf16(q) => q.len(),
        }
    }

    /// Values `r` (whole heads).
    pub fn slice(self, r: Range<usize>) -> Self {
        match self {
            Query::F32(q) => Query::F32(&q[r]),
            Query::Paired(q) => Query::Paired(&q[r]),
            Query::Bf16(q) => Query::Bf16(&q[r]),
        }
    }
}

/// A bf16 cache's [`Query`], owned: the form its kernel on this CPU reads.
pub(super) enum Queries {
    Paired(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Queries {
    /// `q` (rows of `dk`) rounded to bf16 where `isa` multiplies bf16 pairs, else in
    /// [`simd::pair_layout`].
    pub fn bf16(isa: Isa, q: &[f32], dk: usize) -> Self {
        match simd::bf16_pairs(isa) {
            true => Queries::Bf16(simd::bf16_bits_of(isa, q)),
            false => Queries::Paired(simd::pair_layout(q, dk, |v| v)),
        }
    }

    pub fn view(&self) -> Query<'_> {
        match self {
            Queries::Paired(q) => Query::Paired(q),
            Queries::Bf16(q) => Query::Bf16(q),
        }
    }
}
