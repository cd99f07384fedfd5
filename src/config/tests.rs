//! Configuration layering and validation. figment's Jail serialises tests
//! that touch the process environment and the working directory.

#![allow(clippy::result_large_err)] // figment::Error is what Jail closures return

use super::validate::{check_endpoint, is_quantity};
use super::*;
use figment::Jail;
use lanyard_startup::sources::structured_keys;
use serde_json::json;

fn load(file: Option<&str>, overrides: serde_json::Value) -> Result<Config, ConfigError> {
    Config::load(file.map(Path::new), overrides)
}

#[test]
fn defaults_are_valid() {
    Jail::expect_with(|_| {
        let c = load(None, json!({})).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.listen.to_string(), "127.0.0.1:8642");
        Ok(())
    });
}

#[test]
fn file_then_env_then_flags() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "lanyard.yaml",
            "listen: 127.0.0.1:9000\nazure:\n  cloud: china\ndev:\n  namespace: ml\n  token_lifetime: 600\n",
        )?;
        let c = load(Some("lanyard.yaml"), json!({})).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.azure.cloud, "china");
        assert_eq!(c.dev.namespace, "ml");

        jail.set_env("LANYARD_DEV_TOKEN_LIFETIME", "900");
        jail.set_env("LANYARD_AZURE_AUTHORITY_HOST", "http://127.0.0.1:1234");
        let c = load(Some("lanyard.yaml"), json!({})).unwrap();
        assert_eq!(c.dev.token_lifetime, 900);
        assert_eq!(
            c.azure.authority_host.as_deref(),
            Some("http://127.0.0.1:1234")
        );

        let c = load(
            Some("lanyard.yaml"),
            json!({"dev": {"token_lifetime": 120}}),
        )
        .unwrap();
        assert_eq!(c.dev.token_lifetime, 120);
        assert_eq!(c.dev.namespace, "ml");
        Ok(())
    });
}

#[test]
fn unrelated_lanyard_variables_are_ignored() {
    Jail::expect_with(|jail| {
        jail.set_env("LANYARD_AGENT_URL", "http://x");
        jail.set_env("LANYARD_CONFIG", "ignored-here");
        assert!(load(None, json!({})).is_ok());
        Ok(())
    });
}

fn message(result: Result<Config, ConfigError>) -> String {
    result.unwrap_err().to_string()
}

#[test]
fn bad_values_name_the_key() {
    Jail::expect_with(|jail| {
        jail.set_env("LANYARD_DEV_TOKEN_LIFETIME", "soon");
        let m = message(load(None, json!({})));
        assert!(m.contains("dev.token_lifetime"), "{m}");
        Ok(())
    });
    Jail::expect_with(|_| {
        let m = message(load(None, json!({"dev": {"token_lifetime": 5}})));
        assert!(
            m.contains("dev.token_lifetime") && m.contains("between 60 and 86400"),
            "{m}"
        );
        let m = message(load(
            None,
            json!({"azure": {"authority_host": "http://login.example.com"}}),
        ));
        assert!(
            m.contains("azure.authority_host") && m.contains("https://"),
            "{m}"
        );
        let m = message(load(None, json!({"azure": {"cloud": "mars"}})));
        assert!(m.contains("azure.cloud"), "{m}");
        let m = message(load(None, json!({"listen": "localhost"})));
        assert!(m.contains("listen"), "{m}");
        let m = message(load(None, json!({"dev": {"namespace": "Bad_NS"}})));
        assert!(m.contains("dev.namespace"), "{m}");
        let m = message(load(None, json!({"log_format": "xml"})));
        assert!(m.contains("log_format"), "{m}");
        let m = message(load(None, json!({"audit": {"checkpoint_seconds": 5}})));
        assert!(
            m.contains("audit.checkpoint_seconds") && m.contains("from 10 to 86400"),
            "{m}"
        );
        for fine in [0, 10, 86_400] {
            let c = load(None, json!({"audit": {"checkpoint_seconds": fine}})).unwrap();
            assert_eq!(c.audit.checkpoint_seconds, fine);
        }
        Ok(())
    });
}

