//! How the agent reaches a pool's servers for its health checks and scrapes: the API key
//! they want (`api_key_file`) and, with `[pool.tls]`, HTTPS that verifies their certificates
//! against the pool's CA and can present a client certificate. Read from the files at start,
//! by `check`, and at every reload, so that a rotated key or certificate takes effect with a
//! reload. The program itself passes the clients' TLS through untouched: this is the agent's
//! own traffic only.

use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, LazyLock},
};

use anyhow::{bail, Context, Result};
use reqwest::RequestBuilder;
use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    client::{Resumption, WebPkiServerVerifier},
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName, UnixTime},
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use crate::config::{Config, PoolTls};

/// What the agent needs to reach one pool's servers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Access {
    pub api_key: Option<ApiKey>,
    pub tls: Option<Tls>,
}

/// Every pool's [`Access`], by pool name, read from the files the configuration names.
pub fn load(config: &Config) -> Result<HashMap<String, Access>> {
    let mut all = HashMap::new();
    for pool in &config.pool {
        let api_key = match &pool.api_key_file {
            Some(file) => Some(
                ApiKey::load(file).with_context(|| format!("pool {}: api_key_file", pool.name))?,
            ),
            None => None,
        };
        let tls = match &pool.tls {
            Some(settings) => {
                Some(Tls::load(settings).with_context(|| format!("pool {}: tls", pool.name))?)
            }
            None => None,
        };
        all.insert(pool.name.clone(), Access { api_key, tls });
    }
    Ok(all)
}

/// The bearer token a pool's servers want on their API (`api_key_file`; vLLM's, SGLang's
/// and llama-server's `--api-key`), sent with its health checks and scrapes (llama-server
/// wants it on `/metrics` too). Never printed.
#[derive(Clone, PartialEq)]
pub struct ApiKey(Arc<str>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(hidden)")
    }
}

impl ApiKey {
    /// The key in `path`: its text, less surrounding whitespace, printable ASCII (it goes
    /// into an HTTP header).
    pub fn load(path: &Path) -> Result<ApiKey> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let key = text.trim();
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            bail!(
                "{} holds no key (one line of printable ASCII without spaces)",
                path.display()
            );
        }
        Ok(ApiKey(key.into()))
    }
}

pub fn authorized(request: RequestBuilder, key: Option<&ApiKey>) -> RequestBuilder {
    match key {
        Some(key) => request.bearer_auth(&key.0),
        None => request,
    }
}

/// A pool's TLS client settings, loaded. Two loads are never equal, even of the same files:
/// a client built for one is rebuilt for the next, so a reload picks up rotated files.
#[derive(Debug, Clone)]
pub struct Tls(Arc<ClientConfig>);

impl PartialEq for Tls {
    fn eq(&self, other: &Tls) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Tls {
    pub fn load(settings: &PoolTls) -> Result<Tls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        let ca = &settings.ca_file;
        for (i, cert) in read_certs(ca)?.into_iter().enumerate() {
            roots.add(cert).with_context(|| {
                format!(
                    "{}: certificate {} cannot be used as a trust anchor",
                    ca.display(),
                    i + 1
                )
            })?;
        }
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS versions")?;
        let builder = match &settings.server_name {
            None => builder.with_root_certificates(roots),
            Some(name) => {
                let name = ServerName::try_from(name.clone()).with_context(|| {
                    format!("server_name {name:?} is not a DNS name or address")
                })?;
                let inner =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .context("the CA's certificates")?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ForName { name, inner }))
            }
        };
        let mut config = match (&settings.cert_file, &settings.key_file) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert)?;
                let key = PrivateKeyDer::from_pem_slice(&read(key)?)
                    .with_context(|| format!("{} holds no PEM private key", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .context("cert_file and key_file")?
            }
            _ => builder.with_no_client_auth(),
        };
        // No session resumption: a resumed handshake skips verifying the certificate, so
        // checks would go on passing against a server whose certificate has since expired or
        // been replaced by one the pool's CA never signed.
        config.resumption = Resumption::disabled();
        Ok(Tls(Arc::new(config)))
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// The certificates of the PEM file at `path`: at least one.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(&read(path)?)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: a certificate that cannot be read", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

