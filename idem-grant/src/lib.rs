//! Grants.
