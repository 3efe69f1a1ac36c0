//! Method + path -> action, and the action's JSON body -> its struct.
//! Pure functions: the HTTP layer's bad-request answers come from here,
//! testable (and fuzzable) without a socket.

use serde::de::DeserializeOwned;

use super::{ApiError, ApiRequest};

/// The path prefix of every endpoint.
pub const PREFIX: &str = "/api/v1/";

/// Every endpoint: (action, method). `docs/openapi.yaml` describes exactly
/// these (a test checks it).
pub const ROUTES: &[(&str, &str)] = &[
    ("vmm.ping", "GET"),
    ("vmm.shutdown", "PUT"),
    ("vm.create", "PUT"),
    ("vm.boot", "PUT"),
    ("vm.info", "GET"),
    ("vm.pause", "PUT"),
    ("vm.resume", "PUT"),
    ("vm.shutdown", "PUT"),
    ("vm.reboot", "PUT"),
    ("vm.delete", "PUT"),
    ("vm.add-pmem", "PUT"),
    ("vm.remove-device", "PUT"),
    ("vm.pmem-snapshot", "PUT"),
    ("vm.pmem-overlay", "PUT"),
    ("vm.pmem-rollback", "PUT"),
    ("vm.pmem-snapshot-delete", "PUT"),
    ("vm.pmem-flush", "PUT"),
    ("vm.pmem-info", "GET"),
];

fn json<T: DeserializeOwned>(action: &str, body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::new(
            400,
            format!("{action}: the request needs a JSON body"),
        ));
    }
    // Unknown fields are ignored (and logged), as upstream does.
    crate::config::from_json(body)
        .map_err(|e| ApiError::with_source(400, format!("{action}: invalid request body"), &e))
}

fn no_body(action: &str, body: &[u8]) -> Result<(), ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        Ok(())
    } else {
        Err(ApiError::new(
            400,
            format!("{action}: this action takes no request body"),
        ))
    }
}

/// The endpoint of `path` (query string ignored): its action and method.
fn endpoint(path: &str) -> Option<(&'static str, &'static str)> {
    let path = path.split('?').next().unwrap_or(path);
    let action = path.strip_prefix(PREFIX)?;
    ROUTES.iter().find(|(r, _)| *r == action).copied()
}

/// The method `path` allows, for the `Allow` header of a 405 answer.
pub fn allowed_method(path: &str) -> Option<&'static str> {
    endpoint(path).map(|(_, m)| m)
}