/// Verifies the servers' certificates for the pool's `server_name` whatever address the
/// agent connects to: servers are reached by address, and their certificates often name the
/// service rather than each server.
#[derive(Debug)]
struct ForName {
    name: ServerName<'static>,
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ForName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _addressed: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The scheme of the agent's URLs to a pool's servers.
pub fn scheme(tls: Option<&Tls>) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

/// A client builder for plain HTTP (`tls` None) or for HTTPS with a pool's settings.
pub fn client_builder(tls: Option<&Tls>) -> reqwest::ClientBuilder {
    // reqwest sets TLS up for plain clients too, from the process's default crypto
    // provider, and panics where there is none (its `rustls-no-provider` feature, which
    // keeps aws-lc out of the build): they get a configuration of their own, trusting
    // nobody, since they never make a TLS connection. Every client of the agent is built
    // here for that reason.
    static PLAIN: LazyLock<ClientConfig> = LazyLock::new(|| {
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth()
    });
    let config = tls.map_or_else(|| PLAIN.clone(), |tls| ClientConfig::clone(&tls.0));
    reqwest::Client::builder().tls_backend_preconfigured(config)
}

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, time::Duration};

    use hyper_util::{rt::TokioIo, service::TowerToHyperService};
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    use std::{path::PathBuf, sync::Mutex};

    use rustls::{
        server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier},
        sign::CertifiedKey,
        ServerConfig,
    };
    use tokio_rustls::TlsAcceptor;

    use super::*;
    use crate::{health::Checker, scrape::Scraper};

    /// A certificate authority that signs servers' and clients' certificates, written as PEM
    /// files into `dir`.
    struct Ca {
        issuer: CertifiedIssuer<'static, KeyPair>,
        dir: PathBuf,
    }

    impl Ca {
        fn new(dir: &Path, name: &str) -> Ca {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
            params.distinguished_name.push(DnType::CommonName, name);
            let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap());
            let ca = Ca {
                issuer: issuer.unwrap(),
                dir: dir.to_owned(),
            };
            std::fs::write(ca.file(name), ca.issuer.pem()).unwrap();
            ca
        }

        fn file(&self, name: &str) -> PathBuf {
            self.dir.join(name)
        }

        /// A certificate for `names` (DNS names or addresses), and its key.
        fn issue(&self, names: &[&str]) -> (rcgen::Certificate, KeyPair) {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(names)
                .unwrap()
                .signed_by(&key, &self.issuer)
                .unwrap();
            (cert, key)
        }

        /// A certificate for `names` and its key, as a server presents them.
        fn certified(&self, names: &[&str]) -> Arc<CertifiedKey> {
            let (cert, key) = self.issue(names);
            let key = PrivateKeyDer::try_from(key.serialize_der()).unwrap();
            let provider = rustls::crypto::ring::default_provider();
            Arc::new(CertifiedKey::from_der(vec![cert.der().clone()], key, &provider).unwrap())
        }

        /// A certificate for `names` written to `NAME.pem`, its key to `NAME.key`.
        fn issue_files(&self, name: &str, names: &[&str]) -> (PathBuf, PathBuf) {
            let (cert, key) = self.issue(names);
            let files = (
                self.file(&format!("{name}.pem")),
                self.file(&format!("{name}.key")),
            );
            std::fs::write(&files.0, cert.pem()).unwrap();
            std::fs::write(&files.1, key.serialize_pem()).unwrap();
            files
        }
    }

    /// The certificate a test server presents, which the test may replace.
    #[derive(Debug)]
    struct Presented(Mutex<Arc<CertifiedKey>>);

    impl ResolvesServerCert for Presented {
        fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
            Some(self.0.lock().unwrap().clone())
        }
    }

    /// An inference server's two routes over HTTPS on loopback, with a certificate for
    /// `names` from `ca`, wanting a client certificate from `clients` if given; and the
    /// certificate it presents.
    async fn serve(ca: &Ca, names: &[&str], clients: Option<&Ca>) -> (SocketAddr, Arc<Presented>) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match clients {
            Some(clients) => {
                let mut roots = RootCertStore::empty();
                roots.add(clients.issuer.der().clone()).unwrap();
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .unwrap();
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let presented = Arc::new(Presented(Mutex::new(ca.certified(names))));
        let config = builder.with_cert_resolver(presented.clone());
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let router = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(|| async {
                    "vllm:num_requests_running{model_name=\"m\"} 3\n\
                     vllm:num_requests_waiting{model_name=\"m\"} 1\n"
                }),
            )
            .route(
                "/v1/completions",
                axum::routing::post(|| async { r#"{"choices":[{"text":"Hi"}]}"# }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let (acceptor, router) = (acceptor.clone(), router.clone());
                tokio::spawn(async move {
                    // A handshake the client refused ends here.
                    if let Ok(tls) = acceptor.accept(tcp).await {
                        let service = TowerToHyperService::new(router);
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(tls), service)
                            .await;
                    }
                });
            }
        });
        (addr, presented)
    }

    fn settings(ca: &Ca, ca_name: &str) -> PoolTls {
        PoolTls {
            ca_file: ca.file(ca_name),
            server_name: None,
            cert_file: None,
            key_file: None,
        }
    }

    /// A scrape and a check of `addr` with `tls`: Ok, or the two errors in one line.
    async fn reach(addr: SocketAddr, tls: &PoolTls) -> Result<(), String> {
        let tls = Tls::load(tls).map_err(|e| format!("{e:#}"))?;
        let limit = Duration::from_secs(5);
        let scraper = Scraper::new(limit, 1 << 20, Some(&tls)).unwrap();
        let checker = Checker::new(limit, Some(&tls)).unwrap();
        let scraped = scraper.scrape(addr, None, None).await;
        let checked = checker.check(addr, "m", None).await;
        match (scraped, checked) {
            (Ok(r), Ok(())) => {
                assert_eq!((r.running, r.waiting), (3.0, 1.0));
                Ok(())
            }
            (s, c) => Err(format!(
                "scrape: {:?}; check: {:?}",
                s.err().map(|e| e.to_string()),
                c.map_err(|e| format!("{e:#}"))
            )),
        }
    }

    #[tokio::test]
    async fn scrapes_and_checks_over_tls_verify_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new(dir.path(), "ca.pem");
        let _other = Ca::new(dir.path(), "other-ca.pem");

        // A certificate for the server's address.
        let (by_address, _) = serve(&ca, &["127.0.0.1"], None).await;
        reach(by_address, &settings(&ca, "ca.pem")).await.unwrap();
        // Another CA's trust is not enough.
        let e = reach(by_address, &settings(&ca, "other-ca.pem"))
            .await
            .unwrap_err();
        assert!(e.contains("UnknownIssuer"), "{e}");
        // Plain HTTP to a TLS server fails, and says so.
        let plain = Scraper::new(Duration::from_secs(5), 1 << 20, None).unwrap();
        let e = plain.scrape(by_address, None, None).await.unwrap_err();
        assert!(e.to_string().contains("invalid HTTP version parsed"), "{e}");

        // A certificate for the service's name only: that name must be given.
        let (by_name, _) = serve(&ca, &["vllm.internal"], None).await;
        let e = reach(by_name, &settings(&ca, "ca.pem")).await.unwrap_err();
        assert!(e.contains(r#"not valid for name \"127.0.0.1\""#), "{e}");
        let named = PoolTls {
            server_name: Some("vllm.internal".into()),
            ..settings(&ca, "ca.pem")
        };
        reach(by_name, &named).await.unwrap();
        let misnamed = PoolTls {
            server_name: Some("sglang.internal".into()),
            ..settings(&ca, "ca.pem")
        };
        let e = reach(by_name, &misnamed).await.unwrap_err();
        assert!(
            e.contains(r#"not valid for name \"sglang.internal\""#),
            "{e}"
        );
    }

    /// Each check verifies the certificate anew: none resumes an earlier session, which
    /// would skip that.
    #[tokio::test]
    async fn a_replaced_certificate_fails_the_next_check() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new(dir.path(), "ca.pem");
        let other = Ca::new(dir.path(), "other-ca.pem");
        let (addr, presented) = serve(&ca, &["127.0.0.1"], None).await;
        let tls = Tls::load(&settings(&ca, "ca.pem")).unwrap();
        let checker = Checker::new(Duration::from_secs(5), Some(&tls)).unwrap();
        for _ in 0..3 {
            checker.check(addr, "m", None).await.unwrap();
        }
        *presented.0.lock().unwrap() = other.certified(&["127.0.0.1"]);
        let e = checker.check(addr, "m", None).await.unwrap_err();
        assert!(format!("{e:#}").contains("UnknownIssuer"), "{e:#}");
    }

    /// Every load is a new setting, even of the same files: what makes a reload rebuild the
    /// clients, and so read rotated files.
    #[test]
    fn two_loads_are_two_settings() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new(dir.path(), "ca.pem");
        let tls = Tls::load(&settings(&ca, "ca.pem")).unwrap();
        assert_eq!(tls, tls.clone());
        assert_ne!(tls, Tls::load(&settings(&ca, "ca.pem")).unwrap());
    }

    #[tokio::test]
    async fn a_client_certificate_where_the_servers_want_one() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new(dir.path(), "ca.pem");
        let (addr, _) = serve(&ca, &["127.0.0.1"], Some(&ca)).await;
        let e = reach(addr, &settings(&ca, "ca.pem")).await.unwrap_err();
        assert!(e.contains("CertificateRequired"), "{e}");
        let (cert_file, key_file) = ca.issue_files("agent", &["balancer-agent"]);
        let with_cert = PoolTls {
            cert_file: Some(cert_file),
            key_file: Some(key_file),
            ..settings(&ca, "ca.pem")
        };
        reach(addr, &with_cert).await.unwrap();
    }

    #[test]
    fn bad_files_are_refused_with_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new(dir.path(), "ca.pem");
        let (cert_file, key_file) = ca.issue_files("agent", &["balancer-agent"]);
        std::fs::write(dir.path().join("empty.pem"), "").unwrap();
        let load = |tls: PoolTls| Tls::load(&tls).map(drop).map_err(|e| format!("{e:#}"));
        assert!(load(settings(&ca, "ca.pem")).is_ok());
        let e = load(settings(&ca, "missing.pem")).unwrap_err();
        assert!(e.contains("reading") && e.contains("missing.pem"), "{e}");
        let e = load(settings(&ca, "empty.pem")).unwrap_err();
        assert!(e.contains("empty.pem holds no PEM certificate"), "{e}");
        // The files swapped: no certificate in the key's, no key in the certificate's.
        let missing = dir.path().join("missing.key");
        for (cert, key, problem) in [
            (&key_file, &key_file, "agent.key holds no PEM certificate"),
            (&cert_file, &cert_file, "agent.pem holds no PEM private key"),
            (&cert_file, &missing, "missing.key: No such file"),
        ] {
            let e = load(PoolTls {
                cert_file: Some(cert.clone()),
                key_file: Some(key.clone()),
                ..settings(&ca, "ca.pem")
            })
            .unwrap_err();
            assert!(e.contains(problem), "{e}");
        }
    }

    #[test]
    fn api_keys_are_one_printable_word_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let key = ApiKey::load(&file("good", "  sk-abc123\n")).unwrap();
        assert_eq!(&*key.0, "sk-abc123");
        assert_eq!(format!("{key:?}"), "ApiKey(hidden)");
        for (name, text) in [
            ("empty", "\n"),
            ("two words", "sk-a sk-b"),
            ("control", "sk\x07"),
        ] {
            let err = ApiKey::load(&file(name, text)).unwrap_err();
            assert!(
                format!("{err:#}").contains("holds no key"),
                "{name}: {err:#}"
            );
        }
        let missing = ApiKey::load(&dir.path().join("missing")).unwrap_err();
        assert!(format!("{missing:#}").contains("reading"), "{missing:#}");
    }
}
