//! Hugging Face chat templates rendered with minijinja.
