use std::fmt;

/// MLX element types. The discriminants equal the positions in
/// `mlx::core::Dtype::Val`, which is how they cross the bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Dtype {
    Bool = 0,
    Uint8 = 1,
    Uint16 = 2,
    Uint32 = 3,
    Uint64 = 4,
    Int8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Float16 = 9,
    Float32 = 10,
    Float64 = 11,
    Bfloat16 = 12,
    Complex64 = 13,
}

impl Dtype {
    pub(crate) fn from_code(code: u8) -> Dtype {
        use Dtype::*;
        [Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Float16, Float32, Float64, Bfloat16, Complex64]
            [code as usize]
    }

    pub fn size_in_bytes(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }

    pub fn is_floating(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16)
    }

    /// The name used by safetensors, numpy and Hugging Face configs.
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            Bool => "bool",
            Uint8 => "uint8",
            Uint16 => "uint16",
            Uint32 => "uint32",
            Uint64 => "uint64",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Bfloat16 => "bfloat16",
            Complex64 => "complex64",
        }
    }

    /// Parses a Hugging Face `torch_dtype` style name.
    pub fn from_name(name: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match name {
            "bool" => Bool,
            "uint8" => Uint8,
            "uint32" => Uint32,
            "int8" => Int8,
            "int32" => Int32,
            "int64" => Int64,
            "float16" | "half" => Float16,
            "float32" | "float" => Float32,
            "bfloat16" => Bfloat16,
            _ => return None,
        })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
