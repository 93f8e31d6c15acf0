//! Synthetic GGUF files: corrupt inputs give clear errors; a tiny llama converts with exact
//! Q4_0/Q4_1/Q8_0 mapping, undone Q/K permutation, dequantized K-quants and re-quantization.

mod gguf_common;

use gguf_common::*;
use half::f16;
use mlxcel_gguf::dequant::dequantize;
use mlxcel_gguf::{convert_gguf, ConvertOptions, GgmlType, GgufFile, Value};
use mlxcel_gguf::Error;

fn gguf_data<'a>(g: &'a GgufBuilder, name: &str) -> &'a [u8] {
    &g.tensors.iter().find(|t| t.0 == name).unwrap().3
}

/// llama.cpp's permutation, forwards: HF row (head, pair, i) is GGUF row (head, i, pair).
fn gguf_row_of_hf_row(r: usize, rows: usize, heads: usize) -> usize {
    let per_head = rows / heads;
    let (head, pair, i) = (
        r / per_head,
        (r % per_head) / (per_head / 2),
        r % (per_head / 2),
    );
    head * per_head + i * 2 + pair
}

#[test]
fn tiny_llama_converts_exactly() {
    let tmp = TempDir::new("tiny");
    let g = tiny_llama(&mut Rng(42));
    let (bytes, _) = g.build();
    let gguf = write(&tmp.0, "tiny.gguf", &bytes);
    let out = tmp.0.join("out");
    let report = convert_gguf(&gguf, &out, &ConvertOptions::default()).unwrap();
    assert_eq!(
        (report.architecture.as_str(), report.model_type.as_str()),
        ("llama", "llama")
    );
    assert_eq!(report.quantized_layers, 3);
    assert_eq!(report.dequantized_tensors, 3);
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    assert_eq!(
        std::fs::read_dir(&tmp.0).unwrap().count(),
        2,
        "no staging directory left behind"
    );

    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["tie_word_embeddings"], false);
    assert_eq!(config["head_dim"], HEAD_DIM);
    assert_eq!(config["num_key_value_heads"], KV_HEADS);
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(config["quantization"]["model.embed_tokens"]["bits"], 8);

    let t = read_safetensors(&out.join("model.safetensors"));
    let affine = |module: &str, rows: usize, cols: usize, bits: usize| {
        let w = as_u32(&t[&format!("{module}.weight")].2);
        affine_dequantize(
            &w,
            &as_f16(&t[&format!("{module}.scales")].2),
            &as_f16(&t[&format!("{module}.biases")].2),
            rows,
            cols,
            bits,
        )
    };
    // Q4_0 q_proj, un-permuted over heads; bit-exact against an independent block decoder.
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    for (module, gguf_name, rows, heads, reference, bits) in [
        (
            "model.layers.0.self_attn.q_proj",
            "blk.0.attn_q.weight",
            q,
            Some(HEADS),
            decode_q4_0(gguf_data(&g, "blk.0.attn_q.weight")),
            4,
        ),
        (
            "model.layers.0.self_attn.k_proj",
            "blk.0.attn_k.weight",
            kv,
            Some(KV_HEADS),
            decode_q4_1(gguf_data(&g, "blk.0.attn_k.weight")),
            4,
        ),
        (
            "model.embed_tokens",
            "token_embd.weight",
            vocab().len(),
            None,
            decode_q8_0(gguf_data(&g, "token_embd.weight")),
            8,
        ),
    ] {
        let ours = affine(module, rows, HIDDEN, bits);
        for r in 0..rows {
            let src = heads.map_or(r, |h| gguf_row_of_hf_row(r, rows, h));
            let expected = &reference[src * HIDDEN..(src + 1) * HIDDEN];
            let got = &ours[r * HIDDEN..(r + 1) * HIDDEN];
            assert!(
                got.iter()
                    .zip(expected)
                    .all(|(a, e)| a.to_bits() == e.to_bits()),
                "{module} ({gguf_name}) row {r}"
            );
        }
    }
    // Float tensors are copied as they are (only q and k are permuted).
    assert_eq!(
        t["model.layers.0.self_attn.v_proj.weight"].2,
        gguf_data(&g, "blk.0.attn_v.weight")
    );
    assert_eq!(t["model.layers.0.self_attn.v_proj.weight"].0, "F16");
    assert_eq!(
        t["model.layers.0.input_layernorm.weight"].2,
        gguf_data(&g, "blk.0.attn_norm.weight")
    );
    assert_eq!(
        t["model.layers.0.post_attention_layernorm.weight"].2,
        gguf_data(&g, "blk.0.ffn_norm.weight")
    );
    assert_eq!(t["lm_head.weight"].1, vec![vocab().len(), HIDDEN]);
    assert_eq!(
        as_f32(&t["lm_head.weight"].2)[HIDDEN + 3],
        (HIDDEN + 3) as f32
    );
    // K-quants and Q5_0 are dequantized to float16.
    for (module, gguf_name, ty) in [
        (
            "model.layers.0.self_attn.o_proj",
            "blk.0.attn_output.weight",
            GgmlType::Q5_0,
        ),
        (
            "model.layers.0.mlp.gate_proj",
            "blk.0.ffn_gate.weight",
            GgmlType::Q4K,
        ),
        (
            "model.layers.0.mlp.up_proj",
            "blk.0.ffn_up.weight",
            GgmlType::Q6K,
        ),
    ] {
        let (dtype, shape, data) = &t[&format!("{module}.weight")];
        let mut expected = vec![0f32; shape[0] * shape[1]];
        dequantize(ty, gguf_data(&g, gguf_name), &mut expected).unwrap();
        assert_eq!(dtype, "F16");
        assert!(
            as_f16(data)
                .iter()
                .zip(&expected)
                .all(|(a, &e)| *a == f16::from_f32(e)),
            "{module}"
        );
        assert!(!t.contains_key(&format!("{module}.scales")));
    }

    // The tokenizer: control tokens whole, digits one by one, the merge applied.
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let n = vocab().len() as u32;
    // Byte-level ids equal byte values here: " " is "Ġ" (32), "1" is 49.
    assert_eq!(
        tok.encode("<|bos|>ab 12", false).unwrap().get_ids(),
        [n - 2, n - 3, 32, 49, 50]
    );
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(
        (tc["bos_token"].as_str(), tc["eos_token"].as_str()),
        (Some("<|bos|>"), Some("<|eos|>"))
    );
}