#[test]
fn unknown_keys_in_file_are_refused() {
    Jail::expect_with(|jail| {
        jail.create_file("lanyard.yaml", "azure:\n  authority: https://x\n")?;
        let m = message(load(Some("lanyard.yaml"), json!({})));
        assert!(m.contains("authority"), "{m}");
        let m = message(load(Some("missing.yaml"), json!({})));
        assert!(m.contains("missing.yaml"), "{m}");
        Ok(())
    });
}

#[test]
fn endpoint_rules() {
    assert!(check_endpoint("https://login.microsoftonline.com").is_ok());
    assert!(check_endpoint("http://127.0.0.1:8080").is_ok());
    assert!(check_endpoint("http://localhost:8080/").is_ok());
    assert!(check_endpoint("http://[::1]:8080").is_ok());
    assert!(check_endpoint("http://10.0.0.1").is_err());
    assert!(check_endpoint("https://x/?a=b").is_err());
    assert!(check_endpoint("ftp://x").is_err());
    assert!(check_endpoint("not a url").is_err());
}

/// Every scalar key of the configuration, dotted (`gcp.project_number`),
/// with its default: walked from `Config::default()`, so a new key is
/// covered without editing this list.
fn scalar_keys() -> Vec<(String, serde_json::Value)> {
    fn walk(value: &serde_json::Value, prefix: &str, out: &mut Vec<(String, serde_json::Value)>) {
        match value {
            serde_json::Value::Object(fields) if !fields.is_empty() => {
                for (k, v) in fields {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(v, &path, out);
                }
            }
            // Lists and maps are not scalars.
            serde_json::Value::Object(_) | serde_json::Value::Array(_) => {}
            scalar => out.push((prefix.to_string(), scalar.clone())),
        }
    }
    let mut out = Vec::new();
    walk(
        &serde_json::to_value(Config::default()).unwrap(),
        "",
        &mut out,
    );
    out
}

fn env_name(key: &str) -> String {
    format!("LANYARD_{}", key.replace('.', "_").to_ascii_uppercase())
}

fn lookup<'a>(value: &'a serde_json::Value, key: &str) -> &'a serde_json::Value {
    key.split('.').fold(value, |v, k| &v[k])
}

#[test]
fn every_key_takes_numeric_looking_values_from_the_environment() {
    let keys = scalar_keys();
    // The walk reaches every section (guards against an empty walk).
    assert!(keys.len() > 50, "{}", keys.len());
    for wanted in [
        "gcp.project_number",
        "azure.tenant_id",
        "sidecar.identity_header",
        "dev.azure_client_id",
        "log_level",
    ] {
        assert!(keys.iter().any(|(k, _)| k == wanted), "{wanted}");
    }
    for (key, default) in &keys {
        // String-ish keys serialize their default as a string or, when
        // optional, as null; a number or bool default is a typed key.
        let stringish = default.is_string() || default.is_null();
        for raw in ["123456789012", "007", "true", "null", "1.50"] {
            Jail::expect_with(|jail| {
                jail.set_env(env_name(key), raw);
                match load(None, json!({})) {
                    Ok(c) => {
                        if stringish {
                            let loaded = serde_json::to_value(&c).unwrap();
                            assert_eq!(
                                lookup(&loaded, key),
                                &json!(raw),
                                "{key}={raw} must arrive as written"
                            );
                        }
                    }
                    Err(ConfigError::Invalid { key: k, .. }) => {
                        // A validated key refuses the value with its own
                        // message, not with a type error.
                        assert_eq!(k, key.as_str(), "{key}={raw}");
                    }
                    Err(e) => {
                        // A typed key (number, bool, address, enum) may
                        // refuse it; a string key never for its type.
                        let m = e.to_string();
                        assert!(
                            !(stringish && m.contains("invalid type")),
                            "{key}={raw}: {m}"
                        );
                        assert!(m.contains(key.as_str()), "{key}={raw}: {m}");
                    }
                }
                Ok(())
            });
        }
    }
}

