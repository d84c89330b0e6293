//! The balancer's agent: configuration, the data path's maps, and the control loop.
pub mod affinity;
pub mod config;
pub mod control;
pub mod controller;
pub mod dataplane;
pub mod dialect;
pub mod exporter;
pub mod health;
pub mod hint;
pub mod homes;
pub mod maglev;
pub mod objects;
pub mod pins;
pub mod plan;
pub mod policy;
pub mod run;
pub mod scrape;