#[test]
fn requantization_follows_options() {
    let tmp = TempDir::new("requant");
    let g = tiny_llama(&mut Rng(7));
    let gguf = write(&tmp.0, "tiny.gguf", &g.build().0);
    let plain = tmp.0.join("plain");
    convert_gguf(&gguf, &plain, &ConvertOptions::default()).unwrap();
    let plain_t = read_safetensors(&plain.join("model.safetensors"));

    for (bits, group) in [(4u32, 32u32), (8, 64), (3, 128), (6, 64)] {
        let out = tmp.0.join(format!("q{bits}g{group}"));
        let opts = ConvertOptions {
            q_bits: Some(bits),
            q_group_size: Some(group),
        };
        let report = convert_gguf(&gguf, &out, &opts).unwrap();
        assert_eq!(
            report.quantized_layers, 9,
            "7 linear layers, the embedding and lm_head"
        );
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(
            (
                config["quantization"]["bits"].clone(),
                config["quantization"]["group_size"].clone()
            ),
            (bits.into(), group.into())
        );
        let t = read_safetensors(&out.join("model.safetensors"));
        // Linear layers: close to the source. MLX's algorithm moves the grid so one end of the
        // range is exact, which can clip the other end by up to about one step.
        let (dtype, shape, data) = &t["model.layers.0.mlp.down_proj.weight"];
        assert_eq!(
            (dtype.as_str(), shape.clone()),
            ("U32", vec![HIDDEN, FFN * bits as usize / 32])
        );
        let scales = as_f16(&t["model.layers.0.mlp.down_proj.scales"].2);
        let ours = affine_dequantize(
            &as_u32(data),
            &scales,
            &as_f16(&t["model.layers.0.mlp.down_proj.biases"].2),
            HIDDEN,
            FFN,
            bits as usize,
        );
        let source = as_f16(gguf_data(&g, "blk.0.ffn_down.weight"));
        let mean_err = ours
            .iter()
            .zip(&source)
            .map(|(a, e)| (a - e.to_f32()).abs())
            .sum::<f32>()
            / ours.len() as f32;
        let mean_step = scales.iter().map(|s| s.to_f32().abs()).sum::<f32>() / scales.len() as f32;
        assert!(
            mean_err < 0.3 * mean_step,
            "mean error {mean_err}, mean step {mean_step}"
        );
        for (i, (a, e)) in ours.iter().zip(&source).enumerate() {
            let step = scales[i / group as usize].to_f32().abs();
            assert!(
                (a - e.to_f32()).abs() <= step * 1.5 + 1e-3,
                "element {i}: {a} vs {e} (step {step})"
            );
        }
        if (bits, group) == (4, 32) {
            // Q4_0 / Q4_1 stay bit-exact when they already are 4-bit group-32.
            for name in [
                "model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.k_proj",
            ] {
                for part in ["weight", "scales", "biases"] {
                    let key = format!("{name}.{part}");
                    assert_eq!(t[&key].2, plain_t[&key].2, "{key}");
                }
            }
            assert!(
                config["quantization"].get("model.embed_tokens").is_none(),
                "same as the default"
            );
        }
        // Norms stay as they are.
        assert_eq!(
            t["model.norm.weight"].2,
            gguf_data(&g, "output_norm.weight")
        );
    }

    let bad = |q_bits, q_group_size| ConvertOptions {
        q_bits,
        q_group_size,
    };
    for opts in [
        bad(Some(7), None),
        bad(Some(4), Some(48)),
        bad(None, Some(32)),
    ] {
        let err = convert_gguf(&gguf, &tmp.0.join("bad"), &opts).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        assert!(!tmp.0.join("bad").exists());
    }
}

