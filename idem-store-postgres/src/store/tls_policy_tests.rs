use super::connect_options;
use sqlx::postgres::PgSslMode;

/// libpq's reading: `require` with a root certificate verifies the chain.
#[test]
fn require_with_a_root_certificate_verifies_the_ca() {
    let o = connect_options("postgres://app@db.internal/x?sslmode=require&sslrootcert=/ca.pem")
        .expect("options");
    assert!(matches!(o.get_ssl_mode(), PgSslMode::VerifyCa));
    let o = connect_options("postgres://app@db.internal/x?sslmode=require").expect("options");
    assert!(matches!(o.get_ssl_mode(), PgSslMode::Require));
}

/// A password goes to a remote host only over a verified connection, unless the URL
/// says `accept_unverified=true`; to a loopback host always.
#[test]
fn a_password_is_refused_over_an_unverified_connection_to_a_remote_host() {
    for url in [
        "postgres://app:pw@db.internal/x",
        "postgres://app:pw@db.internal/x?sslmode=require",
        "postgres://app@10.1.2.3/x?sslmode=prefer&password=pw",
    ] {
        let e = connect_options(url).expect_err(url);
        assert!(e.to_string().contains("refusing to send a password"), "{e}");
    }
    for url in [
        "postgres://app:pw@db.internal/x?sslmode=verify-full&sslrootcert=/ca.pem",
        "postgres://app:pw@db.internal/x?sslmode=require&sslrootcert=/ca.pem",
        "postgres://app:pw@db.internal/x?sslmode=verify-ca",
        "postgres://app:pw@db.internal/x?accept_unverified=true",
        "postgres://app:pw@127.0.0.1/x",
        "postgres://app:pw@localhost:5433/x",
        "postgres://app:pw@[::1]/x",
        "postgres://app@db.internal/x",
    ] {
        connect_options(url).unwrap_or_else(|e| panic!("{url}: {e}"));
    }
    assert!(connect_options("postgres://a@h/x?accept_unverified=yes").is_err());
}
