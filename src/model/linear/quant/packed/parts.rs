//! One 32-weight block of a packable format as its parts (`d`, `m`, quants, fifth bits),
//! the form [`super`]'s layouts are read into and written from, and Q5's fifth bits in the
//! packed kernel's order.

use super::super::{Format, BLOCK};
use half::f16;

/// One 32-weight block of a packable format, whichever layout holds it.
#[derive(Clone, Copy)]
pub(in crate::model::linear::quant) struct Parts {
    pub d: f16,
    /// Q4_1's and Q5_1's `m` (w = d·q + m); 0 otherwise.
    pub m: f16,
    /// The quant bytes as ggml stores them (the first 16 for the 4- and 5-bit formats).
    pub qs: [u8; BLOCK],
    /// Q5_0's and Q5_1's fifth bits, bit j for weight j; 0 otherwise.
    pub qh: u32,
}

impl Parts {
    /// The stored integer of weight `j`: Q8_0's signed byte, a nibble (0..=15), a nibble and
    /// its fifth bit (0..=31).
    pub(in crate::model::linear::quant) fn quant(&self, format: Format, j: usize) -> i32 {
        let nibble = |j: usize| match j < 16 {
            true => self.qs[j] & 0x0F,
            false => self.qs[j - 16] >> 4,
        } as i32;
        match format {
            Format::Q8_0 => self.qs[j] as i8 as i32,
            Format::Q5_0 | Format::Q5_1 => nibble(j) | ((self.qh >> j) as i32 & 1) << 4,
            _ => nibble(j),
        }
    }

    /// What the block adds to each weight, `w = d·q + offset`: Q4_0's −8·d, Q5_0's −16·d,
    /// Q4_1's and Q5_1's m, Q8_0's 0.
    pub(in crate::model::linear::quant) fn offset(&self, format: Format) -> f32 {
        match format {
            Format::Q4_0 => -8.0 * self.d.to_f32(),
            Format::Q5_0 => -16.0 * self.d.to_f32(),
            Format::Q4_1 | Format::Q5_1 => self.m.to_f32(),
            _ => 0.0,
        }
    }
}

/// Q5's fifth bits rearranged for the kernel: bit `8j + v` holds weight `4v + j`'s and bit
/// `8j + 4 + v` weight `16 + 4v + j`'s (v, j < 4), so that one shift and one mask put the
/// bits of 4 consecutive weights at bit 4 of 4 bytes.
pub(super) fn spread(qh: u32) -> u32 {
    let mut out = 0;
    for v in 0..4 {
        for j in 0..4 {
            out |= ((qh >> (4 * v + j)) & 1) << (8 * j + v);
            out |= ((qh >> (16 + 4 * v + j)) & 1) << (8 * j + 4 + v);
        }
    }
    out
}

/// [`spread`] undone.
pub(super) fn unspread(h: u32) -> u32 {
    let mut qh = 0;
    for v in 0..4 {
        for j in 0..4 {
            qh |= ((h >> (8 * j + v)) & 1) << (4 * v + j);
            qh |= ((h >> (8 * j + 4 + v)) & 1) << (16 + 4 * v + j);
        }
    }
    qh
}
