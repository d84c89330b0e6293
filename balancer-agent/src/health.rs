//! Health checks that test the model: a one-token completion with a short timeout. A server
//! that answers `/health` but cannot generate is not healthy; a server that is merely busy
//! is not dead, which is why a failed check on a server with a queue counts as busy.

use std::{net::SocketAddr, time::Duration};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::{
    access::{self, authorized, ApiKey, Tls},
    scrape::body_at_most,
};

/// The result of one check, as the state machine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Failed,
    /// Failed while the server reported a queue: alive, but no evidence that the model
    /// answers.
    Busy,
}

/// A transition worth logging and acting on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    WentDown,
    CameUp,
}

/// Consecutive results: `fall` failures in a row take a server down, `rise` successes in a
/// row bring it back. A server starts up, so that a fresh agent routes at once; one added
/// to a pool that runs starts [`Track::unproven`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Track {
    pub down: bool,
    fails: u32,
    oks: u32,
    /// DOWN until its first good check, which is enough.
    unproven: bool,
}

impl Track {
    /// A server added to a running pool: DOWN until a check passes, since it may still be
    /// loading its model (an inference server can take minutes to), and the pool has others
    /// to serve meanwhile; one good check is enough, as nothing says it failed before.
    pub fn unproven() -> Track {
        Track {
            down: true,
            unproven: true,
            ..Track::default()
        }
    }

    /// Whether it has not passed a check since it was added.
    pub fn is_unproven(&self) -> bool {
        self.unproven
    }

    /// Good checks in a row.
    pub fn oks(&self) -> u32 {
        self.oks
    }

    pub fn record(&mut self, outcome: Outcome, fall: u32, rise: u32) -> Option<Transition> {
        match outcome {
            Outcome::Ok => {
                self.fails = 0;
                self.oks = self.oks.saturating_add(1);
                if self.down && (self.unproven || self.oks >= rise) {
                    (self.down, self.unproven) = (false, false);
                    return Some(Transition::CameUp);
                }
            }
            Outcome::Failed => {
                self.oks = 0;
                self.fails = self.fails.saturating_add(1);
                if !self.down && self.fails >= fall {
                    self.down = true;
                    return Some(Transition::WentDown);
                }
            }
            // A busy server is alive (its fresh metrics show work), so failures on either
            // side of it are not consecutive: an overloaded one whose `/metrics` times out
            // now and then would otherwise go DOWN on failures an hour apart. It proves
            // nothing about the model answering, so no good streak grows.
            Outcome::Busy => self.fails = 0,
        }
        None
    }
}

/// A failed check that a queue explains: no answer in time, or an answer that says the
/// server is too busy now (HTTP 429 or 503). Only these may count as busy.
#[derive(Debug, thiserror::Error)]
pub enum Waited {
    #[error("no answer in {0} ms")]
    Timeout(u64),
    #[error("HTTP {0}")]
    Overloaded(reqwest::StatusCode),
}

impl Waited {
    /// Whether `e` is such a failure, ours or reqwest's.
    pub fn explains(e: &anyhow::Error) -> bool {
        e.chain().any(|c| {
            c.is::<Waited>()
                || c.downcast_ref::<reqwest::Error>()
                    .is_some_and(|r| r.is_timeout() || r.status().is_some_and(overloaded))
        })
    }
}

fn overloaded(status: reqwest::StatusCode) -> bool {
    status == reqwest::StatusCode::TOO_MANY_REQUESTS
        || status == reqwest::StatusCode::SERVICE_UNAVAILABLE
}

/// Sends the checks, over HTTP or with one pool's TLS settings. Cheap to clone; connections
/// are not kept, so each check also proves the server still accepts new connections (and,
/// over HTTPS, completes a handshake with a certificate the pool's CA signed).
#[derive(Clone)]
pub struct Checker {
    client: reqwest::Client,
    scheme: &'static str,
}

impl Checker {
    pub fn new(timeout: Duration, tls: Option<&Tls>) -> Result<Self> {
        let client = access::client_builder(tls)
            .timeout(timeout)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(0)
            .build()
            .context("building the health-check HTTP client")?;
        Ok(Checker {
            client,
            scheme: access::scheme(tls),
        })
    }

    /// The first model the server lists, for pools that do not name one.
    pub async fn discover_model(&self, api: SocketAddr, key: Option<&ApiKey>) -> Result<String> {
        let url = format!("{}://{api}/v1/models", self.scheme);
        let response = authorized(self.client.get(&url), key)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("GET {url}"))?;
        let body = json_body(response)
            .await
            .with_context(|| format!("GET {url}"))?;
        match body["data"][0]["id"].as_str() {
            Some(id) if !id.is_empty() => Ok(id.to_owned()),
            _ => bail!("GET {url}: no model listed"),
        }
    }

    /// One completion of one token. Ok when the server generated it.
    pub async fn check(&self, api: SocketAddr, model: &str, key: Option<&ApiKey>) -> Result<()> {
        let url = format!("{}://{api}/v1/completions", self.scheme);
        let request = json!({
            "model": model,
            "prompt": "Hello",
            "max_tokens": 1,
            "temperature": 0,
            "stream": false,
        });
        let response = authorized(self.client.post(&url), key)
            .json(&request)
            .send()
            .await
            .with_context(|| format!("POST {url}"))?;
        let status = response.status();
        if overloaded(status) {
            return Err(
                anyhow::Error::new(Waited::Overloaded(status)).context(format!("POST {url}"))
            );
        }
        if !status.is_success() {
            bail!("POST {url}: HTTP {status}");
        }
        let body = json_body(response)
            .await
            .with_context(|| format!("POST {url}"))?;
        if body["choices"].as_array().is_none_or(|c| c.is_empty()) {
            bail!("POST {url}: no choices in the answer");
        }
        Ok(())
    }
}

