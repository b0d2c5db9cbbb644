//! The example's tests, one module per former test file, in one test binary: the
//! dependency world (both stores, the RabbitMQ adapter, the runtime) is linked once
//! instead of once per file. None changes state of the whole process.

mod crash_suite;
mod rabbitmq;
