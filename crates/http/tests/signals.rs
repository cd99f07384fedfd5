//! A stop signal that arrives after a role started listening
//! (`listen_for_signals`) but before it waits (`wait_for_signal`) is kept,
//! not acted on by the signal's default action (which would kill this
//! test's process: nextest runs each test in a process of its own).

use std::time::Duration;

use lanyard_http::{listen_for_signals, wait_for_signal, StopSignal};

#[tokio::test]
async fn a_sigterm_before_the_wait_is_kept_for_it() {
    listen_for_signals();
    let pid = std::process::id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(sent.success());
    // Give the signal time to land before anything waits for it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let got = tokio::time::timeout(Duration::from_secs(5), wait_for_signal())
        .await
        .expect("the signal sent before the wait is seen");
    assert_eq!(got, StopSignal::Terminate);
}
