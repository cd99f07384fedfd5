//! Semantic checks of a loaded [`Config`] that types alone cannot express,
//! one function per section, each refusing the first bad value with the key
//! and what it takes.

use super::{Config, ConfigError};
pub(super) use crate::cloud::check_endpoint;
use crate::names::{is_dns_label, is_dns_subdomain};

fn invalid(key: &'static str, expected: &'static str, got: &str) -> ConfigError {
    ConfigError::Invalid {
        key,
        expected,
        got: got.to_string(),
    }
}

/// The longest shutdown delay: with the drain's 10 s it must stay inside
/// a pod's termination grace period (the chart's is 30 s; Kubernetes'
/// default too), or the kubelet kills the role mid-drain.
const MAX_SHUTDOWN_DELAY: u64 = 60;

impl Config {
    /// Semantic checks that types alone cannot express, section by section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.clouds().check()?;
        self.check_cache()?;
        self.check_cluster()?;
        self.check_policy()?;
        self.check_audit()?;
        self.check_sidecar()?;
        self.check_webhook()?;
        self.check_dev()?;
        if self.shutdown_delay_seconds > MAX_SHUTDOWN_DELAY {
            return Err(invalid(
                "shutdown_delay_seconds",
                "seconds from 0 to 60",
                &self.shutdown_delay_seconds.to_string(),
            ));
        }
        Ok(())
    }

    /// The cache section: its bound, lifetimes, concurrency and fairness bounds.
    fn check_cache(&self) -> Result<(), ConfigError> {
        let c = &self.cache;
        if !(1..=1_000_000).contains(&c.max_entries) {
            return Err(invalid(
                "cache.max_entries",
                "between 1 and 1000000",
                &c.max_entries.to_string(),
            ));
        }
        if !(60..=7 * 86_400).contains(&c.idle_ttl) {
            return Err(invalid(
                "cache.idle_ttl",
                "seconds between 60 and 604800",
                &c.idle_ttl.to_string(),
            ));
        }
        if c.negative_ttl > 3600 {
            return Err(invalid(
                "cache.negative_ttl",
                "seconds between 0 and 3600",
                &c.negative_ttl.to_string(),
            ));
        }
        if !(1..=10_000).contains(&c.upstream_concurrency) {
            return Err(invalid(
                "cache.upstream_concurrency",
                "between 1 and 10000",
                &c.upstream_concurrency.to_string(),
            ));
        }
        for (key, value, max) in [
            ("cache.caller_inflight", c.caller_inflight, 10_000),
            ("cache.caller_max_entries", c.caller_max_entries, 1_000_000),
        ] {
            if !(1..=max).contains(&value) {
                return Err(invalid(
                    key,
                    "a count of at least 1 (see docs/configuration.md)",
                    &value.to_string(),
                ));
            }
        }
        if !(c.caller_new_keys_burst.is_finite()
            && (1.0..=100_000.0).contains(&c.caller_new_keys_burst))
        {
            return Err(invalid(
                "cache.caller_new_keys_burst",
                "between 1 and 100000",
                &c.caller_new_keys_burst.to_string(),
            ));
        }
        let new_keys = (
            "cache.caller_new_keys_per_second",
            c.caller_new_keys_per_second,
        );
        for (key, rate) in c.rates().into_iter().chain([new_keys]) {
            if !(rate.is_finite() && (0.1..=100_000.0).contains(&rate)) {
                return Err(invalid(
                    key,
                    "exchanges per second between 0.1 and 100000",
                    &rate.to_string(),
                ));
            }
        }
        Ok(())
    }

    /// The cluster section: the issuer, its keys and the node's name.
    fn check_cluster(&self) -> Result<(), ConfigError> {
        if let Some(issuer) = &self.cluster.issuer {
            check_endpoint(issuer)
                .map_err(|expected| invalid("cluster.issuer", expected, issuer))?;
        }
        if let Some(url) = &self.cluster.jwks_url {
            check_endpoint(url).map_err(|expected| invalid("cluster.jwks_url", expected, url))?;
        }
        if let Some(node) = &self.cluster.node_name {
            if !is_dns_subdomain(node) {
                return Err(invalid(
                    "cluster.node_name",
                    "a node name (DNS-1123 subdomain)",
                    node,
                ));
            }
        }
        Ok(())
    }

    /// The policy section: the reload interval.
    fn check_policy(&self) -> Result<(), ConfigError> {
        if !(1..=3600).contains(&self.policy.reload_seconds) {
            return Err(invalid(
                "policy.reload_seconds",
                "seconds from 1 to 3600",
                &self.policy.reload_seconds.to_string(),
            ));
        }
        Ok(())
    }

    /// The audit section: rotation bounds, exporters (which ship the file, so need it) and the backlog bound.
    fn check_audit(&self) -> Result<(), ConfigError> {
        if self.audit.file_max_bytes < 4096 {
            return Err(invalid(
                "audit.file_max_bytes",
                "at least 4096 bytes",
                &self.audit.file_max_bytes.to_string(),
            ));
        }
        if self.audit.file_max_age_seconds < 60 {
            return Err(invalid(
                "audit.file_max_age_seconds",
                "at least 60 seconds",
                &self.audit.file_max_age_seconds.to_string(),
            ));
        }
        if let Some(url) = &self.audit.syslog {
            if self.audit.file.is_none() {
                return Err(invalid(
                    "audit.syslog",
                    "audit.file set too: the syslog exporter ships the file's records",
                    url,
                ));
            }
            if let Err(e) = crate::audit::syslog::SyslogTarget::parse(url, None, "") {
                return Err(invalid(
                    "audit.syslog",
                    "relp://, tls:// or tcp://HOST:PORT",
                    &e.to_string(),
                ));
            }
        }
        if let Some(url) = &self.audit.http {
            if self.audit.file.is_none() {
                return Err(invalid(
                    "audit.http",
                    "audit.file set too: the HTTP exporter ships the file's records",
                    url,
                ));
            }
            check_endpoint(url).map_err(|expected| invalid("audit.http", expected, url))?;
        }
        let every = self.audit.checkpoint_seconds;
        if every != 0 && !(10..=86_400).contains(&every) {
            return Err(invalid(
                "audit.checkpoint_seconds",
                "0 (no checkpoints) or seconds from 10 to 86400",
                &every.to_string(),
            ));
        }
        if self.audit.export_max_backlog == 0 {
            return Err(invalid(
                "audit.export_max_backlog",
                "at least 1 record",
                "0",
            ));
        }
        if self.audit.cluster.len() > 253 {
            return Err(invalid(
                "audit.cluster",
                "at most 253 characters",
                &self.audit.cluster,
            ));
        }
        Ok(())
    }

    /// The sidecar section: the agent's URL.
    fn check_sidecar(&self) -> Result<(), ConfigError> {
        Ok(self.sidecar.check()?)
    }

    /// The webhook section: the sidecar's resources and the guard's extra audiences.
    fn check_webhook(&self) -> Result<(), ConfigError> {
        let w = &self.webhook;
        for (key, value) in [
            ("webhook.sidecar_cpu_request", &w.sidecar_cpu_request),
            ("webhook.sidecar_memory_request", &w.sidecar_memory_request),
            ("webhook.sidecar_cpu_limit", &w.sidecar_cpu_limit),
            ("webhook.sidecar_memory_limit", &w.sidecar_memory_limit),
        ] {
            if let Some(v) = value.as_deref().filter(|v| !is_quantity(v)) {
                return Err(invalid(
                    key,
                    "a Kubernetes quantity such as 10m, 0.5, 16Mi or 1G",
                    v,
                ));
            }
        }
        if w.guard_extra_audiences.len() > 32 {
            return Err(invalid(
                "webhook.guard_extra_audiences",
                "at most 32 audiences",
                &w.guard_extra_audiences.len().to_string(),
            ));
        }
        for audience in &w.guard_extra_audiences {
            if audience.trim().is_empty() || audience.len() > 600 {
                return Err(invalid(
                    "webhook.guard_extra_audiences",
                    "non-empty audiences of at most 600 characters",
                    &audience.chars().take(64).collect::<String>(),
                ));
            }
        }
        Ok(())
    }

    /// The dev section: `lanyard dev`'s pod, identities and emulators.
    fn check_dev(&self) -> Result<(), ConfigError> {
        let d = &self.dev;
        if !is_dns_label(&d.namespace) {
            return Err(invalid(
                "dev.namespace",
                "a DNS-1123 label (lowercase letters, digits, '-')",
                &d.namespace,
            ));
        }
        if !is_dns_subdomain(&d.service_account) {
            return Err(invalid(
                "dev.service_account",
                "a DNS-1123 subdomain (lowercase letters, digits, '-', '.')",
                &d.service_account,
            ));
        }
        if !is_dns_subdomain(&d.pod_name) {
            return Err(invalid("dev.pod_name", "a DNS-1123 subdomain", &d.pod_name));
        }
        if !is_dns_subdomain(&d.node_name) {
            return Err(invalid(
                "dev.node_name",
                "a DNS-1123 subdomain",
                &d.node_name,
            ));
        }
        d.check_identity(self.clouds())?;
        if !(60..=86_400).contains(&d.token_lifetime) {
            return Err(invalid(
                "dev.token_lifetime",
                "seconds between 60 and 86400",
                &d.token_lifetime.to_string(),
            ));
        }
        if !(600..=86_400).contains(&d.projected_token_lifetime) {
            return Err(invalid(
                "dev.projected_token_lifetime",
                "seconds between 600 and 86400 (the kubelet's range)",
                &d.projected_token_lifetime.to_string(),
            ));
        }
        if d.upstream_latency_ms > 10_000 {
            return Err(invalid(
                "dev.upstream_latency_ms",
                "milliseconds between 0 and 10000",
                &d.upstream_latency_ms.to_string(),
            ));
        }
        for sa in &d.service_accounts {
            if !is_dns_label(&sa.namespace) || !is_dns_subdomain(&sa.name) {
                return Err(invalid(
                    "dev.service_accounts",
                    "namespace and name as DNS-1123 names",
                    &format!("{}/{}", sa.namespace, sa.name),
                ));
            }
        }
        Ok(())
    }
}

/// A Kubernetes resource quantity: a decimal number, then an optional
/// binary (`Ki`…`Ei`) or decimal (`n`, `u`, `m`, `k`, `M`…`E`) suffix, or
/// an exponent (`1e3`). Checked here so that a typo fails at start rather
/// than in every pod the webhook admits.
pub(super) fn is_quantity(s: &str) -> bool {
    let s = s.strip_prefix('+').unwrap_or(s);
    let digits = s
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    let (number, suffix) = s.split_at(digits);
    let valid_number = number.bytes().filter(|b| *b == b'.').count() <= 1
        && number.bytes().any(|b| b.is_ascii_digit());
    let valid_suffix = match suffix {
        "" | "n" | "u" | "m" | "k" | "M" | "G" | "T" | "P" | "E" => true,
        "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => true,
        exp => exp.strip_prefix(['e', 'E']).is_some_and(|e| {
            let e = e.strip_prefix(['+', '-']).unwrap_or(e);
            !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())
        }),
    };
    s.len() <= 64 && valid_number && valid_suffix
}
