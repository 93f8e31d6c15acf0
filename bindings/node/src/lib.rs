//! Node bindings for mlxcel.
