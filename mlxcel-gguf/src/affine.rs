//! MLX's affine quantization layout (as mlx-lm saves it).
//!
//! A quantized `[rows, cols]` matrix with `bits` and `group_size` is stored as
//! `weight: u32 [rows, cols * bits / 32]`, `scales` and `biases: f16 [rows, cols / group_size]`;
//! element `w[r][c] = scales[r][c / g] * q[r][c] + biases[r][c / g]`. The values of a row
//! form one little-endian bit stream: element `j` starts at bit `j * bits`.

use half::f16;

use crate::dequant::f16_at;

/// The bit widths MLX's affine quantization supports.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];

/// A matrix in MLX affine layout.
#[derive(Debug, Clone, PartialEq)]
pub struct AffineMatrix {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group_size: usize,
    pub weight: Vec<u32>,
    pub scales: Vec<f16>,
    pub biases: Vec<f16>,
}

impl AffineMatrix {
    fn empty(rows: usize, cols: usize, bits: u32, group_size: usize) -> Self {
        AffineMatrix {
            rows,
            cols,
            bits,
            group_size,
            weight: vec![0; rows * cols * bits as usize / 32],
            scales: Vec::with_capacity(rows * cols / group_size),
            biases: Vec::with_capacity(rows * cols / group_size),
        }
    }

    /// `u32` words per row of `weight`.
    pub fn words_per_row(&self) -> usize {
        self.cols * self.bits as usize / 32
    }

    fn set(&mut self, row: usize, col: usize, q: u32) {
        let bit = col * self.bits as usize;
        let base = row * self.words_per_row();
        let (word, shift) = (base + bit / 32, bit % 32);
        self.weight[word] |= q << shift;
        if shift + self.bits as usize > 32 {
            self.weight[word + 1] |= q >> (32 - shift);
        }
    }

    /// The quantized value of element `(row, col)`.
    pub fn get(&self, row: usize, col: usize) -> u32 {
        let bit = col * self.bits as usize;
        let base = row * self.words_per_row();
        let (word, shift) = (base + bit / 32, bit % 32);
        let mut v = (self.weight[word] as u64) >> shift;
        if shift + self.bits as usize > 32 {
            v |= (self.weight[word + 1] as u64) << (32 - shift);
        }
        (v & ((1 << self.bits) - 1)) as u32
    }