#[test]
fn corrupt_files_give_clear_errors() {
    let tmp = TempDir::new("corrupt");
    let g = tiny_llama(&mut Rng(1));
    let (bytes, data_start) = g.build();

    let mut bad_magic = bytes.clone();
    bad_magic[..4].copy_from_slice(b"GGML");
    let path = write(&tmp.0, "magic.gguf", &bad_magic);
    let err = GgufFile::open(&path).err().unwrap();
    assert!(
        matches!(err, Error::InvalidFile { .. }) && err.to_string().contains("not a GGUF file"),
        "{err}"
    );
    assert!(err.to_string().contains("magic.gguf"), "{err}");

    // Truncated anywhere: in the header, in the metadata, in the tensor infos, in the data.
    let cuts: Vec<usize> = (0..data_start)
        .step_by(7)
        .chain([data_start + 1, bytes.len() - 1])
        .collect();
    for cut in cuts {
        let path = write(&tmp.0, "cut.gguf", &bytes[..cut]);
        let err = GgufFile::open(&path)
            .err()
            .unwrap_or_else(|| panic!("truncated at {cut} opened"));
        let msg = err.to_string();
        assert!(
            msg.contains("cut.gguf") && (msg.contains("truncated") || msg.contains("past the end")),
            "cut {cut}: {msg}"
        );
    }

    // Tensor data past the end of the file.
    let mut far = GgufBuilder::default();
    far.meta("general.architecture", s("llama")).tensor(
        "token_embd.weight",
        &[32, 4],
        0,
        vec![0; 32 * 4 * 4],
    );
    let (mut far_bytes, _) = far.build();
    far_bytes.truncate(far_bytes.len() - 16);
    let err = GgufFile::open(&write(&tmp.0, "far.gguf", &far_bytes))
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("past the end") && err.to_string().contains("token_embd.weight"),
        "{err}"
    );

    // Absurd counts do not allocate: an array claiming u64::MAX items.
    let mut huge = b"GGUF".to_vec();
    huge.extend(3u32.to_le_bytes());
    huge.extend(0u64.to_le_bytes());
    huge.extend(1u64.to_le_bytes());
    huge.extend(3u64.to_le_bytes());
    huge.extend(b"key");
    huge.extend(9u32.to_le_bytes());
    huge.extend(4u32.to_le_bytes());
    huge.extend(u64::MAX.to_le_bytes());
    let err = GgufFile::open(&write(&tmp.0, "huge.gguf", &huge))
        .err()
        .unwrap();
    assert!(err.to_string().contains("truncated"), "{err}");

    // Version 1 and unknown architectures are unsupported.
    let mut v1 = bytes.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    let err = GgufFile::open(&write(&tmp.0, "v1.gguf", &v1))
        .err()
        .unwrap();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    let mut other = tiny_llama(&mut Rng(1));
    other.metadata[0].1 = s("mamba");
    let path = write(&tmp.0, "mamba.gguf", &other.build().0);
    let err = convert_gguf(&path, &tmp.0.join("mamba"), &ConvertOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::Unsupported { .. }) && err.to_string().contains("mamba"),
        "{err}"
    );
    assert!(!tmp.0.join("mamba").exists());
}

