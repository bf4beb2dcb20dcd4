//! The C ABI of stepalloc (placeholder until the C ABI work lands).
