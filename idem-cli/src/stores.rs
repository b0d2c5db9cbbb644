//! Opening stores from URLs.
