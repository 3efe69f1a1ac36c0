//! `--event-monitor path=FILE|fd=N`: one JSON object per VMM event
//! (`{timestamp, source, event, properties}`, pretty-printed and followed
//! by an empty line, as upstream writes them), so that an orchestrator can
//! follow a VM's life without polling `vm.info`.
//!
//! Events are formatted where they happen and written by a thread of
//! their own: a slow or stuck reader of a pipe never holds the VMM thread
//! up. At most [`QUEUE`] events wait; beyond that they are dropped and
//! counted (logged once the writer catches up).

use crate::landlock_rules::threads;
use crate::seccomp_filters::{self, ThreadKind};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Events that may wait for the writer.
pub const QUEUE: usize = 1024;

struct Monitor {
    tx: SyncSender<String>,
    start: Instant,
    dropped: AtomicU64,
}

static MONITOR: OnceLock<Monitor> = OnceLock::new();

#[derive(Serialize)]
struct Event<'a> {
    timestamp: Duration,
    source: &'a str,
    event: &'a str,
    properties: Option<BTreeMap<&'a str, &'a str>>,
}

/// Errors of starting the monitor.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum EventMonitorError {
    #[error("the event monitor is already started")]
    AlreadyStarted,
    #[error("starting the event monitor thread")]
    Thread(#[source] std::io::Error),
}

/// Starts writing events to `file` (the process's only monitor).
pub fn start(mut file: File) -> Result<(), EventMonitorError> {
    let (tx, rx) = mpsc::sync_channel::<String>(QUEUE);
    let monitor = Monitor {
        tx,
        start: Instant::now(),
        dropped: AtomicU64::new(0),
    };
    MONITOR
        .set(monitor)
        .map_err(|_| EventMonitorError::AlreadyStarted)?;
    std::thread::Builder::new()
        .name("event-monitor".into())
        .spawn(move || {
            if let Err(e) = seccomp_filters::apply(ThreadKind::EventMonitor) {
                log::warn!(
                    "event monitor: {}: no events are written",
                    error_report::chain(&e)
                );
                return;
            }
            // No filesystem rights at all once the VMM is confined: the
            // file is open already.
            let mut confined = false;
            for text in rx {
                match threads::process().follow(&mut confined) {
                    Ok(true) => log::info!(
                        "event monitor: follows the VMM's Landlock confinement (no file access)"
                    ),
                    Ok(false) => {}
                    Err(e) => {
                        log::warn!(
                        "event monitor: cannot confine itself as the VMM did (--landlock): {}; \
                         no more events are written",
                        error_report::chain(&e)
                    );
                        return;
                    }
                }
                let written = file
                    .write_all(text.as_bytes())
                    .and_then(|()| file.write_all(b"\n\n"));
                if let Err(e) = written {
                    log::warn!("event monitor: {e}: no more events are written");
                    return;
                }
                let dropped = MONITOR
                    .get()
                    .map_or(0, |m| m.dropped.swap(0, Ordering::Relaxed));
                if dropped > 0 {
                    log::warn!("event monitor: {dropped} events dropped (the reader was slow)");
                }
            }
        })
        .map_err(EventMonitorError::Thread)?;
    Ok(())
}

/// The JSON text of one event.
fn format(timestamp: Duration, source: &str, event: &str, properties: &[(&str, &str)]) -> String {
    let e = Event {
        timestamp,
        source,
        event,
        properties: (!properties.is_empty()).then(|| properties.iter().copied().collect()),
    };
    serde_json::to_string_pretty(&e).unwrap_or_default()
}

/// Records an event (logged at info level; written when a monitor runs).
pub fn event(source: &str, event: &str, properties: &[(&str, &str)]) {
    log::info!("event: {source} {event} {properties:?}");
    let Some(m) = MONITOR.get() else { return };
    let text = format(m.start.elapsed(), source, event, properties);
    match m.tx.try_send(text) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            m.dropped.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Disconnected(_)) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_shape() {
        let text = format(Duration::new(3, 500), "vm", "booted", &[]);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "timestamp": {"secs": 3, "nanos": 500},
                "source": "vm",
                "event": "booted",
                "properties": null,
            })
        );
        assert!(text.contains('\n'), "pretty-printed as upstream: {text}");
        let text = format(Duration::ZERO, "vm", "device-removed", &[("id", "p\"0")]);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["properties"], serde_json::json!({"id": "p\"0"}));
    }
}
