//! Fetching a server's metrics: one bounded HTTP GET, then [`dialect::parse`].
//!
//! Bounded in time (one deadline for connect, headers and body) and in size (a body larger
//! than the limit is refused as soon as that is known, from `Content-Length` or while
//! reading; nothing past the limit is read). HTTP/1.1, plain or with a pool's TLS
//! settings (`access::Tls`), no proxy (the environment's `http_proxy` would otherwise
//! apply), no redirects (a 3xx is an error), no compression (nothing asks for it). Connections are kept alive between scrapes, so keep one
//! `Scraper` (or clones of it: they share the pool) rather than building one per round.

use std::{net::SocketAddr, time::Duration};

use tokio::time::Instant;

use crate::{
    access::{self, authorized, ApiKey, Tls},
    dialect::{self, Dialect, DialectError, Reading},
};

/// Largest metrics body accepted by default. vLLM with several engines prints well under
/// 1 MiB; a larger body is a misconfigured or misbehaving server.
pub const DEFAULT_MAX_METRICS_BYTES: usize = 4 << 20;

/// Why a scrape gave no reading. Each message is one line and names the server.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("scrape {addr}: cannot connect: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("scrape {addr}: no complete answer within {} ms", .timeout.as_millis())]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("scrape {addr}: HTTP {status} from {path}")]
    Status {
        addr: SocketAddr,
        path: String,
        status: u16,
    },
    #[error("scrape {addr}: {reason}")]
    Http { addr: SocketAddr, reason: String },
    #[error("scrape {addr}: metrics body larger than {max} bytes")]
    TooLarge { addr: SocketAddr, max: usize },
    #[error("scrape {addr}: metrics body is not UTF-8 (bad byte at offset {offset})")]
    NotUtf8 { addr: SocketAddr, offset: usize },
    #[error("scrape {addr}: {error}")]
    Dialect {
        addr: SocketAddr,
        error: DialectError,
    },
}

impl ScrapeError {
    /// The server the scrape was for.
    pub fn addr(&self) -> SocketAddr {
        match self {
            ScrapeError::Connect { addr, .. }
            | ScrapeError::Timeout { addr, .. }
            | ScrapeError::Status { addr, .. }
            | ScrapeError::Http { addr, .. }
            | ScrapeError::TooLarge { addr, .. }
            | ScrapeError::NotUtf8 { addr, .. }
            | ScrapeError::Dialect { addr, .. } => *addr,
        }
    }
}

/// Fetches metrics, over plain HTTP or with one pool's TLS settings. Cheap to clone (the
/// clones share one connection pool); `scrape` takes `&self`, so one scraper serves any
/// number of concurrent scrapes.
#[derive(Debug, Clone)]
pub struct Scraper {
    client: reqwest::Client,
    tls: Option<Tls>,
    timeout: Duration,
    max_bytes: usize,
}