/// The most of an answer a check reads: a one-token completion or a list of models is a
/// few KB, and a server (or a proxy in front of it) that streams on regardless must not cost
/// the agent memory for the whole timeout, for every server at once.
const MAX_ANSWER_BYTES: usize = 256 << 10;

/// `response`'s body as JSON, read up to [`MAX_ANSWER_BYTES`].
async fn json_body(mut response: reqwest::Response) -> Result<Value> {
    let body = body_at_most(&mut response, MAX_ANSWER_BYTES)
        .await
        .context("reading the answer")?
        .with_context(|| format!("an answer longer than {MAX_ANSWER_BYTES} bytes"))?;
    serde_json::from_slice(&body).context("not JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server on loopback that answers `/v1/completions` with `answer`.
    async fn serve(answer: axum::routing::MethodRouter) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new().route("/v1/completions", answer);
        tokio::spawn(async move { axum::serve(listener, router).await });
        addr
    }

    #[tokio::test]
    async fn checks_send_the_key_and_read_a_bounded_answer() {
        use axum::{http::HeaderMap, http::StatusCode, routing::post};
        const ONE_TOKEN: &str = r#"{"choices":[{"text":"Hi"}]}"#;
        let keyed = serve(post(|headers: HeaderMap| async move {
            match headers.get("authorization") {
                Some(v) if v == "Bearer sk-1" => (StatusCode::OK, ONE_TOKEN),
                _ => (StatusCode::UNAUTHORIZED, "{}"),
            }
        }))
        .await;
        let endless = serve(post(|| async {
            format!(r#"{{"choices":[{{"text":"{}"}}]}}"#, "x".repeat(1 << 20))
        }))
        .await;
        let checker = Checker::new(Duration::from_secs(5), None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key"), "sk-1\n").unwrap();
        let key = ApiKey::load(&dir.path().join("key")).unwrap();
        checker.check(keyed, "m", Some(&key)).await.unwrap();
        let refused = checker.check(keyed, "m", None).await.unwrap_err();
        assert!(format!("{refused:#}").contains("401"), "{refused:#}");
        let long = checker.check(endless, "m", None).await.unwrap_err();
        assert!(format!("{long:#}").contains("longer than"), "{long:#}");
    }

    #[test]
    fn fall_and_rise_need_consecutive_results() {
        let mut t = Track::default();
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(
            t.record(Outcome::Ok, 3, 2),
            None,
            "a success breaks the streak"
        );
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Failed, 3, 2), Some(Transition::WentDown));
        assert!(t.down);
        assert_eq!(t.record(Outcome::Failed, 3, 2), None, "already down");
        assert_eq!(t.record(Outcome::Ok, 3, 2), None);
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Ok, 3, 2), None);
        assert_eq!(t.record(Outcome::Ok, 3, 2), Some(Transition::CameUp));
        assert!(!t.down);
    }

    /// A server added to a running pool comes UP at its first good check, not before, and
    /// then falls and rises as any other.
    #[test]
    fn an_added_server_waits_for_one_good_check() {
        let mut t = Track::unproven();
        assert!(t.down && t.is_unproven());
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Busy, 3, 2), None);
        assert!(t.down, "a busy check proves no model answers");
        assert_eq!(t.record(Outcome::Ok, 3, 2), Some(Transition::CameUp));
        assert!(!t.down && !t.is_unproven());
        for _ in 0..2 {
            assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        }
        assert_eq!(t.record(Outcome::Failed, 3, 2), Some(Transition::WentDown));
        assert_eq!(
            t.record(Outcome::Ok, 3, 2),
            None,
            "back after rise, as any other"
        );
        assert_eq!(t.record(Outcome::Ok, 3, 2), Some(Transition::CameUp));
    }

    #[test]
    fn busy_never_takes_a_server_down() {
        let mut t = Track::default();
        for _ in 0..100 {
            assert_eq!(t.record(Outcome::Busy, 3, 2), None);
        }
        assert!(!t.down);
        // It breaks a streak of failures: they are not consecutive.
        t.record(Outcome::Failed, 3, 2);
        t.record(Outcome::Failed, 3, 2);
        t.record(Outcome::Busy, 3, 2);
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Failed, 3, 2), None);
        assert_eq!(t.record(Outcome::Failed, 3, 2), Some(Transition::WentDown));
        // Down, a busy check is no good one, and no failed one either.
        t.record(Outcome::Ok, 3, 2);
        t.record(Outcome::Busy, 3, 2);
        assert_eq!(t.record(Outcome::Ok, 3, 2), Some(Transition::CameUp));
    }
}