/// Routes one request. `path` may carry a query string, which no endpoint
/// uses (it is ignored).
pub fn route(method: &str, path: &str, body: &[u8]) -> Result<ApiRequest, ApiError> {
    let (action, allowed) = endpoint(path).ok_or_else(|| {
        let path = path.split('?').next().unwrap_or(path);
        ApiError::new(404, format!("unknown path {path}"))
    })?;
    if method != allowed {
        return Err(ApiError::new(
            405,
            format!("{action}: method {method} not allowed (use {allowed})"),
        ));
    }
    let nb = |r: ApiRequest| no_body(action, body).map(|()| r);
    Ok(match action {
        "vmm.ping" => nb(ApiRequest::VmmPing)?,
        "vmm.shutdown" => nb(ApiRequest::VmmShutdown)?,
        "vm.create" => ApiRequest::VmCreate(Box::new(json(action, body)?)),
        "vm.boot" => nb(ApiRequest::VmBoot)?,
        "vm.info" => nb(ApiRequest::VmInfo)?,
        "vm.pause" => nb(ApiRequest::VmPause)?,
        "vm.resume" => nb(ApiRequest::VmResume)?,
        "vm.shutdown" => nb(ApiRequest::VmShutdown)?,
        "vm.reboot" => nb(ApiRequest::VmReboot)?,
        "vm.delete" => nb(ApiRequest::VmDelete)?,
        "vm.add-pmem" => ApiRequest::VmAddPmem(Box::new(json(action, body)?)),
        "vm.remove-device" => ApiRequest::VmRemoveDevice(json(action, body)?),
        "vm.pmem-snapshot" => ApiRequest::PmemSnapshot(json(action, body)?),
        "vm.pmem-overlay" => ApiRequest::PmemOverlay(json(action, body)?),
        "vm.pmem-rollback" => ApiRequest::PmemRollback(json(action, body)?),
        "vm.pmem-snapshot-delete" => ApiRequest::PmemSnapshotDelete(json(action, body)?),
        "vm.pmem-flush" => ApiRequest::PmemFlush(json(action, body)?),
        "vm.pmem-info" => nb(ApiRequest::PmemInfo)?,
        other => return Err(ApiError::new(404, format!("unknown path {PREFIX}{other}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::PmemSnapshot;

    #[test]
    fn paths_methods_and_bodies() {
        assert_eq!(
            route("GET", "/api/v1/vmm.ping", b"").unwrap(),
            ApiRequest::VmmPing
        );
        assert_eq!(
            route("PUT", "/api/v1/vm.boot", b" \n").unwrap(),
            ApiRequest::VmBoot
        );
        assert_eq!(
            route(
                "PUT",
                "/api/v1/vm.pmem-snapshot",
                br#"{"id":"p","tag":"t"}"#
            )
            .unwrap(),
            ApiRequest::PmemSnapshot(PmemSnapshot {
                id: "p".into(),
                tag: "t".into()
            })
        );
        let e = |m, p, b: &[u8]| route(m, p, b).unwrap_err();
        assert_eq!(e("GET", "/api/v1/vm.nothing", b"").status, 404);
        assert_eq!(e("GET", "/api/v2/vmm.ping", b"").status, 404);
        assert_eq!(e("GET", "/api/v1/", b"").status, 404);
        assert_eq!(e("PUT", "/api/v1/vmm.ping", b"").status, 405);
        assert_eq!(e("GET", "/api/v1/vm.boot", b"").status, 405);
        assert_eq!(allowed_method("/api/v1/vm.boot?x=1"), Some("PUT"));
        assert_eq!(allowed_method("/api/v1/vm.info"), Some("GET"));
        assert_eq!(allowed_method("/api/v1/vm.nothing"), None);
        assert_eq!(e("PUT", "/api/v1/vm.boot", b"{}").status, 400);
        assert_eq!(e("PUT", "/api/v1/vm.pmem-snapshot", b"").status, 400);
        assert_eq!(e("PUT", "/api/v1/vm.pmem-snapshot", b"{").status, 400);
        assert_eq!(
            e("PUT", "/api/v1/vm.pmem-snapshot", br#"{"id":"p","tag":1}"#).status,
            400
        );
        let unknown = e(
            "PUT",
            "/api/v1/vm.pmem-snapshot",
            br#"{"id":"p","tag":"t","extra":1}"#,
        );
        assert_eq!(unknown.status, 400);
        assert!(unknown.chain.join(" ").contains("extra"), "{unknown:?}");
        assert_eq!(
            e("PUT", "/api/v1/vm.create", br#"{"memory":{"size":"x"}}"#).status,
            400
        );
    }

    /// The served routes are exactly the ones `docs/openapi.yaml`
    /// describes (paths under the server URL `http://localhost/api/v1`).
    #[test]
    fn routes_match_the_openapi_file() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.yaml");
        let yaml = std::fs::read_to_string(path).expect("docs/openapi.yaml");
        assert!(yaml.contains("url: http://localhost/api/v1"), "server URL");
        let mut documented = Vec::new();
        let mut current: Option<String> = None;
        let mut in_paths = false;
        for line in yaml.lines().filter(|l| !l.trim().is_empty()) {
            if !line.starts_with(' ') {
                in_paths = line.trim_end() == "paths:";
                current = None;
                continue;
            }
            if !in_paths {
                continue;
            }
            if let Some(p) = line.strip_prefix("  /").and_then(|l| l.strip_suffix(':')) {
                current = Some(p.to_owned());
            } else if let (Some(p), Some(m)) = (
                &current,
                line.strip_prefix("    ").and_then(|l| l.strip_suffix(':')),
            ) {
                if ["get", "put", "post", "delete", "patch"].contains(&m) {
                    documented.push((p.clone(), m.to_ascii_uppercase()));
                }
            }
        }
        let mut served: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(a, m)| ((*a).to_owned(), (*m).to_owned()))
            .collect();
        documented.sort();
        served.sort();
        assert_eq!(documented, served);
    }
}
