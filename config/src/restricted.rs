//! APIs restricted to requests that carry a header (`[[auth.restricted]]`): Triton's
//! `--http-restricted-api` and `--grpc-restricted-protocol`, for both protocols at once.
//!
//! Each group names some of Triton's API categories and the header (and its value) a request
//! to them must carry, for example the repository's load and unload for an operator's tools
//! alone. Over HTTP the header is sent as named; over gRPC as `triton-grpc-protocol-NAME`
//! (Triton's prefix, which its clients' metadata carries). It is a shared secret in the
//! configuration file, as Triton's is on its command line: API keys ([auth] api_keys_file)
//! are the way to tell clients apart.

use serde::{Deserialize, Serialize};

/// The prefix of a restriction's header in gRPC metadata (Triton's).
pub const GRPC_PREFIX: &str = "triton-grpc-protocol-";

/// Triton's API categories, which routes and RPCs belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Api {
    Health,
    Metadata,
    Inference,
    SharedMemory,
    ModelConfig,
    ModelRepository,
    Statistics,
    Trace,
    Logging,
}

impl Api {
    pub const ALL: [Api; 9] = [
        Api::Health,
        Api::Metadata,
        Api::Inference,
        Api::SharedMemory,
        Api::ModelConfig,
        Api::ModelRepository,
        Api::Statistics,
        Api::Trace,
        Api::Logging,
    ];

    /// Its name, as Triton's flags and `[[auth.restricted]] apis` write it.
    pub fn name(self) -> &'static str {
        match self {
            Api::Health => "health",
            Api::Metadata => "metadata",
            Api::Inference => "inference",
            Api::SharedMemory => "shared-memory",
            Api::ModelConfig => "model-config",
            Api::ModelRepository => "model-repository",
            Api::Statistics => "statistics",
            Api::Trace => "trace",
            Api::Logging => "logging",
        }
    }
}

/// One `[[auth.restricted]]` group, as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestrictedGroup {
    /// Categories: health, metadata, inference, shared-memory, model-config,
    /// model-repository, statistics, trace, logging.
    pub apis: Vec<String>,
    /// The header a request to them must carry (over gRPC, with [`GRPC_PREFIX`] before it).
    pub header: String,
    /// Its value.
    pub value: String,
}

/// The header, and its value, a request to a restricted category must carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restriction {
    /// Lower case, as HTTP/2 and hyper keep header names.
    pub header: String,
    pub value: String,
}

impl Restriction {
    /// Whether `presented` (the header's value, if the request has it) is the value, compared
    /// in constant time.
    pub fn admits(&self, presented: Option<&[u8]>) -> bool {
        let Some(presented) = presented else { return false };
        let expected = self.value.as_bytes();
        let diff = expected.iter().zip(presented).fold(0u8, |acc, (x, y)| acc | (x ^ y));
        // black_box: the optimiser may not turn the fold into an early exit.
        presented.len() == expected.len() && std::hint::black_box(diff) == 0
    }
}

/// Which categories are restricted, and how ([`Restrictions::of`] the configuration's groups).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restrictions(Vec<(Api, Restriction)>);

