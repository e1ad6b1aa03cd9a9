//! A decode step's query heads in the form the key kernel of their cache reads.
//!
//! An f32 cache's keys meet the query as it is. A bf16 cache's keys are multiplied either as
//! bf16 pairs by a query rounded to bf16 (where the CPU has AVX-512 BF16: one `vdpbf16ps`
//! per 16 pairs, as transformers' bf16 model and llama.cpp's bf16 cache multiply them), or
//! widened in registers against the f32 query in [`simd::pair_layout`].

use crate::model::linear::simd::{self, Isa};
use std::ops::Range;

/// The query heads, row after row of Dk: `f32` for the f32 kernels, `bf16` (raw bits, in
/// their natural order) for the pairs kernel; one of the two is empty.
#[derive(Debug, Clone, Copy)]
pub(in crate::model::attention) struct Query<'a> {
    pub f32: &'a [f32],
    pub bf16: &'a [u16],
}

impl<'a> Query<'a> {
    /// For an f32 cache.
    pub fn f32(q: &'a [f32]) -> Self {
        Self { f32: q, bf16: &[] }
    }

    /// How many values: heads × Dk.
    pub fn len(&self) -> usize {
        self.f32.len().max(self.bf16.len())
    }

    /// Values `r` (whole heads).
    pub fn slice(self, r: Range<usize>) -> Self {
        let part = |n: usize| match n {
            0 => 0..0,
            _ => r.clone(),
        };
        Self {
            f32: &self.f32[part(self.f32.len())],
            bf16: &self.bf16[part(self.bf16.len())],
        }
    }
}

/// [`Query`]'s values, owned: the form a bf16 cache's kernel on this CPU reads.
pub(super) struct Queries {
    f32: Vec<f32>,
    bf16: Vec<u16>,
}

impl Queries {
    /// For a bf16 cache: `q` (rows of `dk`) rounded to bf16 where `isa` multiplies bf16
    /// pairs, else in [`simd::pair_layout`].
    pub fn bf16(isa: Isa, q: &[f32], dk: usize) -> Self {
        match simd::bf16_pairs(isa) {
            true => Self {
                f32: Vec::new(),
                bf16: simd::bf16_bits_of(isa, q),
            },
            false => Self {
                f32: simd::pair_layout(q, dk, |v| v),
                bf16: Vec::new(),
            },
        }
    }

    pub fn view(&self) -> Query<'_> {
        Query {
            f32: &self.f32,
            bf16: &self.bf16,
        }
    }
}