#[test]
fn the_reported_project_number_loads() {
    Jail::expect_with(|jail| {
        jail.set_env("LANYARD_GCP_PROJECT_NUMBER", "123456789012");
        jail.set_env("LANYARD_DEV_AZURE_CLIENT_ID", "0042");
        let c = load(None, json!({})).unwrap();
        assert_eq!(c.gcp.project_number.as_deref(), Some("123456789012"));
        assert_eq!(c.dev.azure_client_id, "0042", "leading zeros are kept");
        jail.set_env("LANYARD_GCP_PROJECT_NUMBER", "12x");
        let m = message(load(None, json!({})));
        assert!(
            m.contains("gcp.project_number") && m.contains("numeric project number"),
            "{m}"
        );
        Ok(())
    });
}

#[test]
fn typed_keys_still_parse_from_the_environment() {
    Jail::expect_with(|jail| {
        jail.set_env("LANYARD_CACHE_MAX_ENTRIES", "5000");
        jail.set_env("LANYARD_CACHE_RATE_GCP", "2.5");
        jail.set_env("LANYARD_WEBHOOK_SIDECAR_PORT", "9000");
        jail.set_env("LANYARD_CLUSTER_TOKEN_REVIEW", "true");
        jail.set_env("LANYARD_SIDECAR_STANDALONE", "false");
        jail.set_env("LANYARD_LOG_FORMAT", "json");
        jail.set_env("LANYARD_ADMIN_LISTEN", "127.0.0.1:9100");
        jail.set_env("LANYARD_SIDECAR_ANNOTATIONS", "{a=b}");
        let c = load(None, json!({})).unwrap();
        assert_eq!(c.cache.max_entries, 5000);
        assert_eq!(c.cache.rate_gcp, 2.5);
        assert_eq!(c.webhook.sidecar_port, 9000);
        assert!(c.cluster.token_review);
        assert!(!c.sidecar.standalone);
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.admin_listen.port(), 9100);
        assert_eq!(
            c.sidecar.annotations.get("a").map(String::as_str),
            Some("b")
        );

        jail.set_env("LANYARD_CACHE_MAX_ENTRIES", "many");
        let m = message(load(None, json!({})));
        assert!(
            m.contains("cache.max_entries") && m.contains("LANYARD_CACHE_MAX_ENTRIES"),
            "{m}"
        );
        Ok(())
    });
}

#[test]
fn only_lists_and_maps_are_structured() {
    let mut keys = std::collections::BTreeSet::new();
    structured_keys(
        &serde_json::to_value(Config::default()).unwrap(),
        "",
        &mut keys,
    );
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "azure.node_identities",
            "cluster.namespaces",
            "cluster.service_accounts",
            "dev.aws_role_arns",
            "dev.azure_client_ids",
            "dev.gcp_service_accounts",
            "dev.pod_labels",
            "dev.service_accounts",
            "sidecar.annotations",
            "webhook.guard_extra_audiences"
        ]
    );
}

#[test]
fn sidecar_resources_take_kubernetes_quantities() {
    for good in [
        "10m",
        "0.5",
        "16Mi",
        "1G",
        "2",
        "+1",
        "1e3",
        "128974848",
        ".5Gi",
    ] {
        assert!(is_quantity(good), "{good}");
    }
    for bad in ["", "-1", "16MB", "1.2.3", "m", "10 m", "1e", "Mi16"] {
        assert!(!is_quantity(bad), "{bad}");
    }
    Jail::expect_with(|jail| {
        jail.set_env("LANYARD_WEBHOOK_SIDECAR_MEMORY_LIMIT", "64MB");
        let m = message(load(None, json!({})));
        assert!(
            m.contains("webhook.sidecar_memory_limit") && m.contains("64MB"),
            "{m}"
        );
        jail.set_env("LANYARD_WEBHOOK_SIDECAR_MEMORY_LIMIT", "128Mi");
        let c = load(None, json!({})).unwrap();
        let injected = crate::webhook::InjectionConfig::from_config(&c).resources;
        assert_eq!(injected.memory_limit.as_deref(), Some("128Mi"));
        assert_eq!(injected.cpu_limit, None);
        Ok(())
    });
}

