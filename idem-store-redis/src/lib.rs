//! Redis lease claim store and front filter for idem.
