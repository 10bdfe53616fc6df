//! Who may use the public port ([auth]): API keys, sent as `Authorization: Bearer KEY` (REST)
//! or gRPC metadata `authorization`.
//!
//! The keys come from `[auth] api_keys_file` (one per line; `#` comments and blank lines
//! ignored; the file must not be readable or writable by group or others) and from the
//! environment variable `INFERD_API_KEYS` (separated by commas or white space); several at
//! once, so a new key can be added before an old one is retired. The supervisor reads them at
//! start and at every reload; workers get their SHA-256 digests only, and compare the digest
//! of a presented key with each in constant time.
//!
//! A line of the file may follow its key with settings ([`KeySettings`]): `KEY name=bulk
//! priority=9 rate=50/s burst=100 concurrency=4`. A plain line is a key with the defaults.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::ConfigError;

pub const API_KEYS_ENV: &str = "INFERD_API_KEYS";
/// Keys shorter than this are refused: they are guessable.
pub const MIN_KEY_LEN: usize = 16;
/// A keys file larger than this is refused (a key file holds a few lines).
const MAX_FILE_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// One key per line (relative: to the config file's folder).
    pub api_keys_file: Option<PathBuf>,
    /// Health and readiness routes (`/v2/health/*`, `/v2/models/NAME/ready`, `/health`,
    /// `/ping`, gRPC's ServerLive, ServerReady, ModelReady) need a key too; by
    /// default they are open, for load balancers' and Kubernetes' probes.
    pub protect_health: bool,
    /// API categories that need a header besides ([`crate::restricted`]).
    pub restricted: Vec<crate::restricted::RestrictedGroup>,
}

/// The keys a worker checks requests against: digests, never the keys themselves, each with
/// its settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKeys {
    pub keys: Vec<([u8; 32], KeySettings)>,
    pub protect_health: bool,
}

/// A key's settings: the words after it on its line, `name=NAME`, `priority=N`, `rate=N/s`
/// (or `/min`, `/h`), `burst=N` and `concurrency=N`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySettings {
    /// What the access log, metrics and traces call the key (never the key itself); by
    /// default `key-` and the first 8 hex digits of its SHA-256. Keys of one name share their
    /// limits.
    pub name: String,
    /// The highest priority its requests get (0, the default, the highest): a request that
    /// asks for a higher one (`x-inferd-priority`) is served at this one.
    pub priority: u8,
    /// Requests it may send, pool-wide: a sustained rate with a burst (429 beyond).
    #[serde(default)]
    pub rate: Option<KeyRate>,
    /// Requests it may have in flight at once, pool-wide (429 beyond).
    #[serde(default)]
    pub concurrency: Option<u32>,
}

/// A key's rate: `count` requests per `per`, and `burst` at once (by default one second's
/// worth, at least 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRate {
    pub count: u32,
    pub per: RatePeriod,
    pub burst: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RatePeriod {
    Second,
    Minute,
    Hour,
}

impl RatePeriod {
    pub fn seconds(self) -> u64 {
        match self {
            RatePeriod::Second => 1,
            RatePeriod::Minute => 60,
            RatePeriod::Hour => 3600,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RatePeriod::Second => "s",
            RatePeriod::Minute => "min",
            RatePeriod::Hour => "h",
        }
    }
}

impl KeyRate {
    /// Most requests a rate may allow per second.
    pub const MAX_PER_SECOND: u64 = 1_000_000;

    /// Nanoseconds between two requests at the sustained rate.
    pub fn interval_ns(&self) -> u64 {
        self.per.seconds() * 1_000_000_000 / self.count.max(1) as u64
    }
}

impl std::fmt::Display for KeyRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (burst {})", self.count, self.per.as_str(), self.burst)
    }
}

