//! Method + path -> action, and the action's JSON body -> its struct.
//! Pure functions: the HTTP layer's bad-request answers come from here,
//! testable (and fuzzable) without a socket. The answers are upstream's:
//! an unknown path (a query string included) is 404 `["Not Found"]`, a
//! wrong method or a missing or unexpected body 400 `["Bad Request"]`, a
//! body that is not the action's JSON 400 `["Failed to deserialize JSON",
//! why]`.

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{ApiError, ApiRequest, Unsupported};

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
    ("vm.counters", "GET"),
    ("vm.pause", "PUT"),
    ("vm.resume", "PUT"),
    ("vm.shutdown", "PUT"),
    ("vm.reboot", "PUT"),
    ("vm.power-button", "PUT"),
    ("vm.nmi", "PUT"),
    ("vm.delete", "PUT"),
    ("vm.resize", "PUT"),
    ("vm.resize-zone", "PUT"),
    ("vm.resize-disk", "PUT"),
    ("vm.add-pmem", "PUT"),
    ("vm.add-disk", "PUT"),
    ("vm.add-fs", "PUT"),
    ("vm.add-net", "PUT"),
    ("vm.add-vsock", "PUT"),
    ("vm.add-vdpa", "PUT"),
    ("vm.add-device", "PUT"),
    ("vm.add-user-device", "PUT"),
    ("vm.add-generic-vhost-user", "PUT"),
    ("vm.remove-device", "PUT"),
    ("vm.snapshot", "PUT"),
    ("vm.restore", "PUT"),
    ("vm.coredump", "PUT"),
    ("vm.send-migration", "PUT"),
    ("vm.receive-migration", "PUT"),
    ("vm.pmem-snapshot", "PUT"),
    ("vm.pmem-overlay", "PUT"),
    ("vm.pmem-rollback", "PUT"),
    ("vm.pmem-snapshot-delete", "PUT"),
    ("vm.pmem-flush", "PUT"),
    ("vm.pmem-info", "GET"),
];

/// The upstream endpoints of devices and features this VMM does not have,
/// with what is missing (the refusal names it).
const UNSUPPORTED: &[(&str, &str)] = &[
    ("vm.resize-zone", "memory zones"),
    ("vm.resize-disk", "virtio-block devices"),
    ("vm.add-disk", "virtio-block devices"),
    ("vm.add-fs", "virtio-fs devices"),
    ("vm.add-net", "virtio-net devices"),
    ("vm.add-vsock", "virtio-vsock devices"),
    ("vm.add-vdpa", "vDPA devices"),
    ("vm.add-device", "VFIO device passthrough"),
    ("vm.add-user-device", "vfio-user devices"),
    ("vm.add-generic-vhost-user", "vhost-user devices"),
    ("vm.coredump", "guest core dumps"),
    ("vm.send-migration", "live migration"),
    ("vm.receive-migration", "live migration"),
];

/// Upstream's body for a wrong method, and a body missing or unexpected.
pub fn bad_request() -> ApiError {
    ApiError::new(400, "Bad Request")
}

/// Upstream's body for an unknown path.
pub fn not_found() -> ApiError {
    ApiError::new(404, "Not Found")
}

fn is_empty(body: &[u8]) -> bool {
    body.iter().all(u8::is_ascii_whitespace)
}

/// Longest device id (the JSON key `id`, at any depth), in bytes.
pub const MAX_ID_LEN: usize = 1024;
/// Longest snapshot tag or snapshot reference (the keys `tag` and
/// `snapshot`), in bytes: pcow's own tag limit.
pub const MAX_TAG_LEN: usize = 255;
/// Longest other string (paths, the kernel command line...), in bytes:
/// Linux's `PATH_MAX`.
pub const MAX_STRING_LEN: usize = 4096;

/// The longest string accepted under the JSON key `key`.
pub fn max_len(key: Option<&str>) -> usize {
    match key {
        Some("id") => MAX_ID_LEN,
        Some("tag" | "snapshot") => MAX_TAG_LEN,
        _ => MAX_STRING_LEN,
    }
}
/// The first element of the answer to a body with a string too long or
/// with a control character.
pub const INVALID_STRING: &str = "Invalid string in the request";

