//! HTTPS for the simulator, as vLLM serves it with `--ssl-certfile`, `--ssl-keyfile` and
//! `--ssl-ca-certs` (client certificates required): the server side, a blocking client for
//! requests through the balancer, and a certificate authority made for the test (rcgen).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::{
    crypto::CryptoProvider,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName},
    server::WebPkiClientVerifier,
    ClientConfig, ClientConnection, RootCertStore, ServerConfig, StreamOwned,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::client::{connect, exchange, Reply};

/// A certificate authority in a directory: its certificate in `ca.pem`, and the
/// certificates it issues beside it.
pub struct Pki {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
}

impl Pki {
    pub fn new(dir: &Path) -> Result<Pki> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        params
            .distinguished_name
            .push(DnType::CommonName, "balancer test CA");
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        std::fs::create_dir_all(dir)?;
        let pki = Pki {
            issuer,
            dir: dir.to_owned(),
        };
        std::fs::write(pki.ca_file(), pki.issuer.pem())?;
        Ok(pki)
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A certificate for `names` (DNS names or addresses), written to `NAME.pem` and its key
    /// to `NAME.key`.
    pub fn issue(&self, name: &str, names: &[&str]) -> Result<(PathBuf, PathBuf)> {
        let key = KeyPair::generate()?;
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let cert = CertificateParams::new(names)?.signed_by(&key, &self.issuer)?;
        let files = (
            self.dir.join(format!("{name}.pem")),
            self.dir.join(format!("{name}.key")),
        );
        std::fs::write(&files.0, cert.pem())?;
        std::fs::write(&files.1, key.serialize_pem())?;
        Ok(files)
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .with_context(|| format!("reading {}", path.display()))
}

fn roots(ca: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in certs(ca)? {
        roots.add(cert)?;
    }
    Ok(roots)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).with_context(|| format!("reading {}", path.display()))
}

/// A server's TLS: its certificate and key, and the CA whose client certificates it requires,
/// if any.
pub fn server_config(
    cert: &Path,
    key_file: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerConfig> {
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                .build()?,
        ),
        None => builder.with_no_client_auth(),
    };
    Ok(builder.with_single_cert(certs(cert)?, key(key_file)?)?)
}

/// Bound on a client's TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` over TLS, a task per connection: a failed or stalled handshake ends its
/// connection only. Like `axum::serve`, it waits and goes on after a failed accept (out of
/// file descriptors, a connection reset before it was accepted).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    config: Arc<ServerConfig>,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(config);
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
            if let Ok(Ok(tls)) = handshake {
                let service = TowerToHyperService::new(router);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            }
        });
    }
}

/// A client's TLS: trusting `ca`, with a certificate and key of its own if given.
pub fn client_config(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Arc<ClientConfig>> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca)?);
    Ok(Arc::new(match identity {
        Some((cert, key_file)) => builder.with_client_auth_cert(certs(cert)?, key(key_file)?)?,
        None => builder.with_no_client_auth(),
    }))
}

/// `method path` over TLS, verified for `server_name`, to `addr` from `src_port` (0: any);
/// reads the whole response.
pub fn request_from(
    addr: SocketAddr,
    src_port: u16,
    config: Arc<ClientConfig>,
    server_name: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Reply> {
    let name = ServerName::try_from(server_name.to_owned())?;
    let tls = ClientConnection::new(config, name)?;
    let stream = StreamOwned::new(tls, connect(addr, src_port)?);
    exchange(stream, server_name, method, path, body)
}