/// Why a keys file, `INFERD_API_KEYS` or a key's settings cannot be used. No message shows a
/// key: a short or odd one is told by its length.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("{}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error(
        "{} has mode {mode:o}: a keys file must not be readable or writable by group or others (chmod 600, \
         owned by the service's user)",
        path.display()
    )]
    NotPrivate { path: PathBuf, mode: u32 },
    #[error("{} is {bytes} bytes; a keys file may have at most {MAX_FILE_BYTES}", path.display())]
    TooLarge { path: PathBuf, bytes: u64 },
    #[error("{} holds no key (one per line; # starts a comment)", path.display())]
    Empty { path: PathBuf },
    #[error("a key of {0} characters; keys must have at least {MIN_KEY_LEN} (e.g. `openssl rand -hex 32`)")]
    Short(usize),
    #[error("a key of {0} characters has a character that is not visible ASCII")]
    NotVisible(usize),
    #[error("key name '{0}' must be 1 to {MAX_NAME_BYTES} visible ASCII characters")]
    Name(String),
    #[error("key {key}: {what}={value} is not a whole number above 0")]
    NotWhole { key: String, what: &'static str, value: String },
    #[error("key {key}: priority={value} is not a whole number from 0 (the highest) to 255")]
    Priority { key: String, value: String },
    #[error("key {key}: rate={rate} is not requests per period (e.g. rate=100/s, rate=600/min, rate=1000/h)")]
    Rate { key: String, rate: String },
    #[error("key {key}: rate={rate} is more than {} per second", KeyRate::MAX_PER_SECOND)]
    RateTooHigh { key: String, rate: String },
    #[error("key {key}: burst= needs a rate= beside it")]
    BurstWithoutRate { key: String },
    #[error(
        "key {key}: '{word}' is not a setting (a key's line is `KEY [name=NAME] [priority=N] \
         [rate=N/s|min|h] [burst=N] [concurrency=N]`)"
    )]
    Setting { key: String, word: String },
}

/// Longest key name (the pool's limits table keeps this many bytes of it).
pub const MAX_NAME_BYTES: usize = 64;

impl KeySettings {
    /// The settings of `words` (a line's after its key), for the key of `digest`.
    fn parse(words: &[&str], digest: &[u8; 32]) -> Result<KeySettings, KeysError> {
        let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
        let mut settings = KeySettings { name: format!("key-{hex}"), ..Default::default() };
        let mut burst = None;
        for word in words {
            let whole = |n: &str, what: &'static str| -> Result<u32, KeysError> {
                n.parse().ok().filter(|&n| n > 0).ok_or_else(|| KeysError::NotWhole {
                    key: settings.name.clone(),
                    what,
                    value: n.to_string(),
                })
            };
            match word.split_once('=') {
                Some(("name", name))
                    if !name.is_empty()
                        && name.len() <= MAX_NAME_BYTES
                        && name.bytes().all(|b| b.is_ascii_graphic()) =>
                {
                    settings.name = name.to_string()
                }
                Some(("name", name)) => return Err(KeysError::Name(name.to_string())),
                Some(("priority", n)) => {
                    settings.priority = n
                        .parse()
                        .map_err(|_| KeysError::Priority { key: settings.name.clone(), value: n.to_string() })?
                }
                Some(("rate", rate)) => {
                    let (count, per) = rate.split_once('/').unwrap_or((rate, ""));
                    let per = match per {
                        "s" | "sec" | "second" => RatePeriod::Second,
                        "m" | "min" | "minute" => RatePeriod::Minute,
                        "h" | "hour" => RatePeriod::Hour,
                        _ => return Err(KeysError::Rate { key: settings.name.clone(), rate: rate.to_string() }),
                    };
                    let count = whole(count, "rate")?;
                    if count as u64 > KeyRate::MAX_PER_SECOND * per.seconds() {
                        return Err(KeysError::RateTooHigh { key: settings.name.clone(), rate: rate.to_string() });
                    }
                    settings.rate = Some(KeyRate { count, per, burst: 0 });
                }
                Some(("burst", n)) => burst = Some(whole(n, "burst")?),
                Some(("concurrency", n)) => settings.concurrency = Some(whole(n, "concurrency")?),
                _ => return Err(KeysError::Setting { key: settings.name.clone(), word: word.to_string() }),
            }
        }
        match (&mut settings.rate, burst) {
            (Some(rate), burst) => {
                let second = (rate.count as u64).div_ceil(rate.per.seconds()).max(1) as u32;
                rate.burst = burst.unwrap_or(second);
            }
            (None, Some(_)) => return Err(KeysError::BurstWithoutRate { key: settings.name.clone() }),
            (None, None) => {}
        }
        Ok(settings)
    }

    /// Whether requests of the key are limited (rate or concurrency).
    pub fn limited(&self) -> bool {
        self.rate.is_some() || self.concurrency.is_some()
    }
}