#[test]
fn reads_every_metadata_type_in_v2_files() {
    let tmp = TempDir::new("meta");
    let values = vec![
        Value::U8(200),
        Value::I8(-5),
        Value::U16(60000),
        Value::I16(-30000),
        Value::U32(4_000_000_000),
        Value::I32(-2_000_000_000),
        Value::F32(1.5),
        Value::Bool(true),
        s("héllo"),
        Value::Array(vec![
            Value::Array(vec![Value::I64(-1), Value::I64(2)]),
            Value::Array(vec![]),
        ]),
        Value::U64(u64::MAX),
        Value::I64(i64::MIN),
        Value::F64(-2.25),
        Value::Array(vec![s("a"), s("")]),
    ];
    let mut g = GgufBuilder {
        version: 2,
        alignment: 64,
        ..Default::default()
    };
    g.meta("general.alignment", Value::U32(64));
    for (i, v) in values.iter().enumerate() {
        g.meta(&format!("k{i}"), v.clone());
    }
    g.tensor("a", &[32], 0, vec![1; 128])
        .tensor("b", &[64, 2], 1, vec![2; 256]);
    let path = write(&tmp.0, "meta.gguf", &g.build().0);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version, 2);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(f.get(&format!("k{i}")), Some(v), "k{i}");
    }
    assert_eq!(f.data_offset % 64, 0);
    let b = f.tensor("b").unwrap();
    assert_eq!(
        (b.shape(), b.ggml_type, b.offset),
        (vec![2, 64], GgmlType::F16, 128)
    );
    assert!(f.tensor_data(b).iter().all(|&x| x == 2));
}

#[test]
fn qwen_names_norms_biases_and_no_permutation() {
    let tmp = TempDir::new("arches");
    for arch in ["qwen2", "qwen3"] {
        let g = tiny_model(&mut Rng(3), arch);
        let gguf = write(&tmp.0, &format!("{arch}.gguf"), &g.build().0);
        let out = tmp.0.join(arch);
        convert_gguf(&gguf, &out, &ConvertOptions::default()).unwrap();
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["model_type"], arch);
        let t = read_safetensors(&out.join("model.safetensors"));
        // No llama.cpp permutation outside llama: q_proj rows are the GGUF rows.
        let q = HEADS * HEAD_DIM;
        let w = as_u32(&t["model.layers.0.self_attn.q_proj.weight"].2);
        let ours = affine_dequantize(
            &w,
            &as_f16(&t["model.layers.0.self_attn.q_proj.scales"].2),
            &as_f16(&t["model.layers.0.self_attn.q_proj.biases"].2),
            q,
            HIDDEN,
            4,
        );
        assert_eq!(ours, decode_q4_0(gguf_data(&g, "blk.0.attn_q.weight")));
        let mut copied = vec![
            ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
            ("model.layers.0.post_attention_layernorm.weight", "blk.0.ffn_norm.weight"),
            ("model.norm.weight", "output_norm.weight"),
        ];
        if arch == "qwen3" {
            copied.extend([
                ("model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
                ("model.layers.0.self_attn.k_norm.weight", "blk.0.attn_k_norm.weight"),
            ]);
            assert!(!t.contains_key("model.layers.0.self_attn.q_proj.bias"));
        } else {
            copied.extend([
                ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
                ("model.layers.0.self_attn.k_proj.bias", "blk.0.attn_k.bias"),
                ("model.layers.0.self_attn.v_proj.bias", "blk.0.attn_v.bias"),
            ]);
            assert!(!t.contains_key("model.layers.0.self_attn.q_norm.weight"));
        }
        for (hf, gguf_name) in copied {
            assert_eq!(as_f32(&t[hf].2), as_f32(gguf_data(&g, gguf_name)), "{arch} {hf}");
        }
    }
}

/// Gemma 3: llama.cpp's norm gains carry Gemma's `+ 1`, which the converter takes out; its
/// `ffn_norm` is the MLP's input norm and its post-norms keep their own names; the config
/// has the window, the layer pattern, the local RoPE base and an integer query scale.
#[test]
fn gemma3_norms_lose_llama_cpps_shift() {
    let tmp = TempDir::new("gemma3");
    let g = tiny_model(&mut Rng(4), "gemma3");
    let (config, t) = convert_tiny(&tmp, "gemma3", &g);
    assert_gemma_norms(&g, &t, &[("model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight")]);
    assert_eq!(config["model_type"], "gemma3_text");
    assert_eq!(config["sliding_window"], 4);
    assert_eq!(config["sliding_window_pattern"], 6);
    assert_eq!(config["rope_local_base_freq"], 10000.0);
    assert_eq!(config["query_pre_attn_scalar"], serde_json::json!(HEAD_DIM));
}