/// Checks every string of a request body, keys included: at most
/// [`max_len`] bytes, and no control character (U+0000..U+001F, U+007F..U+009F).
/// The refusal names the field (its JSON path), never echoes the string.
pub fn check_strings(v: &Value) -> Result<(), ApiError> {
    fn walk(v: &Value, path: &mut String, key: Option<&str>) -> Result<(), String> {
        match v {
            Value::String(s) => {
                check_one(s, max_len(key)).map_err(|why| format!("`{path}`: {why}"))
            }
            Value::Array(a) => {
                for (i, e) in a.iter().enumerate() {
                    let len = path.len();
                    path.push_str(&format!("[{i}]"));
                    walk(e, path, key)?;
                    path.truncate(len);
                }
                Ok(())
            }
            Value::Object(o) => {
                for (k, e) in o {
                    check_one(k, MAX_STRING_LEN).map_err(|why| format!("a key: {why}"))?;
                    let len = path.len();
                    if !path.is_empty() {
                        path.push('.');
                    }
                    path.push_str(k);
                    walk(e, path, Some(k))?;
                    path.truncate(len);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
    walk(v, &mut String::new(), None).map_err(|why| ApiError {
        status: 400,
        chain: vec![INVALID_STRING.into(), why],
    })
}

/// Whether `s` is at most `max` bytes with no control character.
fn check_one(s: &str, max: usize) -> Result<(), String> {
    if s.len() > max {
        return Err(format!("{} bytes, at most {max} are accepted", s.len()));
    }
    if let Some((at, c)) = s.chars().enumerate().find(|(_, c)| c.is_control()) {
        let name = match c {
            '\0' => " (NUL)",
            '\t' => " (tab)",
            '\n' => " (newline)",
            '\r' => " (carriage return)",
            '\u{1b}' => " (escape)",
            '\u{7f}' => " (DEL)",
            _ => "",
        };
        return Err(format!(
            "control character U+{:04X}{name} at character {at}",
            u32::from(c)
        ));
    }
    Ok(())
}

fn json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if is_empty(body) {
        return Err(bad_request());
    }
    let parsed = crate::config::from_json(body).map_err(|e| ApiError {
        status: 400,
        chain: vec!["Failed to deserialize JSON".into(), e.to_string()],
    })?;
    // The body is valid JSON (it parsed into T): its strings are checked
    // before anything is opened or echoed.
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        check_strings(&v)?;
    }
    Ok(parsed)
}

fn no_body(body: &[u8]) -> Result<(), ApiError> {
    if is_empty(body) {
        Ok(())
    } else {
        Err(bad_request())
    }
}

/// The endpoint of `path`: its action and method. A query string makes
/// the path unknown, as upstream.
fn endpoint(path: &str) -> Option<(&'static str, &'static str)> {
    let action = path.strip_prefix(PREFIX)?;
    ROUTES.iter().find(|(r, _)| *r == action).copied()
}

/// Routes one request.
pub fn route(method: &str, path: &str, body: &[u8]) -> Result<ApiRequest, ApiError> {
    let (action, allowed) = endpoint(path).ok_or_else(not_found)?;
    if method != allowed {
        return Err(bad_request());
    }
    let nb = |r: ApiRequest| no_body(body).map(|()| r);
    if let Some(&(_, missing)) = UNSUPPORTED.iter().find(|(a, _)| *a == action) {
        // The body must still be JSON, as upstream parses it first.
        json::<Value>(body)?;
        return Ok(ApiRequest::Unsupported(Unsupported { action, missing }));
    }
    Ok(match action {
        "vmm.ping" => nb(ApiRequest::VmmPing)?,
        "vmm.shutdown" => nb(ApiRequest::VmmShutdown)?,
        "vm.create" => ApiRequest::VmCreate(Box::new(json(body)?)),
        "vm.boot" => nb(ApiRequest::VmBoot)?,
        "vm.info" => nb(ApiRequest::VmInfo)?,
        "vm.counters" => nb(ApiRequest::VmCounters)?,
        "vm.pause" => nb(ApiRequest::VmPause)?,
        "vm.resume" => nb(ApiRequest::VmResume)?,
        "vm.shutdown" => nb(ApiRequest::VmShutdown)?,
        "vm.reboot" => nb(ApiRequest::VmReboot)?,
        "vm.power-button" => nb(ApiRequest::VmPowerButton)?,
        "vm.nmi" => nb(ApiRequest::VmNmi)?,
        "vm.delete" => nb(ApiRequest::VmDelete)?,
        "vm.resize" => ApiRequest::VmResize(json(body)?),
        "vm.add-pmem" => ApiRequest::VmAddPmem(Box::new(json(body)?)),
        "vm.remove-device" => ApiRequest::VmRemoveDevice(json(body)?),
        "vm.pmem-snapshot" => ApiRequest::PmemSnapshot(json(body)?),
        "vm.pmem-overlay" => ApiRequest::PmemOverlay(json(body)?),
        "vm.pmem-rollback" => ApiRequest::PmemRollback(json(body)?),
        "vm.pmem-snapshot-delete" => ApiRequest::PmemSnapshotDelete(json(body)?),
        "vm.pmem-flush" => ApiRequest::PmemFlush(json(body)?),
        "vm.pmem-info" => nb(ApiRequest::PmemInfo)?,
        "vm.snapshot" => ApiRequest::VmSnapshot(json(body)?),
        "vm.restore" => ApiRequest::VmRestore(Box::new(json(body)?)),
        _ => return Err(not_found()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::PmemSnapshot;

    /// Each bounded field of each action: at the limit, past it, and with
    /// a control character.
    #[test]
    fn strings_are_bounded_and_printable() {
        let path = format!("/{}", "p".repeat(MAX_STRING_LEN - 1));
        let cases: &[(&str, &str, &str)] = &[
            ("vm.pmem-snapshot", r#"{"id":"p","tag":X}"#, "tag"),
            ("vm.pmem-snapshot", r#"{"id":X,"tag":"t"}"#, "id"),
            ("vm.pmem-overlay", r#"{"id":X,"file":"/f"}"#, "id"),
            ("vm.pmem-overlay", r#"{"id":"p","file":X}"#, "file"),
            ("vm.pmem-rollback", r#"{"id":"p","snapshot":X}"#, "snapshot"),
            (
                "vm.pmem-snapshot-delete",
                r#"{"id":"p","snapshot":X}"#,
                "snapshot",
            ),
            ("vm.pmem-flush", r#"{"id":X}"#, "id"),
            ("vm.remove-device", r#"{"id":X}"#, "id"),
            ("vm.add-pmem", r#"{"file":"/f","id":X}"#, "id"),
            ("vm.add-pmem", r#"{"file":X}"#, "file"),
            (
                "vm.create",
                r#"{"payload":{"kernel":"/k"},"pmem":[{"file":"/f","id":X}]}"#,
                "pmem[0].id",
            ),
            ("vm.create", r#"{"payload":{"kernel":X}}"#, "payload.kernel"),
            (
                "vm.create",
                r#"{"payload":{"kernel":"/k"},"pmem":[{"file":X}]}"#,
                "pmem[0].file",
            ),
        ];
        for &(action, template, field) in cases {
            let p = format!("{PREFIX}{action}");
            let key = field.rsplit('.').next().unwrap();
            let at = &match max_len(Some(key)) {
                MAX_STRING_LEN => path.clone(),
                n => "i".repeat(n),
            };
            let body = |s: &str| template.replace('X', &serde_json::to_string(s).unwrap());
            // At the limit: no string error (the action itself may be fine).
            if let Err(e) = route("PUT", &p, body(at).as_bytes()) {
                assert_ne!(e.chain[0], INVALID_STRING, "{action} {field}: {e:?}");
            }
            let long = format!("{at}x");
            let ctl = format!("{}\n", &at[..10]);
            for (bad, why) in [(&long, "at most"), (&ctl, "control character")] {
                let e = route("PUT", &p, body(bad).as_bytes()).unwrap_err();
                assert_eq!(e.status, 400, "{action} {field}");
                assert_eq!(e.chain[0], INVALID_STRING, "{action} {field}");
                assert!(e.chain[1].contains(&format!("`{field}`")), "{e:?}");
                assert!(e.chain[1].contains(why), "{e:?}");
                // Never echoed.
                assert!(!e.chain[1].contains(&at[..10]), "{e:?}");
            }
        }
        // DEL and C1 controls too; tabs as well.
        for c in ['\u{7f}', '\u{85}', '\t', '\0'] {
            let b = serde_json::json!({"id": format!("a{c}b")}).to_string();
            let e = route("PUT", "/api/v1/vm.pmem-flush", b.as_bytes()).unwrap_err();
            assert_eq!(e.chain[0], INVALID_STRING, "{c:?}");
        }
    }

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
        let not_found = vec!["Not Found".to_owned()];
        let bad = vec!["Bad Request".to_owned()];
        for p in [
            "/api/v1/vm.nothing",
            "/api/v2/vmm.ping",
            "/api/v1/",
            "/api/v1/vmm.ping?x=1",
        ] {
            let err = e("GET", p, b"");
            assert_eq!((err.status, &err.chain), (404, &not_found), "{p}");
        }
        for (m, p) in [
            ("PUT", "/api/v1/vmm.ping"),
            ("GET", "/api/v1/vm.boot"),
            ("POST", "/api/v1/vm.create"),
            ("DELETE", "/api/v1/vm.info"),
        ] {
            let err = e(m, p, b"");
            assert_eq!((err.status, &err.chain), (400, &bad), "{m} {p}");
        }
        // A body where none belongs, none where one does.
        assert_eq!(e("PUT", "/api/v1/vm.boot", b"{}").chain, bad);
        assert_eq!(e("PUT", "/api/v1/vm.pmem-snapshot", b"").chain, bad);
        let de = e("PUT", "/api/v1/vm.pmem-snapshot", b"{");
        assert_eq!(de.status, 400);
        assert_eq!(de.chain[0], "Failed to deserialize JSON");
        assert!(de.chain[1].contains("EOF"), "{de:?}");
        assert_eq!(
            e("PUT", "/api/v1/vm.pmem-snapshot", br#"{"id":"p","tag":1}"#).status,
            400
        );
        // Our own pcow actions stay strict about their fields.
        let unknown = e(
            "PUT",
            "/api/v1/vm.pmem-snapshot",
            br#"{"id":"p","tag":"t","extra":1}"#,
        );
        assert_eq!(unknown.status, 400);
        assert!(unknown.chain.join(" ").contains("extra"), "{unknown:?}");
        // Upstream's are not.
        assert_eq!(
            route(
                "PUT",
                "/api/v1/vm.remove-device",
                br#"{"id":"p","future":true}"#
            )
            .unwrap(),
            ApiRequest::VmRemoveDevice(crate::api::DeviceId { id: "p".into() })
        );
        assert_eq!(
            e("PUT", "/api/v1/vm.create", br#"{"memory":{"size":"x"}}"#).status,
            400
        );
        assert_eq!(
            route("PUT", "/api/v1/vm.resize", br#"{"desired_vcpus":2}"#).unwrap(),
            ApiRequest::VmResize(crate::api::VmResize {
                desired_vcpus: Some(2),
                ..Default::default()
            })
        );
        assert_eq!(
            e("PUT", "/api/v1/vm.resize", br#"{"desired_vcpus":-1}"#).status,
            400
        );
    }

    /// Endpoints of devices we do not have parse their body, then become
    /// a refusal the VMM words; never "unknown path".
    #[test]
    fn unsupported_endpoints_are_known() {
        for (action, _) in UNSUPPORTED {
            let path = format!("{PREFIX}{action}");
            assert!(endpoint(&path).is_some(), "{action} is routed");
            match route("PUT", &path, br#"{"path":"/x"}"#).unwrap() {
                ApiRequest::Unsupported(u) => assert_eq!(u.action, *action),
                other => panic!("{action}: {other:?}"),
            }
            let err = route("PUT", &path, b"{nope").unwrap_err();
            assert_eq!(err.chain[0], "Failed to deserialize JSON", "{action}");
            assert_eq!(route("PUT", &path, b"").unwrap_err().status, 400);
            assert_eq!(route("GET", &path, b"").unwrap_err().status, 400);
        }
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
