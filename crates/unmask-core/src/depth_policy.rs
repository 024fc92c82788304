//! BiCache's depth policy: a table from the shared-prefix ratio r (percent) to the number of
//! shallow layers b whose prefix K/V are reused across requests. Made offline by profiling
//! (`unmask profile`); b = table[largest key <= r], with r = round(100 * P / (P + U + G)).

use serde::{Deserialize, Serialize};

/// The profiled table of one model, as stored in JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DepthTable {
    pub model_id: String,
    /// Cosine-similarity threshold a layer had to pass.
    pub tau: f64,
    pub ratio_definition: String,
    pub samples_per_ratio: usize,
    #[serde(default)]
    pub source: String,
    pub n_layers: usize,
    /// (r, b) pairs, r ascending.
    pub entries: Vec<(u32, usize)>,
}

/// A table that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DepthTableError {
    #[error("depth table {what}: {message}")]
    Invalid { what: String, message: String },
}

/// The table shipped for LLaDA-8B-Instruct (τ = 0.97, 500 samples per ratio).
pub const LLADA_8B_INSTRUCT: &str = include_str!("../policies/llada-8b-instruct.json");

/// The table shipped for Dream-v0-Instruct-7B (τ = 0.97, 500 samples per ratio).
pub const DREAM_V0_INSTRUCT_7B: &str = include_str!("../policies/dream-v0-instruct-7b.json");

/// r = round(100 * P / (P + U + G)): the prefix's share of the whole request, canvas included.
pub fn prefix_ratio(prefix: usize, rest: usize, gen_length: usize) -> u32 {
    let total = prefix + rest + gen_length;
    if total == 0 {
        return 0;
    }
    ((100 * prefix) as f64 / total as f64).round() as u32
}

impl DepthTable {
    pub fn from_json(text: &str, what: &str) -> Result<Self, DepthTableError> {
        let t: DepthTable = serde_json::from_str(text).map_err(|e| DepthTableError::Invalid {
            what: what.to_string(),
            message: e.to_string(),
        })?;
        t.validate(what)?;
        Ok(t)
    }

    fn validate(&self, what: &str) -> Result<(), DepthTableError> {
        let bad = |message: String| DepthTableError::Invalid {
            what: what.to_string(),
            message,
        };
        if self.entries.first().map(|e| e.0) != Some(0) {
            return Err(bad("entries must start at r = 0".into()));
        }
        for w in self.entries.windows(2) {
            if w[1].0 <= w[0].0 {
                return Err(bad(format!(
                    "ratios must increase, found {} after {}",
                    w[1].0, w[0].0
                )));
            }
        }
        if let Some(&(r, b)) = self
            .entries
            .iter()
            .find(|&&(r, b)| r > 100 || b > self.n_layers)
        {
            return Err(bad(format!(
                "entry ({r}, {b}) outside r <= 100, b <= n_layers {}",
                self.n_layers
            )));
        }
        Ok(())
    }

    /// b for a request whose prefix makes up r percent of it.
    pub fn depth(&self, r: u32) -> usize {
        self.entries
            .iter()
            .take_while(|(key, _)| *key <= r)
            .last()
            .map_or(0, |&(_, b)| b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_llada_table_gives_the_profiled_depths() {
        let t = DepthTable::from_json(LLADA_8B_INSTRUCT, "llada-8b-instruct.json").unwrap();
        assert_eq!(t.n_layers, 32);
        assert_eq!(t.depth(0), 1);
        assert_eq!(t.depth(12), 3);
        assert_eq!(t.depth(50), 11);
        assert_eq!(t.depth(85), 16);
        assert_eq!(t.depth(99), 32);
        assert_eq!(t.depth(100), 32);
    }

    #[test]
    fn shipped_dream_table_gives_the_profiled_depths() {
        let t = DepthTable::from_json(DREAM_V0_INSTRUCT_7B, "dream-v0-instruct-7b.json").unwrap();
        assert_eq!(t.n_layers, 28);
        assert_eq!(t.depth(5), 1);
        assert_eq!(t.depth(9), 2);
        assert_eq!(t.depth(50), 7);
        assert_eq!(t.depth(90), 14);
        assert_eq!(t.depth(96), 28);
    }

    #[test]
    fn ratio_counts_the_canvas() {
        // 85 % shared prefix in the paper's request shape.
        assert_eq!(prefix_ratio(340, 28, 32), 85);
        assert_eq!(prefix_ratio(0, 0, 0), 0);
    }

    #[test]
    fn bad_tables_are_named() {
        let t = r#"{"model_id":"m","tau":0.97,"ratio_definition":"x","samples_per_ratio":1,"n_layers":4,"entries":[[5,1]]}"#;
        let err = DepthTable::from_json(t, "mine.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("mine.json") && err.contains("r = 0"), "{err}");
        let t = r#"{"model_id":"m","tau":0.97,"ratio_definition":"x","samples_per_ratio":1,"n_layers":4,"entries":[[0,1],[50,9]]}"#;
        assert!(
            DepthTable::from_json(t, "t")
                .unwrap_err()
                .to_string()
                .contains("(50, 9)")
        );
    }
}
