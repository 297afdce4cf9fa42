//! A private certificate authority for the tests and the dev cell: a CA, a server
//! certificate for the proxies (valid for 127.0.0.1 and localhost) and client
//! certificates whose subject common name is the client's identity.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// PEM files written to a folder.
#[derive(Debug, Clone)]
pub struct Pems {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA that signs server and client certificates into `dir`.
pub struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    /// The CA's certificate (PEM), for --tls-client-ca and clients' --tls-ca.
    pub ca: PathBuf,
}

impl Authority {
    /// A new CA, its certificate written to `dir/ca.pem`.
    pub fn new(dir: &Path) -> anyhow::Result<Authority> {
        std::fs::create_dir_all(dir)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "lockcell test CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, issuer.pem())?;
        Ok(Authority {
            issuer,
            dir: dir.to_path_buf(),
            ca,
        })
    }

    /// A server certificate for 127.0.0.1 and localhost, as `NAME.pem`/`NAME-key.pem`.
    pub fn server(&self, name: &str) -> anyhow::Result<Pems> {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(name, params)
    }

    /// A client certificate whose subject common name is `identity`.
    pub fn client(&self, identity: &str) -> anyhow::Result<Pems> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, identity);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(&format!("client-{identity}"), params)
    }

    fn sign(&self, name: &str, params: CertificateParams) -> anyhow::Result<Pems> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let pems = Pems {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}-key.pem")),
        };
        std::fs::write(&pems.cert, cert.pem())?;
        std::fs::write(&pems.key, key.serialize_pem())?;
        Ok(pems)
    }
}

/// What a grants file lists for a bearer token: its SHA-256, in lowercase hex.
pub fn token_sha256(token: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
