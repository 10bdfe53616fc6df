//! Late chunking: a text's chunks embedded from the token states of the whole text, so that
//! each chunk's vector keeps its context (Günther et al., "Late Chunking", 2024). The text
//! runs once; each chunk is the mean (or the largest value) of the states of the tokens it
//! covers, then the model's Dense layers and normalisation as for a whole text.
//!
//! Chunks are character spans of the text (`[start, end)`, counted in Unicode scalar values,
//! as Python counts them), given or made by a rule: sentences, or N tokens each. A token
//! belongs to every chunk its characters overlap; special tokens to none.
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::ops::Range;

use super::text::Piece;

/// How a text is cut into chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Character spans `[start, end)`, in order, not overlapping.
    Spans(Vec<(usize, usize)>),
    /// A sentence ends after `.`, `!`, `?` (and their full-width forms) followed by
    /// whitespace, or at the end of the text; a chunk starts at its first non-space character.
    Sentences,
    /// Consecutive groups of this many of the text's tokens.
    Tokens(usize),
}

/// One chunk: its character span and the tokens (indices into the pieces) it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub end: usize,
    pub tokens: Range<usize>,
}

/// The chunks of `text` by `rule`, each with the tokens it covers among `pieces` (the
/// tokenized `prompt` + `text`, special tokens included; `prompt_bytes` long prompt first).
/// Refused (with what is wrong, naming the field) when a span is out of the text, empty,
/// out of order or overlapping, or covers no token.
pub fn chunks(text: &str, prompt_bytes: usize, pieces: &[Piece], rule: &Rule) -> Result<Vec<Chunk>, String> {
    // Byte offset of each character, and the text's end.
    let bytes: Vec<usize> = text.char_indices().map(|(b, _)| b).chain(std::iter::once(text.len())).collect();
    let characters = bytes.len().saturating_sub(1);
    let char_of = |byte: usize| bytes.partition_point(|&b| b < byte);
    // The text's own tokens: their index and byte span within `text`.
    let own: Vec<(usize, usize, usize)> = pieces
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match (p.start, p.stop) {
            (Some(a), Some(b)) if a >= prompt_bytes => {
                Some((i, a.saturating_sub(prompt_bytes), b.saturating_sub(prompt_bytes)))
            }
            _ => None,
        })
        .collect();
    let spans: Vec<(usize, usize)> = match rule {
        Rule::Spans(spans) => {
            let mut previous_end = 0;
            for (i, &(start, end)) in spans.iter().enumerate() {
                if start >= end || end > characters {
                    return Err(format!(
                        "'chunks[{i}]' is [{start}, {end}]; a chunk is [start, end) with start < end <= {characters}, the \
                         text's length in characters"
                    ));
                }
                if start < previous_end {
                    return Err(format!("'chunks[{i}]' starts at {start}, inside the chunk before it (which ends at {previous_end}): chunks go in order and do not overlap"));
                }
                previous_end = end;
            }
            spans.clone()
        }
        Rule::Sentences => sentences(text).into_iter().map(|(a, b)| (char_of(a), char_of(b))).collect(),
        Rule::Tokens(n) => own
            .chunks((*n).max(1))
            .filter_map(|group| Some((char_of(group.first()?.1), char_of(group.last()?.2))))
            .collect(),
    };
    spans
        .into_iter()
        .enumerate()
        .map(|(i, (start, end))| {
            let (from, to) = (bytes[start], bytes[end]);
            let covered: Vec<usize> = own.iter().filter(|&&(_, a, b)| a < to && b > from).map(|&(t, _, _)| t).collect();
            match (covered.first(), covered.last()) {
                (Some(&first), Some(&last)) => Ok(Chunk { start, end, tokens: first..last.saturating_add(1) }),
                _ => Err(format!("chunk {i} ([{start}, {end}]) covers no token of the text")),
            }
        })
        .collect()
}

/// The byte spans of `text`'s sentences (see [`Rule::Sentences`]).
fn sentences(text: &str) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut start = None;
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if start.is_none() && !c.is_whitespace() {
            start = Some(at);
        }
        let next_is_space = chars.peek().is_none_or(|(_, n)| n.is_whitespace());
        if let (Some(s), true) = (start, matches!(c, '.' | '!' | '?' | '。' | '！' | '？') && next_is_space) {
            spans.push((s, at.saturating_add(c.len_utf8())));
            start = None;
        }
    }
    if let Some(s) = start {
        spans.push((s, text.trim_end().len()));
    }
    spans
}

/// The mean (or, with `max`, the largest value of each dimension) of the token states in
/// `tokens`, pooled as a whole text's are ([`super::head::pool`]).
pub fn pool(states: &[Vec<f32>], tokens: Range<usize>, max: bool) -> Vec<f32> {
    let covered = &states[tokens];
    let dims = covered.first().map_or(0, Vec::len);
    super::head::pool(covered.iter().map(Vec::as_slice), dims, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(start: usize, stop: usize) -> Piece {
        Piece { id: 1, text: String::new(), special: false, start: Some(start), stop: Some(stop) }
    }

    fn special() -> Piece {
        Piece { id: 101, text: "[CLS]".into(), special: true, start: None, stop: None }
    }

    #[test]
    fn spans_cover_the_tokens_they_overlap_past_the_prompt() {
        // "q: " (3 bytes) then "héllo wor. ab": tokens héllo (3..9), wor (10..13), . (13..14),
        // ab (15..17), special tokens around.
        let text = "héllo wor. ab";
        let pieces = [special(), piece(0, 2), piece(3, 9), piece(10, 13), piece(13, 14), piece(15, 17), special()];
        let got = chunks(text, 3, &pieces, &Rule::Spans(vec![(0, 5), (6, 13)])).unwrap();
        assert_eq!(got, vec![Chunk { start: 0, end: 5, tokens: 2..3 }, Chunk { start: 6, end: 13, tokens: 3..6 }]);
        let got = chunks(text, 3, &pieces, &Rule::Sentences).unwrap();
        assert_eq!(got, vec![Chunk { start: 0, end: 10, tokens: 2..5 }, Chunk { start: 11, end: 13, tokens: 5..6 }]);
        let got = chunks(text, 3, &pieces, &Rule::Tokens(2)).unwrap();
        assert_eq!(got.iter().map(|c| (c.start, c.end)).collect::<Vec<_>>(), vec![(0, 9), (9, 13)]);
        // Out of the text, empty, overlapping, or over spaces alone.
        for (spans, says) in [
            (vec![(0, 14)], "chunks[0]"),
            (vec![(3, 3)], "start < end"),
            (vec![(0, 6), (5, 8)], "inside the chunk before it"),
            (vec![(5, 6)], "covers no token"),
        ] {
            let e = chunks(text, 3, &pieces, &Rule::Spans(spans.clone())).unwrap_err();
            assert!(e.contains(says), "{spans:?}: {e}");
        }
    }

    #[test]
    fn pooling_is_the_mean_or_the_max_of_the_covered_states() {
        let states = vec![vec![9.0, 9.0], vec![1.0, 4.0], vec![3.0, 0.0], vec![9.0, 9.0]];
        assert_eq!(pool(&states, 1..3, false), vec![2.0, 2.0]);
        assert_eq!(pool(&states, 1..3, true), vec![3.0, 4.0]);
    }
}
