//! Configuration layering and validation. figment's Jail serialises tests
//! that touch the process environment and the working directory.

#![allow(clippy::result_large_err)] // figment::Error is what Jail closures return

use super::*;
use figment::Jail;
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