/// What the supervisor reads for the public port at start and at every reload, and every
/// worker of that generation serves with: the API keys, the TLS certificate, and the key the
/// models it loads must be signed with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Access {
    pub api_keys: Option<ApiKeys>,
    pub tls: Option<crate::tls::Tls>,
    #[serde(default)]
    pub signatures: crate::signing::Trust,
    /// The categories that need a header ([[auth.restricted]]).
    #[serde(default)]
    pub restricted: crate::restricted::Restrictions,
}

/// Why a request was refused (the `reason` label of the refusal counter and the access log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header (or metadata).
    Missing,
    /// A key that is none of the configured ones.
    Invalid,
}

impl Refusal {
    /// Every reason, in the order of their counters (`inferd_ipc::stats`).
    pub const ALL: [Refusal; 2] = [Refusal::Missing, Refusal::Invalid];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Invalid => "invalid",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ApiKeys {
    /// The keys the configuration names (`api_keys_file`, resolved by the caller) and the
    /// environment gives; None when neither names any (every request is served).
    pub fn load(file: Option<&Path>, protect_health: bool) -> Result<Option<ApiKeys>, ConfigError> {
        let invalid = |error: KeysError| ConfigError::Invalid { key: "auth.api_keys_file", message: error.to_string() };
        let mut keys = Vec::new();
        if let Some(path) = file {
            keys.extend(read_file(path).map_err(invalid)?);
        }
        if let Ok(value) = std::env::var(API_KEYS_ENV) {
            let from_env: Vec<String> = value
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect();
            if from_env.is_empty() {
                return Err(ConfigError::Invalid { key: "INFERD_API_KEYS", message: "is set but holds no key".into() });
            }
            keys.extend(from_env);
        }
        if file.is_none() && keys.is_empty() {
            return Ok(None);
        }
        ApiKeys::of(&keys, protect_health).map(Some).map_err(invalid)
    }

    /// The keys of one file alone (the admin token file); `protect_health` as given.
    pub fn from_file(path: &Path, protect_health: bool) -> Result<ApiKeys, KeysError> {
        ApiKeys::of(&read_file(path)?, protect_health)
    }

    /// `lines` (a key, then its settings), checked (long enough, visible ASCII), as their
    /// digests and settings.
    fn of(lines: &[String], protect_health: bool) -> Result<ApiKeys, KeysError> {
        let split: Vec<Vec<&str>> = lines.iter().map(|l| l.split_whitespace().collect()).collect();
        let keys: Vec<&str> = split.iter().filter_map(|words| words.first().copied()).collect();
        if let Some(short) = keys.iter().find(|k| k.len() < MIN_KEY_LEN) {
            return Err(KeysError::Short(short.len()));
        }
        if let Some(bad) = keys.iter().find(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
            return Err(KeysError::NotVisible(bad.len()));
        }
        let mut entries = Vec::with_capacity(keys.len());
        for words in split.iter().filter(|w| !w.is_empty()) {
            let d = digest(words[0].as_bytes());
            entries.push((d, KeySettings::parse(&words[1..], &d)?));
        }
        entries.sort_by_key(|e| e.0);
        entries.dedup_by(|a, b| a.0 == b.0);
        Ok(ApiKeys { keys: entries, protect_health })
    }

    /// The settings of `presented` if it is one of the keys: its digest compared with every
    /// one, each in constant time, so neither the match nor how much of it matched shows in
    /// the time.
    pub fn check(&self, presented: Option<&[u8]>) -> Result<&KeySettings, Refusal> {
        let presented = presented.ok_or(Refusal::Missing)?;
        let d = digest(presented);
        let mut found = None;
        for (k, settings) in &self.keys {
            if equal(k, &d) {
                found = Some(settings);
            }
        }
        found.ok_or(Refusal::Invalid)
    }

    /// How many keys, for logs and `inferd check`.
    pub fn describe(&self) -> String {
        let n = self.keys.len();
        format!(
            "{n} API key{}, health routes {}",
            if n == 1 { "" } else { "s" },
            if self.protect_health { "protected" } else { "open" }
        )
    }
}

/// The key in an `Authorization` header value: `Bearer KEY` (the scheme in any case).
pub fn bearer(header: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = header.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| rest.trim_ascii()).filter(|k| !k.is_empty())
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

fn equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box: the optimiser may not turn the fold into an early exit.
    std::hint::black_box(diff) == 0
}

