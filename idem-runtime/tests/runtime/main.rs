//! The integration tests of `idem-runtime`, one module per former test file, in one test
//! binary: the dependency world is linked once instead of once per file. None changes
//! state of the whole process.

mod deadline;
/// The metrics endpoint is behind the `metrics` feature.
#[cfg(feature = "metrics")]
mod metrics;
mod relay;
mod supervise;
