//! The API server over HTTPS, as clusters serve it and as kubectl needs it
//! (client-go sends a bearer token only over TLS, kubernetes/kubectl#744),
//! with an administrator's kubeconfig; and the mesh injector (someone
//! else's mutating webhook, `lanyard_fake_kube::mesh_injector`) on a TLS
//! listener of its own, for tests to register beside Lanyard's.
//!
//! One CA signs both certificates; it is the cluster's CA that pods find
//! as `ca.crt` in their `kube-api-access-*` volume (`kube-root-ca.crt`).
//!
//! With AKS identity bindings, the API's listener also answers to the
//! identity-binding proxy's server name, and a connection whose TLS
//! handshake named it reaches the proxy: at AKS the proxy shares the API
//! server's address and is told apart by that name alone
//! (`AZURE_KUBERNETES_SNI_NAME`, cloud-provider-azure pull request #9907).
//! Any other name, or none, reaches the API server.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use lanyard_fake_kube::FakeKube;
use serde_json::{json, Value};

/// What the HTTPS side reports on start.
pub struct Https {
    /// `https://HOST:PORT` of the API.
    pub api: String,
    /// The administrator's kubeconfig file.
    pub admin_kubeconfig: std::path::PathBuf,
    /// The cluster CA (PEM) file.
    pub ca: std::path::PathBuf,
    /// `https://HOST:PORT/inject` of the mesh injector.
    pub mesh_injector: String,
}

/// Starts both listeners on `host`; writes `ca.crt` and
/// `admin.kubeconfig` into `dir`.
/// `proxy`: the identity-binding proxy's server name and router.
pub async fn start(
    kube: Arc<FakeKube>,
    host: IpAddr,
    dir: &Path,
    proxy: Option<(String, axum::Router)>,
) -> anyhow::Result<Https> {
    let mut names = vec![
        host.to_string(),
        "localhost".to_string(),
        "kubernetes.default.svc".to_string(),
        "kubernetes.default.svc.cluster.local".to_string(),
    ];
    let api = match proxy {
        Some((sni, proxy)) => {
            names.push(sni.clone());
            by_server_name(kube.router(), sni, proxy)
        }
        None => kube.router(),
    };
    let pki = crate::clouds::Pki::generate("lanyard-fake-kube cluster CA", names)?;
    let rustls = axum_server::tls_rustls::RustlsConfig::from_pem(
        pki.cert_pem.into_bytes(),
        pki.key_pem.into_bytes(),
    )
    .await?;

    let api = serve(api, SocketAddr::new(host, 0), rustls.clone())?;
    let (mesh, _calls) = lanyard_fake_kube::mesh_injector::mesh_injector();
    let mesh = serve(mesh, SocketAddr::new(host, 0), rustls)?;

    let ca = dir.join("ca.crt");
    std::fs::write(&ca, &pki.ca_pem)?;
    let api_url = format!("https://{api}");
    let admin = admin_kubeconfig(&kube, &api_url, &pki.ca_pem)?;
    let admin_kubeconfig = dir.join("admin.kubeconfig");
    std::fs::write(&admin_kubeconfig, admin)?;
    Ok(Https {
        api: api_url,
        admin_kubeconfig,
        ca,
        mesh_injector: format!("https://{mesh}/inject"),
    })
}

/// `api`, except for connections whose handshake named `name`, which
/// reach `proxy`.
fn by_server_name(api: axum::Router, name: String, proxy: axum::Router) -> axum::Router {
    use tower::ServiceExt;
    axum::Router::new().fallback(move |req: axum::extract::Request| {
        let named = req
            .extensions()
            .get::<Arc<axum_server::tls::TlsInfo>>()
            .and_then(|info| info.server_name.as_deref())
            .is_some_and(|n| n.eq_ignore_ascii_case(&name));
        let to = if named { proxy.clone() } else { api.clone() };
        async move {
            match to.oneshot(req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            }
        }
    })
}

fn serve(
    router: axum::Router,
    addr: SocketAddr,
    rustls: axum_server::tls_rustls::RustlsConfig,
) -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let server = axum_server::from_tcp_rustls(listener, rustls)?;
    tokio::spawn(async move { server.serve(router.into_make_service()).await });
    Ok(local)
}

/// The administrator's kubeconfig, with the CA inline.
fn admin_kubeconfig(kube: &FakeKube, server: &str, ca_pem: &str) -> anyhow::Result<String> {
    let text = kube
        .admin_kubeconfig(server)
        .ok_or_else(|| anyhow::anyhow!("no admin token set"))?;
    let mut doc: Value = serde_norway::from_str(&text)?;
    doc["clusters"][0]["cluster"]["certificate-authority-data"] = json!(STANDARD.encode(ca_pem));
    Ok(serde_norway::to_string(&doc)?)
}
