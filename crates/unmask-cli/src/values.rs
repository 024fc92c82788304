//! Parsers for flag values. Each returns the value or says what a valid one looks like;
//! clap names the flag and the value given around it, so an error reads
//! `invalid value 'x' for '--steps <N>': expected a whole number >= 1`.

use std::str::FromStr;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use unmask::{CacheBudget, CacheMode, EngineOptions};
use unmask_gpu::ops::attention::AttentionKernel;
use unmask_gpu::ops::matmul::MatmulKernel;

/// What a valid value of a list of cache modes looks like.
const CACHE_MODES_EXPECTED: &str = "`all` or a comma-separated list of none, fast-dllm-prefix, \
     fast-dllm-dual, prefix-arm, bicache, bicache-dual";

fn expected(what: &str) -> String {
    format!("expected {what}")
}

fn parsed<T: FromStr>(text: &str, ok: impl Fn(&T) -> bool, what: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .ok()
        .filter(ok)
        .ok_or_else(|| expected(what))
}

/// One of `choices` by its name (`name`), or what the valid names are.
fn by_name<K: Copy>(text: &str, choices: &[K], name: fn(K) -> &'static str) -> Result<K, String> {
    choices
        .iter()
        .copied()
        .find(|&k| name(k) == text)
        .ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|&k| name(k)).collect();
            format!("expected one of {}, found {text:?}", names.join(", "))
        })
}

/// A matmul kernel by name: `auto` or one of `MatmulKernel::CONCRETE`.
pub fn matmul_kernel(text: &str) -> Result<MatmulKernel, String> {
    let mut all = MatmulKernel::CONCRETE.to_vec();
    all.push(MatmulKernel::Auto);
    by_name(text, &all, MatmulKernel::name)
}

/// An attention kernel by name: `auto` or one of `AttentionKernel::CONCRETE`.
pub fn attention_kernel(text: &str) -> Result<AttentionKernel, String> {
    let mut all = AttentionKernel::CONCRETE.to_vec();
    all.push(AttentionKernel::Auto);
    by_name(text, &all, AttentionKernel::name)
}

/// A whole number >= 1.
pub fn positive(text: &str) -> Result<usize, String> {
    parsed(text, |&n| n >= 1, "a whole number >= 1")
}

/// A whole number >= 0.
pub fn whole(text: &str) -> Result<usize, String> {
    parsed(text, |_| true, "a whole number >= 0")
}

/// A seed: a whole number >= 0.
pub fn seed(text: &str) -> Result<u64, String> {
    parsed(text, |_| true, "a whole number >= 0")
}

/// A finite number >= 0.
pub fn non_negative(text: &str) -> Result<f32, String> {
    parsed(text, |t: &f32| t.is_finite() && *t >= 0.0, "a number >= 0")
}

/// A share: a number from 0 to 1.
pub fn share(text: &str) -> Result<f32, String> {
    parsed(
        text,
        |t: &f32| (0.0..=1.0).contains(t),
        "a number from 0 to 1",
    )
}

/// dLLM-Cache's V-verify rule by name.
pub fn verify_pick(text: &str) -> Result<unmask_core::adaptive::VerifyPick, String> {
    text.parse()
        .map_err(|e: unmask_core::adaptive::AdaptiveError| e.to_string())
}

/// A comma-separated list of shares (numbers from 0 to 1).
pub fn shares(text: &str) -> Result<Vec<f32>, String> {
    text.split(',').map(|t| share(t.trim())).collect()
}

/// A comma-separated list of whole numbers >= 1.
pub fn positives(text: &str) -> Result<Vec<usize>, String> {
    text.split(',').map(|t| positive(t.trim())).collect()
}

/// A number > 0.
pub fn positive_number(text: &str) -> Result<f64, String> {
    parsed(text, |&v| v > 0.0, "a number > 0")
}

/// A duration in seconds, > 0 and at most a day (e.g. 2.5).
pub fn seconds(text: &str) -> Result<std::time::Duration, String> {
    parsed(
        text,
        |&v: &f64| v > 0.0 && v <= 86_400.0,
        "a number of seconds in (0, 86400]",
    )
    .map(std::time::Duration::from_secs_f64)
}

/// A number in (0, 1].
pub fn fraction<T: FromStr + PartialOrd + From<u8>>(text: &str) -> Result<T, String> {
    parsed(
        text,
        |t: &T| *t > T::from(0) && *t <= T::from(1),
        "a number in (0, 1]",
    )
}

