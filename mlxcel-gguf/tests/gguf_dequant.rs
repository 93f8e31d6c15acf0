//! GGML dequantization against gguf-py, affine mapping of Q4_0/Q4_1/Q8_0, and MLX's
//! affine quantization against mx.quantize (goldens from tests/reference/gguf_dequant_reference.py).

mod gguf_common;

use gguf_common::*;
use half::f16;
use mlxcel_gguf::affine::AffineMatrix;
use mlxcel_gguf::dequant::dequantize;
use mlxcel_gguf::GgmlType;
use serde_json::Value as Json;

fn golden(name: &str) -> Json {
    let path = format!("{}/tests/data/gguf/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn ggml_type(name: &str) -> GgmlType {
    (0..64)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("type {name}"))
}

#[test]
fn dequantization_matches_gguf_py_bit_for_bit() {
    let g = golden("dequant_blocks.json");
    let cases = g["cases"].as_array().unwrap();
    let mut types = std::collections::BTreeSet::new();
    for case in cases {
        let ty = ggml_type(case["type"].as_str().unwrap());
        let raw = hex(case["hex"].as_str().unwrap());
        let expected: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut out = vec![0f32; expected.len()];
        dequantize(ty, &raw, &mut out).unwrap_or_else(|| panic!("{ty} not dequantized"));
        for (i, (a, e)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(
                a.to_bits(),
                e.to_bits(),
                "{ty} ({}) element {i}: {a} vs {e}",
                case["source"]
            );
        }
        types.insert(ty.name());
    }
    for t in [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    ] {
        assert!(types.contains(t), "no golden block of {t}");
    }
    // Real blocks from Gemma 3 (Q4_K, Q5_0, Q6_K, Q8_0) and SmolLM2 (Q4_1, Q8_0) are included.
    assert!(cases.iter().filter(|c| c["source"] != "random").count() >= 12);
}

#[test]
fn dequantize_rejects_wrong_sizes_and_unknown_types() {
    let mut out = vec![0f32; 32];
    assert!(dequantize(GgmlType::Q4_0, &[0u8; 17], &mut out).is_none());
    assert!(dequantize(GgmlType::Iq2Xxs, &[0u8; 66], &mut vec![0f32; 256]).is_none());
}

#[test]
fn q4_and_q8_blocks_map_exactly_onto_affine() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let (rows, cols) = (3, 96);
    let n_blocks = rows * cols / 32;
    for (ty, fields, size) in [
        (GgmlType::Q4_0, &[0][..], 18),
        (GgmlType::Q4_1, &[0, 2][..], 20),
        (GgmlType::Q8_0, &[0][..], 34),
    ] {
        let data = random_blocks(&mut rng, n_blocks, size, fields);
        let (m, reference, bits) = match ty {
            GgmlType::Q4_0 => (
                AffineMatrix::from_q4_0(&data, rows, cols),
                decode_q4_0(&data),
                4,
            ),
            GgmlType::Q4_1 => (
                AffineMatrix::from_q4_1(&data, rows, cols),
                decode_q4_1(&data),
                4,
            ),
            _ => (
                AffineMatrix::from_q8_0(&data, rows, cols),
                decode_q8_0(&data),
                8,
            ),
        };
        assert_eq!(
            (m.bits, m.group_size, m.weight.len(), m.scales.len()),
            (bits, 32, rows * cols * bits as usize / 32, n_blocks)
        );
        let ours = affine_dequantize(&m.weight, &m.scales, &m.biases, rows, cols, bits as usize);
        for (i, (a, e)) in ours.iter().zip(&reference).enumerate() {
            assert_eq!(a.to_bits(), e.to_bits(), "{ty} element {i}: {a} vs {e}");
        }
        assert_eq!(m.dequantize(), ours);
    }
}

#[test]
fn q4_0_layout_is_mlx_packing() {
    // One block: d = 1, element j holds j % 16 (low nibbles 0..15, high nibbles 0..15).
    let mut block = f16::from_f32(1.0).to_le_bytes().to_vec();
    block.extend((0..16u8).map(|j| j | (j << 4)));
    let m = AffineMatrix::from_q4_0(&block, 1, 32);
    // Word w holds elements 8w..8w+8, element k of the word in bits 4k..4k+4.
    assert_eq!(
        m.weight,
        vec![0x7654_3210, 0xfedc_ba98, 0x7654_3210, 0xfedc_ba98]
    );
    assert_eq!((m.scales[0].to_f32(), m.biases[0].to_f32()), (1.0, -8.0));
}

#[test]
fn affine_quantization_matches_mx_quantize_bit_for_bit() {
    let g = golden("mlx_quantize.json");
    let shape: Vec<usize> = g["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let input: Vec<f32> = g["input_f16_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| f16::from_bits(v.as_u64().unwrap() as u16).to_f32())
        .collect();
    let ints = |v: &Json| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    for case in g["cases"].as_array().unwrap() {
        let (bits, group) = (
            case["bits"].as_u64().unwrap() as u32,
            case["group_size"].as_u64().unwrap() as usize,
        );
        let m = AffineMatrix::quantize(&input, shape[0], shape[1], bits, group);
        let weight: Vec<u64> = m.weight.iter().map(|&w| w as u64).collect();
        let scales: Vec<u64> = m.scales.iter().map(|s| s.to_bits() as u64).collect();
        let biases: Vec<u64> = m.biases.iter().map(|s| s.to_bits() as u64).collect();
        assert_eq!(
            scales,
            ints(&case["scales_f16_bits"]),
            "scales, {bits} bits, group {group}"
        );
        assert_eq!(
            biases,
            ints(&case["biases_f16_bits"]),
            "biases, {bits} bits, group {group}"
        );
        assert_eq!(
            weight,
            ints(&case["weight"]),
            "weight, {bits} bits, group {group}"
        );
        // Rows append, and permuting rows keeps (weight, scales, biases) together.
        let reversed = m.permute_rows(|r| shape[0] - 1 - r);
        let back = reversed.permute_rows(|r| shape[0] - 1 - r);
        assert_eq!(back, m);
        let row0 = AffineMatrix::quantize(&input[..shape[1]], 1, shape[1], bits, group);
        assert_eq!(row0.dequantize(), m.dequantize()[..shape[1]].to_vec());
    }
}
