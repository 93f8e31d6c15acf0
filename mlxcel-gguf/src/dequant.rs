//! Dequantization of GGML blocks to `f32`, following the block definitions of
//! ggml (`ggml-common.h`) and the reference dequantizers of `ggml-quants.c`.
//! Arithmetic is done in `f32` in the same order as the C reference.

use half::{bf16, f16};

use crate::ggml_type::GgmlType;

/// Whether [`dequantize`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
    )
}

/// Dequantizes `out.len()` elements stored in `src`. Returns `None` when the type is
/// not supported or `src` does not hold exactly `out.len()` elements.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Option<()> {
    let (block, size) = (ty.block_size(), ty.type_size());
    if !out.len().is_multiple_of(block) || src.len() != out.len() / block * size {
        return None;
    }
    let kernel: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = f16_at(b, 0),
        GgmlType::BF16 => |b, y| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2K => q2_k,
        GgmlType::Q3K => q3_k,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        _ => return None,
    };
    for (b, y) in src.chunks_exact(size).zip(out.chunks_exact_mut(block)) {
        kernel(b, y);
    }
    Some(())
}

pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// `{ f16 d; u8 qs[16] }`: `y[j] = d * (nibble - 8)`, low nibbles first.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// `{ f16 d; f16 m; u8 qs[16] }`: `y = d * nibble + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = (q & 0x0f) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// `{ f16 d; u8 qh[4]; u8 qs[16] }`: 5-bit values, high bits in `qh`, minus 16.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((q as u32 & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((q as u32 >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `{ f16 d; f16 m; u8 qh[4]; u8 qs[16] }`: 5-bit values, `y = d * q + m`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((q as u32 & 0x0f) | h0) as f32 * d + m;
        y[j + 16] = ((q as u32 >> 4) | h1) as f32 * d + m;
    }
}

/// `{ f16 d; i8 qs[32] }`: `y = d * q`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = q as i8 as f32 * d;
    }
}

/// `{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`: 16 sub-blocks of 16 2-bit values,
/// each with a 4-bit scale and a 4-bit min.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    let mut out = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                for &ql in &q[part * 16..part * 16 + 16] {
                    y[out] = dl * ((ql >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// `{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`: 3-bit values (2 low bits in `qs`,
/// high bit in `hmask`, minus 4 when it is clear), 16 6-bit signed scales.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let word = |i: usize| {
        u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ])
    };
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let scales: Vec<i8> = aux
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .map(|v| v as i8)
        .collect();

    let mut is = 0;
    let mut out = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in part * 16..part * 16 + 16 {
                    let low = ((q[l] >> shift) & 3) as i32;
                    let high = if hmask[l] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` in the 12 packed bytes of Q4_K / Q5_K.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`: 8 sub-blocks of 32 4-bit values.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for (l, &ql) in q.iter().enumerate() {
            y[l] = d1 * (ql & 0x0f) as f32 - m1;
            y[l + 32] = d2 * (ql >> 4) as f32 - m2;
        }
    }
}

/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`: Q4_K plus a fifth bit in `qh`.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        for (l, &ql) in q.iter().enumerate() {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql & 0x0f) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql >> 4) + h2) as f32 - m2;
        }
    }
}

/// `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`: 6-bit values minus 32, 16 8-bit scales.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let y = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * sc[is + k] as i8 as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}
