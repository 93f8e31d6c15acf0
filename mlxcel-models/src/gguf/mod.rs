//! GGUF reading and conversion to MLX checkpoints.