    /// `scale * q + bias` for every element, in `f32`, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let groups = self.cols / self.group_size;
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| {
                let g = r * groups + c / self.group_size;
                self.scales[g].to_f32() * self.get(r, c) as f32 + self.biases[g].to_f32()
            })
            .collect()
    }

    /// Appends the rows of `other` (same columns, bits and group size).
    pub fn append_rows(&mut self, other: AffineMatrix) {
        assert_eq!(
            (self.cols, self.bits, self.group_size),
            (other.cols, other.bits, other.group_size)
        );
        self.rows += other.rows;
        self.weight.extend(other.weight);
        self.scales.extend(other.scales);
        self.biases.extend(other.biases);
    }

    /// Reorders rows: row `r` of the result is row `source_row(r)` of `self`.
    pub fn permute_rows(&self, source_row: impl Fn(usize) -> usize) -> Self {
        let (wpr, gpr) = (self.words_per_row(), self.cols / self.group_size);
        let mut out = AffineMatrix {
            weight: Vec::with_capacity(self.weight.len()),
            scales: Vec::with_capacity(self.scales.len()),
            biases: Vec::with_capacity(self.biases.len()),
            ..*self
        };
        for r in 0..self.rows {
            let s = source_row(r);
            out.weight
                .extend_from_slice(&self.weight[s * wpr..(s + 1) * wpr]);
            out.scales
                .extend_from_slice(&self.scales[s * gpr..(s + 1) * gpr]);
            out.biases
                .extend_from_slice(&self.biases[s * gpr..(s + 1) * gpr]);
        }
        out
    }

    /// Q4_0 blocks (`d * (q - 8)`) as 4-bit, group 32: `scale = d`, `bias = -8 d` (exact).
    pub fn from_q4_0(data: &[u8], rows: usize, cols: usize) -> Self {
        Self::from_q4_blocks(data, rows, cols, 18, |b| {
            let d = f16_at(b, 0);
            (f16::from_f32(d), f16::from_f32(-8.0 * d))
        })
    }

    /// Q4_1 blocks (`d * q + m`) as 4-bit, group 32: `scale = d`, `bias = m`.
    pub fn from_q4_1(data: &[u8], rows: usize, cols: usize) -> Self {
        Self::from_q4_blocks(data, rows, cols, 20, |b| {
            (
                f16::from_bits(u16::from_le_bytes([b[0], b[1]])),
                f16::from_bits(u16::from_le_bytes([b[2], b[3]])),
            )
        })
    }

    /// 32-element blocks whose last 16 bytes hold element `j` in the low nibble of byte `j`
    /// and element `j + 16` in its high nibble.
    fn from_q4_blocks(
        data: &[u8],
        rows: usize,
        cols: usize,
        block_bytes: usize,
        scale_bias: impl Fn(&[u8]) -> (f16, f16),
    ) -> Self {
        let mut m = Self::empty(rows, cols, 4, 32);
        for (i, b) in data.chunks_exact(block_bytes).enumerate() {
            let (scale, bias) = scale_bias(b);
            m.scales.push(scale);
            m.biases.push(bias);
            let qs = &b[block_bytes - 16..];
            // Block i covers words 4i..4i+4 (32 elements x 4 bits), nibble k of word w is
            // element 8w + k of the block.
            for w in 0..4 {
                let mut word = 0u32;
                for k in 0..8 {
                    let j = 8 * w + k;
                    let q = if j < 16 {
                        qs[j] & 0x0f
                    } else {
                        qs[j - 16] >> 4
                    };
                    word |= (q as u32) << (4 * k);
                }
                m.weight[4 * i + w] = word;
            }
        }
        m
    }

    /// Q8_0 blocks (`d * q`, `q` signed) as 8-bit, group 32: `q + 128`, `bias = -128 d` (exact).
    pub fn from_q8_0(data: &[u8], rows: usize, cols: usize) -> Self {
        let mut m = Self::empty(rows, cols, 8, 32);
        for (i, b) in data.chunks_exact(34).enumerate() {
            let d = f16_at(b, 0);
            m.scales.push(f16::from_f32(d));
            m.biases.push(f16::from_f32(-128.0 * d));
            for (w, q) in b[2..34].chunks_exact(4).enumerate() {
                let unsigned = q.iter().map(|&v| (v ^ 0x80) as u32); // i8 + 128
                m.weight[8 * i + w] = unsigned
                    .enumerate()
                    .fold(0, |acc, (k, v)| acc | v << (8 * k));
            }
        }
        m
    }

    /// MLX's affine quantization (`mlx::core::quantize`, mode "affine") of a row-major
    /// `[rows, cols]` matrix. The input is rounded to `f16` first, as MLX would quantize an
    /// `f16` checkpoint; scales and biases are `f16`.
    /// `cols` must be a multiple of `group_size` and `bits` one of [`SUPPORTED_BITS`].
    pub fn quantize(
        values: &[f32],
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
    ) -> Self {
        assert!(
            SUPPORTED_BITS.contains(&bits)
                && cols.is_multiple_of(group_size)
                && values.len() == rows * cols
        );
        let mut m = Self::empty(rows, cols, bits, group_size);
        let n_bins = ((1u32 << bits) - 1) as f32;
        let eps = 1e-7f32;
        let mut group = vec![0f32; group_size];
        for (g, chunk) in values.chunks_exact(group_size).enumerate() {
            for (dst, &v) in group.iter_mut().zip(chunk) {
                *dst = f16::from_f32(v).to_f32();
            }
            let w_max = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let w_min = group.iter().copied().fold(f32::INFINITY, f32::min);
            let mask = w_min.abs() > w_max.abs();
            let mut scale = ((w_max - w_min) / n_bins).max(eps);
            if !mask {
                scale = -scale;
            }
            let edge = if mask { w_min } else { w_max };
            let q0 = (edge / scale).round_ties_even();
            let mut bias = 0f32;
            if q0 != 0.0 {
                scale = edge / q0;
                bias = edge;
            }
            let (row, col0) = (g * group_size / cols, g * group_size % cols);
            for (k, &w) in group.iter().enumerate() {
                let q = ((w - bias) / scale).round_ties_even().clamp(0.0, n_bins);
                m.set(row, col0 + k, q as u32);
            }
            m.scales.push(f16::from_f32(scale));
            m.biases.push(f16::from_f32(bias));
        }
        m
    }
}
