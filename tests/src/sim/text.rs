//! Tokens in and text out.
//!
//! A prompt token is a whitespace-separated word: `"Tell me a story"` is 4 tokens, and a
//! 2,000-word document is 2,000 tokens. That is simpler than a real tokenizer (which gives
//! roughly 1.3 tokens per English word) but deterministic, cheap, and easy to reason about in
//! tests: a client makes a prompt of N tokens by joining N words. A token's id is the FNV-1a
//! hash of its word, so equal words are equal tokens and the prefix cache sees shared
//! prefixes.
//!
//! Output is drawn word by word from a small vocabulary by a PRNG seeded from the prompt's
//! token ids and the server's seed: the same prompt on a server with the same `--seed` always
//! gets the same answer, and so does its natural length (where the simulated model would emit
//! its end-of-sequence token).

/// 64-bit FNV-1a, as in the brief's prefix hint (section 4); used here for token ids and the
/// prefix cache's block hashes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_extend(0xcbf2_9ce4_8422_2325, bytes)
}

/// Continues an FNV-1a hash over more bytes.
pub fn fnv1a_extend(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The token ids of `text`: one per whitespace-separated word.
pub fn tokenize(text: &str) -> Vec<u64> {
    text.split_whitespace()
        .map(|word| fnv1a(word.as_bytes()))
        .collect()
}

/// The words a simulated model says. Plain ASCII without quotes or backslashes, so a token's
/// text goes into JSON as it is.
const VOCABULARY: [&str; 64] = [
    "the", "model", "server", "token", "cache", "prefix", "batch", "queue", "stream", "answer",
    "a", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "this", "by",
    "request", "memory", "latency", "first", "time", "load", "balancer", "backend", "flow",
    "packet", "kernel", "route", "weight", "table", "bucket", "hash", "port", "client", "reply",
    "prompt", "context", "window", "block", "slot", "decode", "prefill", "step", "running",
    "waiting", "fast", "slow", "warm", "cold", "long", "short", "shared", "home", "spill", "up",
    "down",
];

/// Shortest and longest natural answer, in tokens, when `ignore_eos` is off.
const NATURAL_MIN: u32 = 8;
const NATURAL_MAX: u32 = 256;

/// The deterministic "model" of one request: which words it says, and when it would stop.
#[derive(Debug, Clone)]
pub struct Generator {
    state: u64,
    natural_len: u32,
}

impl Generator {
    pub fn new(prompt: &[u64], seed: u64) -> Self {
        let mut hash = fnv1a_extend(fnv1a(&seed.to_le_bytes()), b"prompt");
        for token in prompt {
            hash = fnv1a_extend(hash, &token.to_le_bytes());
        }
        let mut generator = Self {
            state: hash,
            natural_len: 0,
        };
        let span = u64::from(NATURAL_MAX - NATURAL_MIN + 1);
        generator.natural_len =
            NATURAL_MIN + u32::try_from(generator.next_u64() % span).expect("span fits u32");
        generator
    }

    /// How many tokens the answer has when the end-of-sequence token is honoured.
    pub fn natural_len(&self) -> u32 {
        self.natural_len
    }

    /// The next word of the answer.
    pub fn next_word(&mut self) -> &'static str {
        let index = usize::try_from(self.next_u64() % VOCABULARY.len() as u64).expect("small");
        VOCABULARY[index]
    }

    /// SplitMix64: tiny, fast, and good enough to pick words.
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        // From the FNV reference test suite.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn words_are_tokens() {
        assert_eq!(
            tokenize("  Tell me\ta\nstory "),
            tokenize("Tell me a story")
        );
        assert_eq!(tokenize("Tell me a story").len(), 4);
        assert!(tokenize(" \n").is_empty());
        let t = tokenize("cache cache miss");
        assert_eq!(t[0], t[1]);
        assert_ne!(t[1], t[2]);
    }

    #[test]
    fn answers_depend_on_prompt_and_seed_only() {
        let words = |prompt: &str, seed| {
            let mut g = Generator::new(&tokenize(prompt), seed);
            let len = g.natural_len();
            (len, (0..20).map(|_| g.next_word()).collect::<Vec<_>>())
        };
        assert_eq!(words("hello there", 1), words("hello   there", 1));
        assert_ne!(words("hello there", 1), words("hello there", 2));
        assert_ne!(words("hello there", 1), words("hello you", 1));
        let lengths: Vec<u32> = (0..200)
            .map(|i| Generator::new(&tokenize(&format!("prompt {i}")), 0).natural_len())
            .collect();
        assert!(lengths
            .iter()
            .all(|l| (NATURAL_MIN..=NATURAL_MAX).contains(l)));
        // Spread over the range rather than stuck at one value.
        assert!(lengths.iter().max().unwrap() - lengths.iter().min().unwrap() > 100);
    }
}
