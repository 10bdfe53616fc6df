//! How much of a text is tokenized: [`BYTES_PER_TOKEN`] bytes for each token of the model's
//! `max_length`, checked by the text pipeline and named in its refusal.

/// Text is cut to `max_length` times this many bytes before it is tokenized (or refused, when
/// it may not be truncated), so that the tokenizer's work and memory are bounded by the model's
/// own limit and not by the body size. A token of real text covers a few bytes (English ~4,
/// CJK 3 per character; WordPiece makes any word over 100 characters a single `[UNK]`), so
/// only text of many long unknown words or runs of whitespace could still have had fewer than
/// `max_length` tokens in it.
pub const BYTES_PER_TOKEN: usize = 64;
