//! A CA and a serving certificate it signs, for emulators and fakes that
//! clients must reach over TLS as they reach the real service: the CA goes
//! into the client's trust store (a pod's `ca.crt`, a namespace's trust
//! bundle), the certificate and key to the listener.

/// A CA (PEM, for trust stores) and the serving certificate it signs.
pub struct Pki {
    /// The CA's certificate.
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// The serving certificate's private key (PKCS#8).
    pub key_pem: String,
}

impl Pki {
    /// A new CA named `ca_name` and a certificate it signs for `names`
    /// (DNS names or IP addresses).
    pub fn generate(ca_name: &str, names: Vec<String>) -> anyhow::Result<Pki> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, ca_name);
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate()?;
        let cert = CertificateParams::new(names)?.signed_by(&key, &issuer)?;
        Ok(Pki {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}