/// Comma-separated values, each checked by `parse`; `what` describes a valid list.
pub fn list<T>(
    text: &str,
    what: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Vec<T>, String> {
    text.split(',')
        .map(|part| parse(part.trim()).ok_or_else(|| expected(what)))
        .collect()
}

/// `ID=BIAS`: a token id and the bias its logit takes, -100 to 100.
pub fn token_bias(text: &str) -> Result<(u32, f32), String> {
    let limit = unmask_core::sampler::bias::BIAS_LIMIT;
    let expected = format!("ID=BIAS, a token id and a bias from -{limit} to {limit}");
    let (id, bias) = text.split_once('=').ok_or_else(|| expected.clone())?;
    match (id.trim().parse::<u32>(), bias.trim().parse::<f32>()) {
        (Ok(id), Ok(b)) if b.is_finite() && b.abs() <= limit => Ok((id, b)),
        _ => Err(expected),
    }
}

/// A presence or frequency penalty, -2 to 2.
pub fn penalty(text: &str) -> Result<f32, String> {
    let limit = unmask_core::sampler::bias::PENALTY_LIMIT;
    match text.parse::<f32>() {
        Ok(p) if p.is_finite() && p.abs() <= limit => Ok(p),
        _ => Err(format!("expected a number from -{limit} to {limit}")),
    }
}

/// A repetition penalty: from `1 / REPETITION_LIMIT` to `REPETITION_LIMIT` (1: none).
pub fn repetition_penalty(text: &str) -> Result<f32, String> {
    let limit = unmask_core::sampler::bias::REPETITION_LIMIT;
    parsed(
        text,
        |r: &f32| (1.0 / limit..=limit).contains(r),
        &format!("a number from {} to {limit} (1: none)", 1.0 / limit),
    )
}

/// A comma-separated list of token ids (`1,2,3`; spaces allowed).
pub fn token_ids(text: &str) -> Result<Vec<u32>, String> {
    list(text, "comma-separated token ids such as 1,2,3", |id| {
        id.parse().ok()
    })
}

/// A comma-separated list of whole numbers >= 1.
pub fn positive_list(text: &str) -> Result<Vec<usize>, String> {
    list(
        text,
        "comma-separated whole numbers >= 1 such as 2,4,8",
        |n| n.parse().ok().filter(|&n| n >= 1),
    )
}

/// Kernel names for `bench --kernels`: matmul and attention kernels (`unmask info` lists
/// them) and `unfused`, the unfused baseline.
pub fn kernel_names(text: &str) -> Result<Vec<String>, String> {
    let mut known: Vec<&str> = MatmulKernel::CONCRETE
        .iter()
        .map(|k| k.name())
        .chain(AttentionKernel::CONCRETE.iter().map(|k| k.name()))
        .chain(["unfused"])
        .collect();
    known.sort_unstable();
    known.dedup();
    text.split(',')
        .map(|name| {
            let name = name.trim();
            if known.contains(&name) {
                Ok(name.to_string())
            } else {
                Err(format!(
                    "no kernel named {name:?} (expected some of {})",
                    known.join(", ")
                ))
            }
        })
        .collect()
}

/// A size in bytes > 0, with an optional K, M or G (`parse_bytes`).
pub fn byte_size(text: &str) -> Result<u64, String> {
    parse_bytes(text.trim()).filter(|&b| b > 0).ok_or_else(|| {
        expected("a size in bytes > 0 such as 6G, 512M or 1000000 (K, M, G are powers of 1024)")
    })
}

/// `TOKENS[,BYTES]`; the bytes limit is the engine's default when only tokens are given.
pub fn cache_budget(text: &str) -> Result<CacheBudget, String> {
    let default_bytes = EngineOptions::default().cache_budget.max_bytes;
    parse_cache_budget(text, default_bytes).ok_or_else(|| {
        expected("TOKENS or TOKENS,BYTES such as 5000 or 5000,2G (BYTES may end in K, M or G)")
    })
}

/// A GPU backend name as `unmask_gpu::parse_backend` takes it, kept as given.
pub fn backend(text: &str) -> Result<String, String> {
    unmask_gpu::parse_backend(text)
        .map(|_| text.to_string())
        .map_err(|_| expected("one of vulkan, metal, dx12, gl, webgpu, all"))
}

/// One of `names`, turned into its value by `parse` (which must accept every name). Clap
/// lists the names when another is given, and shell completions offer them.
pub fn choice<T: Clone + Send + Sync + 'static>(
    names: impl IntoIterator<Item = &'static str>,
    parse: fn(&str) -> Option<T>,
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(names).map(move |name| parse(&name).expect("a listed name"))
}

/// One cache mode.
pub fn cache_mode() -> impl TypedValueParser<Value = CacheMode> {
    choice(CacheMode::ALL.map(CacheMode::name), |name| {
        name.parse().ok()
    })
}

