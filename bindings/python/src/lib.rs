//! Python bindings for mlxcel.