/// What the loader cannot run is refused at conversion, naming what is supported.
#[test]
fn refuses_what_mlxcel_cannot_load() {
    let tmp = TempDir::new("refused");
    let mut other = tiny_model(&mut Rng(5), "llama");
    other.metadata[0].1 = s("starcoder2");
    let path = write(&tmp.0, "starcoder2.gguf", &other.build().0);
    let err = convert_gguf(&path, &tmp.0.join("starcoder2"), &ConvertOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Unsupported { .. }), "{msg}");
    assert!(msg.contains("`starcoder2`") && msg.contains("llama, qwen2, qwen3, gemma2, gemma3, olmo2, phi3"), "{msg}");
    assert!(!tmp.0.join("starcoder2").exists());

    // A llama.cpp tensor the architecture does not have (a Qwen3 q-norm in a llama file).
    let mut extra = tiny_model(&mut Rng(5), "llama");
    extra.tensor("blk.0.attn_q_norm.weight", &[HEAD_DIM as u64], 0, vec![0; HEAD_DIM * 4]);
    let path = write(&tmp.0, "extra.gguf", &extra.build().0);
    let err = convert_gguf(&path, &tmp.0.join("extra"), &ConvertOptions::default()).unwrap_err();
    assert!(err.to_string().contains("blk.0.attn_q_norm.weight"), "{err}");

    for (kind, accepted) in [("yarn", true), ("longrope", false), ("linear", true)] {
        let mut g = tiny_model(&mut Rng(5), "llama");
        g.meta("llama.rope.scaling.type", s(kind))
            .meta("llama.rope.scaling.factor", Value::F32(4.0))
            .meta("llama.rope.scaling.original_context_length", Value::U32(128));
        let path = write(&tmp.0, &format!("{kind}.gguf"), &g.build().0);
        let out = tmp.0.join(kind);
        let result = convert_gguf(&path, &out, &ConvertOptions::default());
        if accepted {
            result.unwrap();
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
            assert_eq!(config["rope_scaling"]["rope_type"], kind);
            assert!(config["rope_scaling"].get("type").is_none(), "one name for the kind");
            assert_eq!(config["rope_scaling"]["factor"], 4.0);
        } else {
            let msg = result.unwrap_err().to_string();
            assert!(msg.contains(&format!("RoPE scaling `{kind}`")) && msg.contains("linear, yarn"), "{msg}");
            assert!(!out.exists());
        }
    }
    // llama.cpp's YaRN attention factor has no mlx-lm counterpart.
    let mut g = tiny_model(&mut Rng(5), "llama");
    g.meta("llama.rope.scaling.type", s("yarn"))
        .meta("llama.rope.scaling.factor", Value::F32(4.0))
        .meta("llama.rope.scaling.attn_factor", Value::F32(0.8));
    let path = write(&tmp.0, "yarn-attn.gguf", &g.build().0);
    let msg = convert_gguf(&path, &tmp.0.join("yarn-attn"), &ConvertOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("llama.rope.scaling.attn_factor") && msg.contains("0.8"), "{msg}");
}