impl Scraper {
    pub fn new(timeout: Duration, max_bytes: usize, tls: Option<&Tls>) -> anyhow::Result<Self> {
        anyhow::ensure!(!timeout.is_zero(), "scrape timeout must be above zero");
        anyhow::ensure!(max_bytes > 0, "metrics body limit must be above zero");
        let client = access::client_builder(tls)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(timeout)
            .timeout(timeout)
            // Kept-alive connections: servers are scraped every interval (down to 100 ms).
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(2)
            .tcp_nodelay(true)
            .user_agent(concat!("balancer-agent/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Scraper {
            client,
            tls: tls.cloned(),
            timeout,
            max_bytes,
        })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The TLS settings it was built with.
    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    /// GET http(s)://addr/metrics within the timeout, reading at most `max_bytes`, then
    /// [`dialect::parse`].
    ///
    /// With the dialect forced to `trtllm`, the path is `/prometheus/metrics` (see
    /// [`Dialect::metrics_path`]), and `/metrics` only if that one is 404 (a separate metrics
    /// port, as the test simulator has), both within the one timeout. Without forcing,
    /// `/metrics` only: on a real `trtllm-serve` that is JSON (an error saying to set the
    /// dialect), and polling it would consume the iteration stats the server's own
    /// Prometheus gauges are made from.
    pub async fn scrape(
        &self,
        addr: SocketAddr,
        forced: Option<Dialect>,
        key: Option<&ApiKey>,
    ) -> Result<Reading, ScrapeError> {
        let deadline = Instant::now() + self.timeout;
        let path = forced.map_or("/metrics", Dialect::metrics_path);
        let mut fell_back = false;
        let body = match self.get(addr, path, key, deadline).await {
            Err(ScrapeError::Status { status: 404, .. }) if path != "/metrics" => {
                fell_back = true;
                self.get(addr, "/metrics", key, deadline).await
            }
            other => other,
        }?;
        match parse(addr, body, forced) {
            // The JSON error's advice (set the dialect) is what the operator did already.
            Err(ScrapeError::Dialect {
                error: DialectError::Json,
                ..
            }) if fell_back => Err(ScrapeError::Http {
                addr,
                reason: format!(
                    "HTTP 404 from {path}, and /metrics is JSON: this trtllm-serve \
                     publishes no Prometheus metrics"
                ),
            }),
            other => other,
        }
    }

    /// Like [`Scraper::scrape`], from exactly this path (starting with '/').
    pub async fn scrape_path(
        &self,
        addr: SocketAddr,
        path: &str,
        forced: Option<Dialect>,
        key: Option<&ApiKey>,
    ) -> Result<Reading, ScrapeError> {
        let body = self
            .get(addr, path, key, Instant::now() + self.timeout)
            .await?;
        parse(addr, body, forced)
    }

    /// The body, by the deadline whatever reqwest's own timeouts cover.
    async fn get(
        &self,
        addr: SocketAddr,
        path: &str,
        key: Option<&ApiKey>,
        deadline: Instant,
    ) -> Result<Vec<u8>, ScrapeError> {
        match tokio::time::timeout_at(deadline, self.fetch(addr, path, key)).await {
            Ok(body) => body,
            Err(_) => Err(ScrapeError::Timeout {
                addr,
                timeout: self.timeout,
            }),
        }
    }

    async fn fetch(
        &self,
        addr: SocketAddr,
        path: &str,
        key: Option<&ApiKey>,
    ) -> Result<Vec<u8>, ScrapeError> {
        let too_large = || ScrapeError::TooLarge {
            addr,
            max: self.max_bytes,
        };
        let request = self
            .client
            .get(format!(
                "{}://{addr}{path}",
                access::scheme(self.tls.as_ref())
            ))
            // What Prometheus itself would accept: the text format, never protobuf.
            .header(
                reqwest::header::ACCEPT,
                "text/plain;version=0.0.4;q=1,*/*;q=0.1",
            );
        let mut resp = authorized(request, key)
            .send()
            .await
            .map_err(|e| self.error(addr, &e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ScrapeError::Status {
                addr,
                path: path.to_string(),
                status: status.as_u16(),
            });
        }
        body_at_most(&mut resp, self.max_bytes)
            .await
            .map_err(|e| self.error(addr, &e))?
            .ok_or_else(too_large)
    }

    fn error(&self, addr: SocketAddr, e: &reqwest::Error) -> ScrapeError {
        if e.is_timeout() {
            ScrapeError::Timeout {
                addr,
                timeout: self.timeout,
            }
        } else if e.is_connect() {
            ScrapeError::Connect {
                addr,
                reason: causes(e),
            }
        } else {
            ScrapeError::Http {
                addr,
                reason: causes(e),
            }
        }
    }
}

fn parse(addr: SocketAddr, body: Vec<u8>, forced: Option<Dialect>) -> Result<Reading, ScrapeError> {
    let text = String::from_utf8(body).map_err(|e| ScrapeError::NotUtf8 {
        addr,
        offset: e.utf8_error().valid_up_to(),
    })?;
    dialect::parse(&text, forced).map_err(|error| ScrapeError::Dialect { addr, error })
}

/// The causes under reqwest's "error sending request for url (...)" (which only repeats the
/// address), joined on one line: "connection closed before message completed",
/// "tcp connect error: Connection refused (os error 111)".
fn causes(e: &reqwest::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        // hyper-util's "client error (Connect)" and the like say nothing the next one does not.
        if !text.is_empty() && !text.starts_with("client error (") && !parts.contains(&text) {
            parts.push(text);
        }
        next = cause.source();
    }
    if parts.is_empty() {
        e.to_string()
    } else {
        parts.join(": ").replace('\n', " ")
    }
}

