//! The mlxcel Engine: generation, KV caches and sampling.
