//! The stable C ABI of mlxcel.