fn read_file(path: &Path) -> Result<Vec<String>, KeysError> {
    use std::os::unix::fs::MetadataExt;
    let unreadable = |error| KeysError::Read { path: path.to_path_buf(), error };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(KeysError::NotAFile { path: path.to_path_buf() });
    }
    if meta.mode() & 0o077 != 0 {
        return Err(KeysError::NotPrivate { path: path.to_path_buf(), mode: meta.mode() & 0o777 });
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(KeysError::TooLarge { path: path.to_path_buf(), bytes: meta.len() });
    }
    let text = std::fs::read_to_string(path).map_err(unreadable)?;
    let keys: Vec<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    if keys.is_empty() {
        return Err(KeysError::Empty { path: path.to_path_buf() });
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_by_digest_and_the_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("inferd-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# rotated 2026-12-01\nfirst-key-0123456789\n\n  second-key-0123456789  \n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = ApiKeys::load(Some(&file), false).unwrap_err().to_string();
        assert!(e.contains("mode 640") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let keys = ApiKeys::load(Some(&file), false).unwrap().unwrap();
        assert_eq!(keys.keys.len(), 2);
        assert_eq!(keys.check(Some(b"first-key-0123456789")).unwrap().priority, 0);
        assert!(keys.check(Some(b"second-key-0123456789")).unwrap().name.starts_with("key-"));
        assert_eq!(keys.check(Some(b"first-key-012345678")), Err(Refusal::Invalid));
        assert_eq!(keys.check(None), Err(Refusal::Missing));
        // A line may carry the key's settings.
        std::fs::write(
            &file,
            "first-key-0123456789 name=bulk priority=9 rate=600/min concurrency=2\nsecond-key-0123456789 rate=5/s burst=20\n",
        )
        .unwrap();
        let keys = ApiKeys::load(Some(&file), false).unwrap().unwrap();
        let bulk = keys.check(Some(b"first-key-0123456789")).unwrap();
        assert_eq!((bulk.name.as_str(), bulk.priority, bulk.concurrency), ("bulk", 9, Some(2)));
        // 600/min: 100 ms apart, and a burst of one second's worth.
        let rate = bulk.rate.unwrap();
        assert_eq!(
            (rate.interval_ns(), rate.burst, rate.to_string().as_str()),
            (100_000_000, 10, "600/min (burst 10)")
        );
        let other = keys.check(Some(b"second-key-0123456789")).unwrap();
        assert_eq!(
            (other.rate.unwrap().interval_ns(), other.rate.unwrap().burst, other.concurrency),
            (200_000_000, 20, None)
        );
        for (line, says) in [
            ("first-key-0123456789 rate=5", "rate=5 is not requests per period"),
            ("first-key-0123456789 rate=0/s", "rate=0 is not a whole number above 0"),
            ("first-key-0123456789 rate=2000000/s", "more than 1000000 per second"),
            ("first-key-0123456789 burst=5", "burst= needs a rate="),
            ("first-key-0123456789 concurrency=-1", "concurrency=-1"),
            (&format!("first-key-0123456789 name={}", "n".repeat(65)), "must be 1 to 64 visible ASCII characters"),
            ("first-key-0123456789 speed=5", "'speed=5' is not a setting"),
            ("first-key-0123456789 priority=300", "priority=300"),
        ] {
            std::fs::write(&file, format!("{line}\n")).unwrap();
            let e = ApiKeys::load(Some(&file), false).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
            assert!(!e.contains("first-key-0123456789"), "the key itself is never said: {e}");
        }
        std::fs::write(&file, "short\n").unwrap();
        let e = ApiKeys::load(Some(&file), false).unwrap_err().to_string();
        assert!(e.contains("at least 16"), "{e}");
        std::fs::write(&file, "# none\n").unwrap();
        assert!(ApiKeys::load(Some(&file), false).unwrap_err().to_string().contains("holds no key"));
        assert_eq!(ApiKeys::load(None, false).unwrap(), None);
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"Bear"), None);
    }
}
