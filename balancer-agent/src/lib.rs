//! The balancer's agent: configuration, the data path's maps, and the control loop.
pub mod config;
pub mod dataplane;
pub mod maglev;
pub mod objects;
pub mod plan;
pub mod run;