/// `MODE[,MODE...]` in the order given, or `all`.
pub fn cache_modes(text: &str) -> Result<Vec<CacheMode>, String> {
    if text.trim() == "all" {
        return Ok(CacheMode::ALL.to_vec());
    }
    let mut modes = Vec::new();
    for part in text.split(',').map(str::trim) {
        let mode = part.parse::<CacheMode>().map_err(|_| {
            if part.is_empty() {
                expected(CACHE_MODES_EXPECTED)
            } else {
                format!("`{part}` is not a cache mode (expected {CACHE_MODES_EXPECTED})")
            }
        })?;
        if modes.contains(&mode) {
            return Err(format!("{mode} is listed more than once"));
        }
        modes.push(mode);
    }
    Ok(modes)
}

/// `TOKENS[,BYTES]`, BYTES with an optional K, M or G (powers of 1024); the bytes limit
/// stays `default_bytes` when only tokens are given.
fn parse_cache_budget(text: &str, default_bytes: u64) -> Option<CacheBudget> {
    let (tokens, bytes) = match text.split_once(',') {
        Some((t, b)) => (t, Some(b)),
        None => (text, None),
    };
    let max_tokens = tokens.trim().parse::<usize>().ok()?;
    let max_bytes = match bytes {
        None => default_bytes,
        Some(b) => parse_bytes(b.trim())?,
    };
    Some(CacheBudget {
        max_tokens,
        max_bytes,
    })
}

/// `512`, `64K`, `1.5G`: bytes with an optional binary suffix (a trailing `B` or `iB` is
/// accepted too).
fn parse_bytes(text: &str) -> Option<u64> {
    let upper = text.to_ascii_uppercase();
    let body = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (number, scale) = match body.chars().last()? {
        'K' => (&body[..body.len() - 1], 1u64 << 10),
        'M' => (&body[..body.len() - 1], 1 << 20),
        'G' => (&body[..body.len() - 1], 1 << 30),
        _ => (body, 1),
    };
    let number = number.trim();
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(scale);
    }
    let f = number.parse::<f64>().ok()?;
    let bytes = f * scale as f64;
    (f.is_finite() && f >= 0.0 && bytes < u64::MAX as f64).then(|| bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_budgets_take_tokens_and_optional_bytes() {
        let b = |t: &str| parse_cache_budget(t, 7).map(|b| (b.max_tokens, b.max_bytes));
        assert_eq!(b("5000"), Some((5000, 7)));
        assert_eq!(b("5000,2G"), Some((5000, 2 << 30)));
        assert_eq!(b(" 4 , 512 "), Some((4, 512)));
        assert_eq!(b("10,64K"), Some((10, 64 << 10)));
        assert_eq!(b("10,1.5m"), Some((10, 3 << 19)));
        assert_eq!(b("10,3MiB"), Some((10, 3 << 20)));
        assert_eq!(b("10,100B"), Some((10, 100)));
        for bad in ["", "x", "-1", "4,", "4,G", "4,-2K", "4,2T", "4,2,3"] {
            assert_eq!(b(bad), None, "{bad}");
        }
    }

    #[test]
    fn numbers_say_what_they_expect() {
        assert_eq!(positive(" 8 "), Ok(8));
        assert_eq!(positive("0"), Err("expected a whole number >= 1".into()));
        assert_eq!(whole("-1"), Err("expected a whole number >= 0".into()));
        assert!(non_negative("inf").is_err());
        assert_eq!(fraction::<f32>("1"), Ok(1.0));
        assert!(fraction::<f64>("0").is_err());
        assert!(fraction::<f64>("NaN").is_err());
        assert_eq!(byte_size("64K"), Ok(64 << 10));
        assert!(byte_size("0").is_err());
    }

    #[test]
    fn lists() {
        assert_eq!(token_ids("1, 2,3"), Ok(vec![1, 2, 3]));
        assert!(token_ids("1,,3").is_err());
        assert_eq!(positive_list("2,4"), Ok(vec![2, 4]));
        assert!(positive_list("2,0").is_err());
    }

    #[test]
    fn cache_mode_lists_name_the_bad_part() {
        assert_eq!(cache_modes("all"), Ok(CacheMode::ALL.to_vec()));
        assert_eq!(
            cache_modes("bicache, none"),
            Ok(vec![CacheMode::Bicache, CacheMode::None])
        );
        assert!(
            cache_modes("all,none")
                .unwrap_err()
                .contains("`all` is not")
        );
        assert!(cache_modes("none,bicash").unwrap_err().contains("`bicash`"));
        assert!(
            cache_modes("none,none")
                .unwrap_err()
                .contains("more than once")
        );
        assert!(
            cache_modes("none,")
                .unwrap_err()
                .starts_with("expected `all`")
        );
    }
}
