//! `StreamDecoder`: the concatenated pieces equal `decode(all ids)`, without broken UTF-8.

mod tokenizer_fixture;

use mlxcel_tokenizer::tokenizer::Tokenizer;
use tokenizer_fixture::checkpoint_dir;

/// xorshift64*: deterministic randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Streams `ids`, checks the invariant, and returns the pieces.
fn stream(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut decoder = tokenizer.stream_decoder(skip_special);
    let mut pieces: Vec<String> = ids
        .iter()
        .filter_map(|&id| decoder.step(id).unwrap())
        .collect();
    pieces.extend(decoder.finish().unwrap());
    let expected = tokenizer.decode(ids, skip_special).unwrap();
    assert_eq!(pieces.concat(), expected, "ids {ids:?}, pieces {pieces:?}");
    pieces
}

#[test]
fn split_characters_are_held_back_until_complete() {
    let tokenizer = Tokenizer::from_dir(&checkpoint_dir("stream_split")).unwrap();
    let ids = tokenizer.encode("😀", false).unwrap();
    assert_eq!(ids.len(), 2, "the fixture splits the emoji over two tokens");

    let mut decoder = tokenizer.stream_decoder(false);
    assert_eq!(decoder.step(ids[0]).unwrap(), None);
    assert_eq!(decoder.step(ids[1]).unwrap().as_deref(), Some("😀"));
    assert_eq!(decoder.finish().unwrap(), None);

    let text = "Hello world 😀 the 中文 cat 🇫🇷 don't 中 😀😀<|im_end|>";
    let ids = tokenizer.encode(text, false).unwrap();
    for skip_special in [false, true] {
        let pieces = stream(&tokenizer, &ids, skip_special);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    }
}

#[test]
fn finish_flushes_an_incomplete_tail() {
    let tokenizer = Tokenizer::from_dir(&checkpoint_dir("stream_finish")).unwrap();
    let ids = tokenizer.encode("Hello😀", false).unwrap();
    assert_eq!(ids.len(), 3, "Hello, then the emoji's two halves");
    let truncated = &ids[..ids.len() - 1];
    let mut decoder = tokenizer.stream_decoder(false);
    let mut pieces: Vec<String> = truncated
        .iter()
        .filter_map(|&id| decoder.step(id).unwrap())
        .collect();
    assert_eq!(pieces.concat(), "Hello");
    let tail = decoder.finish().unwrap().unwrap();
    assert!(tail.ends_with('\u{FFFD}'), "{tail:?}");
    pieces.push(tail);
    assert_eq!(pieces.concat(), tokenizer.decode(truncated, false).unwrap());
}

#[test]
fn adversarial_text_splits_match_full_decode() {
    let tokenizer = Tokenizer::from_dir(&checkpoint_dir("stream_adversarial")).unwrap();
    let fragments = [
        "😀",
        " 😀",
        "中",
        "中文",
        "🇫🇷",
        "é",
        " the",
        " cat",
        "Hello",
        " world",
        "don't",
        "\n",
        " ",
        "<|im_end|>",
        "<think>",
        "a",
        "ß",
        "🧑‍🤝‍🧑",
    ];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..300 {
        let text: String = (0..1 + rng.below(12))
            .map(|_| fragments[rng.below(fragments.len())])
            .collect();
        let ids = tokenizer.encode(&text, false).unwrap();
        for skip_special in [false, true] {
            let pieces = stream(&tokenizer, &ids, skip_special);
            assert!(
                pieces.iter().all(|p| !p.contains('\u{FFFD}')),
                "{text:?}: {pieces:?}"
            );
        }
    }
}

#[test]
fn random_ids_match_full_decode() {
    let tokenizer = Tokenizer::from_dir(&checkpoint_dir("stream_random")).unwrap();
    let vocab_size = tokenizer.vocab_size();
    let mut rng = Rng(42);
    for _ in 0..500 {
        let len = rng.below(40);
        // Bias towards bytes >= 0x80 so that broken sequences are common.
        let ids: Vec<u32> = (0..len)
            .map(|_| match rng.below(3) {
                0 => rng.below(vocab_size) as u32,
                _ => tokenizer
                    .token_to_id(
                        &tokenizer_fixture::byte_char(0x80 + rng.below(0x80) as u8).to_string(),
                    )
                    .unwrap(),
            })
            .collect();
        for skip_special in [false, true] {
            stream(&tokenizer, &ids, skip_special);
        }
    }
}

#[test]
fn window_stays_small_on_long_streams() {
    let tokenizer = Tokenizer::from_dir(&checkpoint_dir("stream_long")).unwrap();
    let text = "Hello world the cat 中文 😀 ".repeat(400);
    let ids = tokenizer.encode(&text, false).unwrap();
    let start = std::time::Instant::now();
    let pieces = stream(&tokenizer, &ids, false);
    assert!(pieces.len() > ids.len() / 2);
    // O(window) per step: thousands of ids stream in well under a second even in debug builds.
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}