impl Restrictions {
    /// The groups' restrictions, or why they cannot be (Triton's words where it has them): an
    /// unknown category, one in two groups, a header that is not a header name or is one inferd
    /// reads itself, an empty value.
    pub fn of(groups: &[RestrictedGroup]) -> Result<Restrictions, String> {
        let mut restrictions: Vec<(Api, Restriction)> = Vec::new();
        for group in groups {
            let header = group.header.to_ascii_lowercase();
            let name_ok = !header.is_empty()
                && header.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.!#$%&'*+^`|~".contains(&b));
            if !name_ok {
                return Err(format!("'{}' is not a header name", group.header));
            }
            if ["authorization", "content-type", "content-length", "te", "host"].contains(&header.as_str())
                || header.starts_with("grpc-")
            {
                return Err(format!("'{}' is a header the protocols use themselves; name another", group.header));
            }
            if group.value.is_empty() || !group.value.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
                return Err(format!("the value of header '{}' must be visible ASCII, and not empty", group.header));
            }
            if group.apis.is_empty() {
                return Err(format!("the group of header '{}' names no api", group.header));
            }
            for name in &group.apis {
                let api = Api::ALL.into_iter().find(|a| a.name() == name).ok_or_else(|| {
                    let known: Vec<&str> = Api::ALL.iter().map(|a| a.name()).collect();
                    format!("unknown restricted api '{name}' (one of {})", known.join(", "))
                })?;
                if restrictions.iter().any(|(a, _)| *a == api) {
                    return Err(format!("api '{name}' can not be specified in multiple config groups"));
                }
                restrictions.push((api, Restriction { header: header.clone(), value: group.value.clone() }));
            }
        }
        Ok(Restrictions(restrictions))
    }

    /// What a request to `api` must carry; None: it is open.
    pub fn of_api(&self, api: Api) -> Option<&Restriction> {
        self.0.iter().find(|(a, _)| *a == api).map(|(_, r)| r)
    }

    /// `inferd check`'s line: the categories restricted, by header (never the value).
    pub fn describe(&self) -> Option<String> {
        let mut headers: Vec<&str> = Vec::new();
        for (_, r) in &self.0 {
            if !headers.contains(&r.header.as_str()) {
                headers.push(&r.header);
            }
        }
        let lines: Vec<String> = headers
            .iter()
            .map(|h| {
                let apis: Vec<&str> = self.0.iter().filter(|(_, r)| r.header == *h).map(|(a, _)| a.name()).collect();
                format!("{} need header '{h}'", apis.join(", "))
            })
            .collect();
        (!lines.is_empty()).then(|| lines.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(apis: &[&str], header: &str, value: &str) -> RestrictedGroup {
        RestrictedGroup {
            apis: apis.iter().map(|a| a.to_string()).collect(),
            header: header.into(),
            value: value.into(),
        }
    }

    #[test]
    fn groups_give_each_category_its_header_and_refuse_what_triton_refuses() {
        let r = Restrictions::of(&[
            group(&["model-repository"], "Admin-Key", "admin-value"),
            group(&["inference", "health"], "infer-key", "infer-value"),
        ])
        .unwrap();
        let admin = r.of_api(Api::ModelRepository).unwrap();
        assert_eq!(admin.header, "admin-key");
        assert!(admin.admits(Some(b"admin-value")));
        assert!(!admin.admits(Some(b"admin-valu")));
        assert!(!admin.admits(Some(b"admin-value2")));
        assert!(!admin.admits(None));
        assert_eq!(r.of_api(Api::Health).unwrap().header, "infer-key");
        assert!(r.of_api(Api::Statistics).is_none());
        assert_eq!(
            r.describe().unwrap(),
            "model-repository need header 'admin-key'; inference, health need header 'infer-key'"
        );

        let twice =
            Restrictions::of(&[group(&["model-repository", "health"], "k1", "v1"), group(&["health"], "k2", "v2")]);
        assert_eq!(twice.unwrap_err(), "api 'health' can not be specified in multiple config groups");
        let unknown = Restrictions::of(&[group(&["model-reposit"], "k1", "v1")]).unwrap_err();
        assert!(unknown.starts_with("unknown restricted api 'model-reposit'"), "{unknown}");
        assert!(Restrictions::of(&[group(&["health"], "bad header", "v")]).is_err());
        assert!(Restrictions::of(&[group(&["health"], "authorization", "v")]).is_err());
        assert!(Restrictions::of(&[group(&["health"], "k", "")]).is_err());
        assert!(Restrictions::of(&[group(&[], "k", "v")]).is_err());
        assert_eq!(Restrictions::of(&[]).unwrap().describe(), None);
    }
}
