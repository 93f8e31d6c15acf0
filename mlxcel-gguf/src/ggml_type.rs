//! GGML tensor element types and their block layouts.

/// A GGML tensor type. Values are packed in blocks of `block_size()` elements
/// taking `type_size()` bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    BF16,
    Tq1_0,
    Tq2_0,
}

/// `(type, GGUF id, name, block size, bytes per block)`, as in ggml.h / gguf-py.
const TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 40),
    (GgmlType::Q2K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8K, 15, "Q8_K", 256, 292),
    (GgmlType::Iq2Xxs, 16, "IQ2_XXS", 256, 66),
    (GgmlType::Iq2Xs, 17, "IQ2_XS", 256, 74),
    (GgmlType::Iq3Xxs, 18, "IQ3_XXS", 256, 98),
    (GgmlType::Iq1S, 19, "IQ1_S", 256, 50),
    (GgmlType::Iq4Nl, 20, "IQ4_NL", 32, 18),
    (GgmlType::Iq3S, 21, "IQ3_S", 256, 110),
    (GgmlType::Iq2S, 22, "IQ2_S", 256, 82),
    (GgmlType::Iq4Xs, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::Iq1M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::Tq1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::Tq2_0, 35, "TQ2_0", 256, 66),
];

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TABLE
            .iter()
            .find(|row| row.0 == self)
            .expect("every type is in TABLE")
    }

    pub fn id(self) -> u32 {
        self.row().1
    }

    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().4
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks
    /// (or the size overflows).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        n.is_multiple_of(block)
            .then(|| (n / block).checked_mul(self.type_size() as u64))?
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