/// llama.cpp keeps Llama 3's RoPE scaling only as `rope_freqs.weight`: the converter writes the
/// `llama3` `rope_scaling` that reproduces it, and refuses factors no such scaling gives.
#[test]
fn llama3_rope_freqs_become_rope_scaling() {
    let tmp = TempDir::new("rope-freqs");
    let convert = |name: &str, g: &GgufBuilder| {
        let path = write(&tmp.0, &format!("{name}.gguf"), &g.build().0);
        let out = tmp.0.join(name);
        let result = convert_gguf(&path, &out, &ConvertOptions::default());
        (result, out)
    };
    let config_of = |out: &std::path::Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap()
    };

    for factor in [8.0, 32.0] {
        let (report, out) = convert(&format!("llama3-{factor}"), &tiny_llama3(&mut Rng(7), factor));
        let report = report.unwrap();
        assert_eq!(
            config_of(&out)["rope_scaling"],
            serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            })
        );
        assert!(report.skipped.iter().any(|s| s.starts_with("rope_freqs.weight")), "{:?}", report.skipped);
        assert!(!read_safetensors(&out.join("model.safetensors")).keys().any(|k| k.contains("rope")));
    }

    // All ones: no scaling at all.
    let mut ones = tiny_model(&mut Rng(7), "llama");
    ones.tensor("rope_freqs.weight", &[HEAD_DIM as u64 / 2], 0, 1f32.to_le_bytes().repeat(HEAD_DIM / 2));
    let (report, out) = convert("ones", &ones);
    report.unwrap();
    assert!(config_of(&out).get("rope_scaling").is_none());

    // Refused: factors off the llama3 schedule, a wrong length, and two scalings at once.
    let mut bent = tiny_llama3(&mut Rng(7), 8.0);
    let freqs = &mut bent.tensors.last_mut().unwrap().3;
    let pair = (0..HEAD_DIM / 2).find(|&i| as_f32(&freqs[i * 4..i * 4 + 4])[0] > 1.5).unwrap();
    let bent_value = as_f32(&freqs[pair * 4..pair * 4 + 4])[0] * 1.001;
    freqs[pair * 4..pair * 4 + 4].copy_from_slice(&bent_value.to_le_bytes());
    let mut short = tiny_llama3(&mut Rng(7), 8.0);
    let last = short.tensors.last_mut().unwrap();
    last.1 = vec![HEAD_DIM as u64 / 4];
    last.3.truncate(HEAD_DIM / 4 * 4);
    let mut both = tiny_llama3(&mut Rng(7), 8.0);
    both.meta("llama.rope.scaling.type", s("linear")).meta("llama.rope.scaling.factor", Value::F32(2.0));
    for (name, g, expected) in [
        ("bent", &bent, "no llama3 RoPE scaling reproduces"),
        ("short", &short, "[32] floats are expected"),
        ("both", &both, "both `llama.rope.scaling.type` and `rope_freqs.weight`"),
    ] {
        let (result, out) = convert(name, g);
        let err = result.unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Unsupported { .. }), "{name}: {msg}");
        assert!(msg.contains(expected) && msg.contains("rope_freqs.weight"), "{name}: {msg}");
        assert!(!out.exists(), "{name}");
    }
}

/// A bias the loader would not read is refused, naming it; the biases it reads convert.
#[test]
fn biases_the_loader_would_drop_are_refused() {
    let tmp = TempDir::new("biases");
    let bias = |g: &mut GgufBuilder, name: &str, n: usize| {
        g.tensor(name, &[n as u64], GgmlType::F32.id(), 0.25f32.to_le_bytes().repeat(n));
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut qwen3 = tiny_model(&mut Rng(9), "qwen3");
    for (name, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", HIDDEN)] {
        bias(&mut qwen3, &format!("blk.0.{name}.bias"), n);
    }
    let mut qwen2 = tiny_model(&mut Rng(9), "qwen2");
    bias(&mut qwen2, "blk.0.attn_output.bias", HIDDEN);
    let mut llama = tiny_model(&mut Rng(9), "llama");
    bias(&mut llama, "blk.0.ffn_up.bias", FFN);
    for (name, g, expected) in [
        ("qwen3", &qwen3, "tensor `blk.0.attn_q.bias`: qwen3 has no bias on `attn_q` (biases it has: none)"),
        ("qwen2", &qwen2, "tensor `blk.0.attn_output.bias`: qwen2 has no bias on `attn_output` (biases it has: attn_q, attn_k, attn_v)"),
        ("llama", &llama, "tensor `blk.0.ffn_up.bias`: llama has no bias on `ffn_up`"),
    ] {
        let path = write(&tmp.0, &format!("{name}.gguf"), &g.build().0);
        let out = tmp.0.join(name);
        let err = convert_gguf(&path, &out, &ConvertOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Unsupported { .. }) && msg.contains(expected), "{name}: {msg}");
        assert!(!out.exists(), "{name}");
    }

    // Llama's attention biases are read (`attention_bias`).
    let mut biased = tiny_model(&mut Rng(9), "llama");
    for (name, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", HIDDEN)] {
        bias(&mut biased, &format!("blk.0.{name}.bias"), n);
    }
    let path = write(&tmp.0, "biased.gguf", &biased.build().0);
    convert_gguf(&path, &tmp.0.join("biased"), &ConvertOptions::default()).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.0.join("biased/config.json")).unwrap()).unwrap();
    assert_eq!(config["attention_bias"], true);
    assert!(read_safetensors(&tmp.0.join("biased/model.safetensors")).contains_key("model.layers.0.self_attn.o_proj.bias"));
}