/// `resp`'s body, or None once it would pass `max` bytes (announced so, or read so): what
/// scrapes and health checks read of a server, so that none costs more memory than that.
pub async fn body_at_most(
    resp: &mut reqwest::Response,
    max: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Ok(None);
    }
    let mut body = Vec::with_capacity(
        resp.content_length()
            .map_or(64 << 10, |n| n as usize)
            .min(max),
    );
    while let Some(chunk) = resp.chunk().await? {
        if chunk.len() > max - body.len() {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            atomic::{AtomicUsize, Ordering},
            Arc,
        },
        time::Instant,
    };

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
        task::JoinSet,
    };

    use super::*;

    const GOOD: &str = "\
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
";

    /// Every test is over well within this, or it fails instead of hanging.
    const BOUND: Duration = Duration::from_secs(10);

    #[derive(Clone, Copy)]
    enum Behaviour {
        /// 200 with this body at /metrics (404 elsewhere), keeping the connection.
        Body(&'static str),
        /// The same at another path.
        BodyAt(&'static str, &'static str),
        /// 200, `Content-Length` of this many bytes, and then the bytes.
        Huge(usize),
        /// 200, chunked, as many bytes as it can until the client hangs up.
        HugeChunked,
        /// Reads the request, then says nothing for this long.
        Slow(Duration),
        /// Headers at once, then the body after this long.
        SlowBody(Duration),
        Status(u16),
        Redirect,
        /// Reads the request, then closes the connection.
        Close,
        /// Answers with bytes that are not UTF-8.
        Latin1,
        /// 401 unless the request carries `Authorization: Bearer` with this key, as
        /// llama-server started with `--api-key` answers on `/metrics`.
        Keyed(&'static str),
    }

    /// A tiny HTTP/1.1 server on 127.0.0.1; counts the connections it accepted.
    async fn serve(b: Behaviour) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let _ = answer(conn, b).await;
                });
            }
        });
        (addr, accepted)
    }

    async fn answer(mut conn: TcpStream, b: Behaviour) -> std::io::Result<()> {
        loop {
            let request = read_request(&mut conn).await?;
            let path = request.split(' ').nth(1).unwrap_or_default().to_string();
            let b = match b {
                Behaviour::Body(body) => Behaviour::BodyAt("/metrics", body),
                b => b,
            };
            match b {
                Behaviour::BodyAt(at, _) if at != path => {
                    conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                        .await?;
                    continue;
                }
                Behaviour::Body(body) | Behaviour::BodyAt(_, body) => {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                         Content-Length: {}\r\n\r\n",
                        body.len()
                    );
                    conn.write_all(head.as_bytes()).await?;
                    conn.write_all(body.as_bytes()).await?;
                    continue;
                }
                Behaviour::Huge(n) => {
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n");
                    conn.write_all(head.as_bytes()).await?;
                    let line = b"filler_metric_with_a_long_name{label=\"value\"} 1\n";
                    let mut sent = 0;
                    while sent < n {
                        let k = line.len().min(n - sent);
                        conn.write_all(&line[..k]).await?;
                        sent += k;
                    }
                }
                Behaviour::HugeChunked => {
                    conn.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                        .await?;
                    let chunk = vec![b'#'; 64 << 10];
                    for _ in 0..1000 {
                        conn.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                            .await?;
                        conn.write_all(&chunk).await?;
                        conn.write_all(b"\r\n").await?;
                    }
                }
                Behaviour::Slow(d) => tokio::time::sleep(d).await,
                Behaviour::SlowBody(d) => {
                    conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
                        .await?;
                    tokio::time::sleep(d).await;
                }
                Behaviour::Status(code) => {
                    let body = "Internal Server Error";
                    let head = format!(
                        "HTTP/1.1 {code} Oops\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    conn.write_all(head.as_bytes()).await?;
                    continue;
                }
                Behaviour::Redirect => {
                    let head = "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/metrics\r\n\
                                Content-Length: 0\r\n\r\n";
                    conn.write_all(head.as_bytes()).await?;
                    continue;
                }
                Behaviour::Keyed(key) => {
                    let bearer = format!("Bearer {key}");
                    let authorized = request.lines().any(|line| {
                        line.split_once(':').is_some_and(|(name, value)| {
                            name.eq_ignore_ascii_case("authorization") && value.trim() == bearer
                        })
                    });
                    let (status, body) = if authorized {
                        (
                            "200 OK",
                            "inference_requests_running 2\ninference_requests_waiting 0\n",
                        )
                    } else {
                        ("401 Unauthorized", "")
                    };
                    let head = format!(
                        "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n",
                        body.len()
                    );
                    conn.write_all(head.as_bytes()).await?;
                    conn.write_all(body.as_bytes()).await?;
                    continue;
                }
                Behaviour::Close => {}
                Behaviour::Latin1 => {
                    let body = b"inference_requests_running 1\n# caf\xe9\n";
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                    conn.write_all(head.as_bytes()).await?;
                    conn.write_all(body).await?;
                    continue;
                }
            }
            return Ok(());
        }
    }

    async fn read_request(conn: &mut TcpStream) -> std::io::Result<String> {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            if conn.read(&mut byte).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            buf.push(byte[0]);
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    fn scraper(timeout_ms: u64) -> Scraper {
        Scraper::new(
            Duration::from_millis(timeout_ms),
            DEFAULT_MAX_METRICS_BYTES,
            None,
        )
        .unwrap()
    }

    async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(BOUND, f)
            .await
            .expect("test took too long")
    }

    #[tokio::test]
    async fn good_exposition_over_one_kept_alive_connection() {
        let (addr, accepted) = serve(Behaviour::Body(GOOD)).await;
        let s = scraper(2000);
        for _ in 0..3 {
            let r = bounded(s.scrape(addr, None, None)).await.unwrap();
            assert_eq!(r.dialect, Dialect::Llamacpp);
            assert_eq!((r.running, r.waiting), (3.0, 1.0));
        }
        // A clone shares the pool.
        bounded(s.clone().scrape(addr, Some(Dialect::Llamacpp), None))
            .await
            .unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// A pool's API key goes with its scrapes: llama-server wants it on `/metrics`.
    #[tokio::test]
    async fn the_api_key_goes_with_the_scrape() {
        let (addr, _) = serve(Behaviour::Keyed("sk-1")).await;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "sk-1\n").unwrap();
        let key = ApiKey::load(&file).unwrap();
        let s = scraper(2000);
        let r = bounded(s.scrape(addr, None, Some(&key))).await.unwrap();
        assert_eq!(r.running, 2.0);
        let e = bounded(s.scrape(addr, None, None)).await.unwrap_err();
        assert!(e.to_string().contains("HTTP 401 from /metrics"), "{e}");
    }

    #[tokio::test]
    async fn many_servers_at_once() {
        let s = scraper(2000);
        let mut set = JoinSet::new();
        for _ in 0..8 {
            let (addr, _) = serve(Behaviour::Body(GOOD)).await;
            let s = s.clone();
            set.spawn(async move { s.scrape(addr, None, None).await });
        }
        let results = bounded(set.join_all()).await;
        assert_eq!(results.len(), 8);
        assert!(results.iter().all(|r| r.as_ref().unwrap().running == 3.0));
    }

    #[tokio::test]
    async fn forced_trtllm_uses_its_prometheus_path() {
        const TRT: &str = "trtllm_num_requests_running{model_name=\"m\"} 2.0\n\
                           trtllm_num_requests_waiting{model_name=\"m\"} 0.0\n";
        let (addr, _) = serve(Behaviour::BodyAt("/prometheus/metrics", TRT)).await;
        let s = scraper(2000);
        // Straight from /prometheus/metrics.
        let r = bounded(s.scrape(addr, Some(Dialect::Trtllm), None))
            .await
            .unwrap();
        assert_eq!((r.dialect, r.running), (Dialect::Trtllm, 2.0));
        // A metrics port with only /metrics: 404 on the first path, then /metrics.
        let (metrics_port, _) = serve(Behaviour::Body(TRT)).await;
        let r = bounded(s.scrape(metrics_port, Some(Dialect::Trtllm), None))
            .await
            .unwrap();
        assert_eq!((r.dialect, r.running), (Dialect::Trtllm, 2.0));
        // A trtllm-serve without Prometheus metrics: /metrics is its JSON, and the error
        // does not tell the operator to force the dialect they forced.
        let (json, _) = serve(Behaviour::Body("[{\"iter\": 1}]")).await;
        let e = bounded(s.scrape(json, Some(Dialect::Trtllm), None))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "scrape {json}: HTTP 404 from /prometheus/metrics, and /metrics is JSON: \
                 this trtllm-serve publishes no Prometheus metrics"
            )
        );
        // Any other failure of the first path is the answer.
        let (failing, _) = serve(Behaviour::Status(500)).await;
        let e = bounded(s.scrape(failing, Some(Dialect::Trtllm), None))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("scrape {failing}: HTTP 500 from /prometheus/metrics")
        );
        // An explicit path is taken as it is.
        let r = bounded(s.scrape_path(addr, "/prometheus/metrics", None, None))
            .await
            .unwrap();
        assert_eq!(r.dialect, Dialect::Trtllm);
        // Undetected, it is looked for on /metrics, like every other dialect.
        let e = bounded(s.scrape(addr, None, None)).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("scrape {addr}: HTTP 404 from /metrics")
        );
    }

    #[tokio::test]
    async fn too_large_with_content_length() {
        let (addr, _) = serve(Behaviour::Huge(10_000_000)).await;
        let started = Instant::now();
        let e = bounded(scraper(5000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert!(
            matches!(e, ScrapeError::TooLarge { max, .. } if max == 4 << 20),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            format!("scrape {addr}: metrics body larger than 4194304 bytes")
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn too_large_chunked_stops_reading() {
        let (addr, _) = serve(Behaviour::HugeChunked).await;
        let started = Instant::now();
        let s = Scraper::new(Duration::from_secs(5), 1 << 20, None).unwrap();
        let e = bounded(s.scrape(addr, None, None)).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("scrape {addr}: metrics body larger than 1048576 bytes")
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn slow_answer_times_out() {
        for b in [
            Behaviour::Slow(Duration::from_secs(30)),
            Behaviour::SlowBody(Duration::from_secs(30)),
        ] {
            let (addr, _) = serve(b).await;
            let started = Instant::now();
            let e = bounded(scraper(300).scrape(addr, None, None))
                .await
                .unwrap_err();
            let took = started.elapsed();
            assert!(matches!(e, ScrapeError::Timeout { .. }), "{e}");
            assert_eq!(
                e.to_string(),
                format!("scrape {addr}: no complete answer within 300 ms")
            );
            assert!(
                took >= Duration::from_millis(290) && took < Duration::from_millis(800),
                "{took:?}"
            );
        }
    }

    #[tokio::test]
    async fn garbage() {
        let (addr, _) = serve(Behaviour::Body("<html><body>It works!</body></html>\n")).await;
        let e = bounded(scraper(2000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                ScrapeError::Dialect {
                    error: DialectError::Syntax { line: 1, .. },
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "scrape {addr}: not Prometheus text: line 1: not a sample: \
                 \"<html><body>It works!</body></html>\""
            )
        );
    }

    #[tokio::test]
    async fn not_utf8() {
        let (addr, _) = serve(Behaviour::Latin1).await;
        let e = bounded(scraper(2000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("scrape {addr}: metrics body is not UTF-8 (bad byte at offset 34)")
        );
    }

    #[tokio::test]
    async fn http_500() {
        let (addr, _) = serve(Behaviour::Status(500)).await;
        let e = bounded(scraper(2000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("scrape {addr}: HTTP 500 from /metrics")
        );
    }

    #[tokio::test]
    async fn redirect_is_not_followed() {
        let (addr, _) = serve(Behaviour::Redirect).await;
        let e = bounded(scraper(2000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("scrape {addr}: HTTP 302 from /metrics")
        );
    }

    #[tokio::test]
    async fn server_closes_the_connection() {
        let (addr, _) = serve(Behaviour::Close).await;
        let e = bounded(scraper(2000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert!(matches!(e, ScrapeError::Http { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("scrape {addr}: ")), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
        eprintln!("{msg}");
    }

    #[tokio::test]
    async fn nobody_listening() {
        // Bind, learn the port, close: nothing listens there now.
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let e = bounded(scraper(2000).scrape(addr, None, None))
            .await
            .unwrap_err();
        assert!(matches!(e, ScrapeError::Connect { .. }), "{e}");
        assert_eq!(e.addr(), addr);
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("scrape {addr}: cannot connect: ")),
            "{msg}"
        );
        assert!(msg.contains("refused"), "{msg}");
        eprintln!("{msg}");
    }

    #[test]
    fn bad_settings() {
        assert!(Scraper::new(Duration::ZERO, 1, None).is_err());
        assert!(Scraper::new(Duration::from_secs(1), 0, None).is_err());
        let s = Scraper::new(Duration::from_millis(250), 1000, None).unwrap();
        assert_eq!(
            (s.timeout(), s.max_bytes()),
            (Duration::from_millis(250), 1000)
        );
    }
}
