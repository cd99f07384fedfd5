//! Watches: the event stream after a `resourceVersion`, bookmarks,
//! selector transitions, timeouts and `410 Expired`.

use super::*;

impl FakeKube {
    pub(crate) fn watch(
        self: &Arc<Self>,
        kind: Kind,
        namespace: Option<&str>,
        name: Option<&str>,
        query: &Query,
    ) -> Response {
        self.stats.watches.fetch_add(1, Ordering::Relaxed);
        let filter = match Filter::new(kind, namespace, name, query) {
            Ok(filter) => filter,
            Err(message) => return bad_request(message),
        };
        let bookmarks = query.flag("allowWatchBookmarks");
        let send_initial = query.flag("sendInitialEvents");
        if send_initial && (!bookmarks || query.get("resourceVersionMatch") != Some("NotOlderThan"))
        {
            return status_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "sendInitialEvents requires allowWatchBookmarks=true and resourceVersionMatch=NotOlderThan".into(),
                None,
            );
        }
        let timeout = match query.get("timeoutSeconds").map(str::parse::<u64>) {
            None | Some(Ok(0)) => DEFAULT_WATCH_TIMEOUT,
            Some(Ok(secs)) => Duration::from_secs(secs).min(MAX_WATCH_TIMEOUT),
            Some(Err(_)) => {
                return bad_request("timeoutSeconds: Invalid value: must be an integer".into())
            }
        };
        let from = match query
            .get("resourceVersion")
            .filter(|rv| !rv.is_empty() && *rv != "0")
        {
            _ if send_initial => None,
            None => None,
            Some(rv) => match rv.parse::<u64>() {
                Ok(rv) => Some(rv),
                Err(_) => return bad_request(format!("resourceVersion: Invalid value: \"{rv}\"")),
            },
        };

        let store = self.lock();
        let mut initial = Vec::new();
        let start_rv = match from {
            // No (or "0") resourceVersion: the current state as synthetic
            // ADDED events, then changes.
            None => {
                for obj in store.objects[kind.index()].values() {
                    if filter.matches(kind, obj) {
                        initial.push(line(&json!({"type": "ADDED", "object": obj})));
                    }
                }
                if send_initial {
                    initial.push(bookmark(kind, store.rv, true));
                }
                store.rv
            }
            Some(rv) if rv < store.floor => {
                let gone = gone(format!("too old resource version: {rv} ({})", store.floor));
                return json_response_bytes(StatusCode::OK, gone);
            }
            Some(rv) => {
                for change in store.history.iter().filter(|c| c.rv > rv) {
                    if let Some(event) = render(change, kind, &filter) {
                        initial.push(event);
                    }
                }
                store.rv.max(rv)
            }
        };
        let watch = Watch {
            kind,
            filter,
            initial,
            start_rv,
            bookmarks,
            bookmark_interval: Duration::from_millis(
                self.bookmark_interval_ms.load(Ordering::Relaxed),
            ),
            timeout,
            events: self.events.subscribe(),
            control: self.control.subscribe(),
        };
        drop(store);

        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(watch.run(tx));
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|chunk| (Ok::<Bytes, Infallible>(chunk), rx))
        });
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            Body::from_stream(stream),
        )
            .into_response()
    }
}

/// An open watch: what to send first, what to filter, where it started.
pub(crate) struct Watch {
    pub(crate) kind: Kind,
    pub(crate) filter: Filter,
    pub(crate) initial: Vec<Bytes>,
    pub(crate) start_rv: u64,
    pub(crate) bookmarks: bool,
    pub(crate) bookmark_interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) events: broadcast::Receiver<Arc<Change>>,
    pub(crate) control: watch::Receiver<Control>,
}

impl Watch {
    pub(crate) async fn run(self, tx: mpsc::Sender<Bytes>) {
        let Watch {
            kind,
            filter,
            initial,
            start_rv,
            bookmarks,
            bookmark_interval,
            timeout,
            mut events,
            mut control,
        } = self;
        for chunk in initial {
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticks = tokio::time::interval_at(
            tokio::time::Instant::now() + bookmark_interval,
            bookmark_interval,
        );
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_rv = start_rv;
        loop {
            // Biased: a control message (sent under the store lock before
            // any later change) always wins over the changes after it.
            tokio::select! {
                biased;
                changed = control.changed() => {
                    let expire = changed.is_ok() && control.borrow().expire;
                    if expire {
                        let _ = tx.send(gone(format!("too old resource version: {last_rv}"))).await;
                    }
                    return;
                }
                () = &mut deadline => return,
                () = tx.closed() => return,
                received = events.recv() => match received {
                    Ok(change) => {
                        if change.rv <= last_rv {
                            continue;
                        }
                        last_rv = change.rv;
                        if let Some(event) = render(&change, kind, &filter) {
                            if tx.send(event).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(gone(format!("too old resource version: {last_rv}"))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = ticks.tick(), if bookmarks => {
                    if tx.send(bookmark(kind, last_rv, false)).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// The event a watch with `filter` sees for `change`, as the watch cache
/// computes it: entering the selection is ADDED, leaving it is DELETED
/// (with the last matching state at the change's resourceVersion).
pub(crate) fn render(change: &Change, kind: Kind, filter: &Filter) -> Option<Bytes> {
    if change.kind != kind {
        return None;
    }
    let cur = change.cur.as_ref().filter(|obj| filter.matches(kind, obj));
    let prev = change.prev.as_ref().filter(|obj| filter.matches(kind, obj));
    let event = match (cur, prev) {
        (Some(cur), None) => json!({"type": "ADDED", "object": cur}),
        (Some(cur), Some(_)) => json!({"type": "MODIFIED", "object": cur}),
        (None, Some(prev)) => {
            let mut obj = prev.clone();
            if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.insert(
                    "resourceVersion".into(),
                    Value::String(change.rv.to_string()),
                );
            }
            json!({"type": "DELETED", "object": obj})
        }
        (None, None) => return None,
    };
    Some(line(&event))
}

pub(crate) fn line(event: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(event).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

pub(crate) fn bookmark(kind: Kind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(&json!({
        "type": "BOOKMARK",
        "object": {"kind": kind.kind(), "apiVersion": "v1", "metadata": metadata},
    }))
}

pub(crate) fn gone(message: String) -> Bytes {
    line(
        &json!({"type": "ERROR", "object": status_body(StatusCode::GONE, "Expired", message, None)}),
    )
}