/// Every cloud's section maps from `LANYARD_<CLOUD>_<KEY>`, from the cloud
/// table alone: no list of sections for a new cloud to join.
#[test]
fn each_clouds_section_maps_from_its_environment_variables() {
    Jail::expect_with(|jail| {
        for cloud in crate::cloud::Cloud::ALL {
            jail.set_env(
                format!("LANYARD_{}_AUDIENCE", cloud.name().to_ascii_uppercase()),
                format!("api://from-env-{}", cloud.name()),
            );
        }
        let c = load(None, json!({})).unwrap();
        let as_json = serde_json::to_value(&c).unwrap();
        for cloud in crate::cloud::Cloud::ALL {
            assert_eq!(
                as_json[cloud.name()]["audience"],
                format!("api://from-env-{}", cloud.name()),
                "{cloud:?}"
            );
        }
        Ok(())
    });
}

#[test]
fn sidecars_learn_a_universe_other_than_googles_and_the_region() {
    let mut gcp = gcp::Settings::default();
    let (azure, aws) = (azure::Settings::default(), aws::Settings::default());
    let defaults = |gcp: &gcp::Settings| {
        CloudSettings {
            azure: &azure,
            gcp,
            aws: &aws,
        }
        .sdk_defaults()
    };
    let vars = defaults(&gcp).sidecar_vars();
    assert_eq!(vars, vec![("LANYARD_AWS_REGION", aws.region.clone())]);
    gcp.universe_domain = "apis-tpczero.goog".into();
    let vars = defaults(&gcp).sidecar_vars();
    assert!(vars.contains(&("LANYARD_GCP_UNIVERSE_DOMAIN", "apis-tpczero.goog".into())));
}

/// The slim `lanyard-sidecar` loads its own schema from the same sources:
/// for the same file, variables and flags, it must see what `lanyard
/// sidecar` sees, defaults included.
#[test]
fn the_slim_sidecar_reads_what_the_full_configuration_gives_it() {
    use lanyard_sidecar::config::Settings;
    Jail::expect_with(|jail| {
        let slim = |file: Option<&str>, flags: serde_json::Value| {
            Settings::load(file.map(std::path::Path::new), flags).unwrap()
        };
        assert_eq!(Config::default().sidecar_settings(), Settings::default());
        assert_eq!(
            load(None, json!({})).unwrap().sidecar_settings(),
            slim(None, json!({}))
        );
        jail.create_file(
            "lanyard.yaml",
            "log_format: json\nlisten: 127.0.0.1:9100\ncache:\n  max_entries: 50\nsidecar:\n  grant_reuse_seconds: 3\n  identity_header: from-file\nazure:\n  tenant_id: contoso.onmicrosoft.com\n  audience: api://AzureADTokenExchange\ngcp:\n  universe_domain: apis-tpczero.goog\n",
        )?;
        jail.set_env("LANYARD_AWS_REGION", "eu-central-1");
        jail.set_env("LANYARD_AGENT_URL", "http://10.0.0.4:8700");
        jail.set_env("LANYARD_SIDECAR_PROBE_LISTEN", "0.0.0.0:8643");
        let flags = json!({"log_level": "debug", "sidecar": {"token_dir": "/var/run/lanyard"}});
        let full = load(Some("lanyard.yaml"), flags.clone())
            .unwrap()
            .sidecar_settings();
        assert_eq!(full, slim(Some("lanyard.yaml"), flags));
        assert_eq!(
            full.sdk_defaults.aws_region.as_deref(),
            Some("eu-central-1")
        );
        assert_eq!(full.sidecar.grant_reuse_seconds, 3);
        assert_eq!(
            full.sdk_defaults.gcp_universe_domain.as_deref(),
            Some("apis-tpczero.goog")
        );
        // Every top-level key of the full configuration is one the slim
        // sidecar reads, a cloud's section, or another role's.
        let read = ["log_format", "log_level", "listen", "sidecar"];
        let defaults = serde_json::to_value(Config::default()).unwrap();
        for key in defaults.as_object().unwrap().keys() {
            let known = read.contains(&key.as_str())
                || crate::cloud::Cloud::ALL.iter().any(|c| c.name() == key)
                || lanyard_sidecar::config::OTHER_ROLES_KEYS.contains(&key.as_str());
            assert!(known, "the slim sidecar would refuse `{key}`");
        }
        Ok(())
    });
}