/// A converted checkpoint's tensors: name → (dtype, shape, bytes).
type Tensors = std::collections::HashMap<String, (String, Vec<usize>, Vec<u8>)>;

/// Converts `g` into `tmp/name`: its config.json and tensors.
fn convert_tiny(tmp: &TempDir, name: &str, g: &GgufBuilder) -> (serde_json::Value, Tensors) {
    let gguf = write(&tmp.0, &format!("{name}.gguf"), &g.build().0);
    let out = tmp.0.join(name);
    convert_gguf(&gguf, &out, &ConvertOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let config = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    (config, read_safetensors(&out.join("model.safetensors")))
}

/// Gemma's four block norms, its final norm and `extra` (HF, GGUF) norms hold llama.cpp's gains
/// less Gemma's `+ 1`, under Gemma's names; the head is tied.
fn assert_gemma_norms(g: &GgufBuilder, t: &Tensors, extra: &[(&str, &str)]) {
    let norms = [
        ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
        ("model.layers.0.pre_feedforward_layernorm.weight", "blk.0.ffn_norm.weight"),
        ("model.layers.0.post_attention_layernorm.weight", "blk.0.post_attention_norm.weight"),
        ("model.layers.0.post_feedforward_layernorm.weight", "blk.0.post_ffw_norm.weight"),
        ("model.norm.weight", "output_norm.weight"),
    ];
    for &(hf, gguf_name) in norms.iter().chain(extra) {
        let want: Vec<f32> = as_f32(gguf_data(g, gguf_name)).iter().map(|v| v - 1.0).collect();
        assert_eq!(as_f32(&t[hf].2), want, "{hf}");
    }
    assert!(!t.contains_key("lm_head.weight"), "tied");
}

/// Gemma 2: the norms lose llama.cpp's `+ 1` and keep Gemma's names; the soft-caps come from
/// `gemma2.*_logit_softcapping`; the query scale follows llama.cpp (hidden / heads for the
/// 46-layer 27B, head_dim otherwise); tied.
#[test]
fn gemma2_norms_softcaps_and_query_scale() {
    let tmp = TempDir::new("gemma2");
    let mut g = tiny_model(&mut Rng(6), "gemma2");
    set_meta(&mut g, "gemma2.attn_logit_softcapping", Value::F32(40.0));
    let (config, t) = convert_tiny(&tmp, "gemma2", &g);
    assert_gemma_norms(&g, &t, &[]);
    assert!(!t.contains_key("model.layers.0.self_attn.q_norm.weight"));
    assert_eq!(config["model_type"], "gemma2");
    assert_eq!(config["attn_logit_softcapping"], 40.0);
    assert_eq!(config["final_logit_softcapping"], 30.0);
    assert_eq!(config["sliding_window"], 4);
    assert_eq!(config["hidden_activation"], "gelu_pytorch_tanh");
    assert_eq!(config["query_pre_attn_scalar"], serde_json::json!(HEAD_DIM));

    // A head_dim other than hidden / heads tells the two rules apart.
    let mut g = tiny_model(&mut Rng(6), "gemma2");
    set_meta(&mut g, "gemma2.attention.key_length", Value::U32(32));
    assert_eq!(convert_tiny(&tmp, "gemma2-9b-rule", &g).0["query_pre_attn_scalar"], 32);
    set_meta(&mut g, "gemma2.block_count", Value::U32(46));
    assert_eq!(convert_tiny(&tmp, "gemma2-27b-rule", &g).0["query_pre_attn_scalar"], HIDDEN / HEADS);
}

/// OLMo 2: post-norms under their Hugging Face names, whole-projection q/k norms, no input
/// norms, no permutation, no shift; untied written as such (mlx-lm's olmo2 ties by default).
#[test]
fn olmo2_post_norms_and_whole_qk_norms() {
    let tmp = TempDir::new("olmo2");
    let g = tiny_model(&mut Rng(7), "olmo2");
    let (config, t) = convert_tiny(&tmp, "olmo2", &g);
    for (hf, gguf_name) in [
        ("model.layers.0.post_attention_layernorm.weight", "blk.0.post_attention_norm.weight"),
        ("model.layers.0.post_feedforward_layernorm.weight", "blk.0.post_ffw_norm.weight"),
        ("model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
        ("model.layers.0.self_attn.k_norm.weight", "blk.0.attn_k_norm.weight"),
    ] {
        assert_eq!(as_f32(&t[hf].2), as_f32(gguf_data(&g, gguf_name)), "{hf}");
    }
    assert_eq!(t["model.layers.0.self_attn.q_norm.weight"].1, [HEADS * HEAD_DIM]);
    assert!(!t.contains_key("model.layers.0.input_layernorm.weight"));
    let q = as_u32(&t["model.layers.0.self_attn.q_proj.weight"].2);
    let scales = as_f16(&t["model.layers.0.self_attn.q_proj.scales"].2);
    let biases = as_f16(&t["model.layers.0.self_attn.q_proj.biases"].2);
    let ours = affine_dequantize(&q, &scales, &biases, HEADS * HEAD_DIM, HIDDEN, 4);
    assert_eq!(ours, decode_q4_0(gguf_data(&g, "blk.0.attn_q.weight")), "rows not permuted");
    assert_eq!(config["model_type"], "olmo2");
    assert_eq!(config["tie_word_embeddings"], false);
}

/// Phi-3: `attn_qkv` and the 2 * FFN-row `ffn_up` become `qkv_proj` and `gate_up_proj`
/// (exact affine from Q4_0 / Q8_0, rows unpermuted); LongRoPE factors become a `longrope`
/// `rope_scaling`, and an attention factor mlx-lm would not derive is refused.
#[test]
fn phi3_fused_projections_and_longrope() {
    let tmp = TempDir::new("phi3");
    let g = tiny_model(&mut Rng(8), "phi3");
    let (config, t) = convert_tiny(&tmp, "phi3", &g);
    let qkv = HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM;
    let w = as_u32(&t["model.layers.0.self_attn.qkv_proj.weight"].2);
    let scales = as_f16(&t["model.layers.0.self_attn.qkv_proj.scales"].2);
    let biases = as_f16(&t["model.layers.0.self_attn.qkv_proj.biases"].2);
    assert_eq!(affine_dequantize(&w, &scales, &biases, qkv, HIDDEN, 4), decode_q4_0(gguf_data(&g, "blk.0.attn_qkv.weight")));
    assert_eq!(t["model.layers.0.mlp.gate_up_proj.weight"].1, [2 * FFN, HIDDEN / 4]);
    assert!(!t.keys().any(|k| k.contains("q_proj") || k.contains("gate_proj.")), "{:?}", t.keys());
    assert_eq!(config["model_type"], "phi3");
    assert!(config.get("rope_scaling").is_none() && config.get("partial_rotary_factor").is_none());

    // llama.cpp's own factor for context 512 over 128: sqrt(1 + ln 4 / ln 128).
    let derived = (1.0 + 4f64.ln() / 128f64.ln()).sqrt() as f32;
    let (config, t) = convert_tiny(&tmp, "phi3-longrope", &tiny_phi3_longrope(&mut Rng(8), Some(derived)));
    assert_eq!(config["rope_scaling"]["type"], "longrope");
    assert_eq!(config["rope_scaling"]["long_factor"][3], 2.5);
    assert_eq!(config["rope_scaling"]["short_factor"][1], 1.01);
    assert_eq!(config["original_max_position_embeddings"], 128);
    assert_eq!(config["max_position_embeddings"], 512);
    assert!(!t.keys().any(|k| k.contains("rope_factors")));

    let path = write(&tmp.0, "phi3-attn.gguf", &tiny_phi3_longrope(&mut Rng(8), Some(1.5)).build().0);
    let msg = convert_gguf(&path, &tmp.0.join("phi3-attn"), &ConvertOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("phi3.rope.scaling.attn_factor") && msg.contains("1.5"), "{msg}");
    let mut llama = tiny_model(&mut Rng(8), "llama");
    llama.tensor("rope_factors_long.weight", &[HEAD_DIM as u64 / 2], GgmlType::F32.id(), vec![0; HEAD_DIM * 2]);
    let path = write(&tmp.0, "llama-longrope.gguf", &llama.build().0);
    let msg = convert_gguf(&path, &tmp.0.join("llama-longrope"), &ConvertOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("LongRoPE") && msg.contains("phi3"), "{msg}");
}
