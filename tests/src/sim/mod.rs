//! `inference-sim`: an inference server that behaves like a real one under load, without a
//! model. The engine ([`engine`]) simulates continuous batching over a paged KV cache with a
//! prefix cache ([`kv`]); the HTTP layer ([`api`]) speaks the OpenAI API and publishes the
//! metrics of a real server's dialect ([`metrics`]); [`faults`] make it misbehave on
//! purpose. [`launch`] starts the binary from tests and [`client`] talks to it.

pub mod api;
pub mod client;
pub mod engine;
pub mod faults;
pub mod kv;
pub mod launch;
pub mod metrics;
pub mod text;
pub mod tls;
