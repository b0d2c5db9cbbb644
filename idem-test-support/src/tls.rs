//! TLS servers for tests: a throwaway certificate authority made with the `openssl`
//! command, and a second instance of Redis, NATS, Postgres or RabbitMQ with a TLS
//! listener on a free loopback port, killed (and its files removed) when dropped.
//!
//! ```no_run
//! use idem_test_support::tls::{Pki, TlsServer};
//! let pki = Pki::new();
//! let redis = TlsServer::redis(&pki);
//! let url = format!("rediss://127.0.0.1:{}", redis.port);
//! // connect with `pki.ca` as the trusted root; `pki.other_ca` must be refused
//! ```
//!
//! Every step that cannot run (no `openssl`, no `redis-server`, a server that does not
//! start) panics with what failed: a test that needs a TLS server fails without one, it
//! never skips.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A directory under the system's temporary directory, removed when dropped.
#[derive(Debug)]
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idem-tls-{tag}-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        Self(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate authority, a server certificate it signed for `localhost` and
/// `127.0.0.1`, a client certificate it signed, and a second, unrelated authority (the
/// "wrong CA"). All files are PEM.
#[derive(Debug)]
pub struct Pki {
    dir: ScratchDir,
    /// The authority that signed the server and client certificates.
    pub ca: PathBuf,
    /// The server certificate (subject alternative names `localhost`, `127.0.0.1`).
    pub server_cert: PathBuf,
    /// The server certificate's private key (PKCS#8).
    pub server_key: PathBuf,
    /// A client certificate (common name `idem`) signed by [`ca`](Self::ca).
    pub client_cert: PathBuf,
    /// The client certificate's private key (PKCS#8).
    pub client_key: PathBuf,
    /// An authority that signed nothing here: trusting only it must refuse the server.
    pub other_ca: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("the openssl command is needed to make test certificates: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Pki {
    /// Makes the authorities and certificates in a fresh directory (removed on drop).
    ///
    /// # Panics
    /// If the `openssl` command is missing or fails.
    pub fn new() -> Self {
        let dir = ScratchDir::new("pki");
        let d = dir.0.clone();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (name, cn) in [("ca", "idem test CA"), ("other-ca", "idem unrelated CA")] {
            let key = format!("{name}.key");
            let pem = format!("{name}.pem");
            let subj = format!("/CN={cn}");
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend([
                "-keyout",
                &key,
                "-out",
                &pem,
                "-days",
                "2",
                "-subj",
                &subj,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
            openssl(&d, &args);
        }
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .expect("write server.ext");
        std::fs::write(
            d.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        )
        .expect("write client.ext");
        for (name, cn) in [("server", "localhost"), ("client", "idem")] {
            let key = format!("{name}.key");
            let csr = format!("{name}.csr");
            let pem = format!("{name}.pem");
            let ext = format!("{name}.ext");
            let subj = format!("/CN={cn}");
            let mut args = vec!["req"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            openssl(&d, &args);
            openssl(
                &d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-extfile",
                    &ext,
                ],
            );
        }
        Self {
            ca: d.join("ca.pem"),
            server_cert: d.join("server.pem"),
            server_key: d.join("server.key"),
            client_cert: d.join("client.pem"),
            client_key: d.join("client.key"),
            other_ca: d.join("other-ca.pem"),
            dir,
        }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

/// A free TCP port on 127.0.0.1 (the OS picks it; another process may take it before the
/// server binds, which fails that server's start loudly).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a free loopback port")
}

/// A server process listening on `127.0.0.1:port` (with TLS, unless its constructor says
/// otherwise), killed when dropped.
#[derive(Debug)]
pub struct TlsServer {
    /// The TLS port on 127.0.0.1.
    pub port: u16,
    child: Option<Child>,
    /// A command that stops the server, where killing the child is not enough (Postgres).
    stop: Option<Command>,
    /// The Erlang node name, for a RabbitMQ node.
    node: Option<String>,
    _dir: Option<ScratchDir>,
}

impl TlsServer {
    /// `redis-server` with only a TLS port (`--port 0`), server certificate from `pki`,
    /// client certificates not required, nothing persisted.
    ///
    /// # Panics
    /// If `redis-server` is missing, lacks TLS, or does not listen within 60 s.
    pub fn redis(pki: &Pki) -> Self {
        Self::redis_server(pki, false)
    }

    /// `redis-server` as [`redis`](Self::redis), requiring a client certificate signed
    /// by `pki`'s CA (`--tls-auth-clients yes`).
    ///
    /// # Panics
    /// As [`redis`](Self::redis).
    pub fn redis_requiring_client_certificates(pki: &Pki) -> Self {
        Self::redis_server(pki, true)
    }

    fn redis_server(pki: &Pki, client_auth: bool) -> Self {
        let port = free_port();
        let dir = ScratchDir::new("redis");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--bind", "127.0.0.1", "--tls-port"])
            .arg(port.to_string())
            .arg("--tls-cert-file")
            .arg(&pki.server_cert)
            .arg("--tls-key-file")
            .arg(&pki.server_key)
            .arg("--tls-ca-cert-file")
            .arg(&pki.ca)
            .arg("--tls-auth-clients")
            .arg(if client_auth { "yes" } else { "no" })
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir.0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("redis-server is needed for the TLS tests: {e}"));
        Self::started("redis-server", port, child, None, Some(dir))
    }

    /// `nats-server` with JetStream and TLS required on its client port, server
    /// certificate from `pki`.
    ///
    /// # Panics
    /// If `nats-server` is missing or does not listen within 60 s.
    pub fn nats(pki: &Pki) -> Self {
        let port = free_port();
        let dir = ScratchDir::new("nats");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .args(["--jetstream", "--store_dir"])
            .arg(&dir.0)
            .args(["--tls", "--tlscert"])
            .arg(&pki.server_cert)
            .arg("--tlskey")
            .arg(&pki.server_key)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("nats-server is needed for the TLS tests: {e}"));
        Self::started("nats-server", port, child, None, Some(dir))
    }

    /// `nats-server` with JetStream on a free loopback port, configured by `body` (a
    /// block of its configuration file: `authorization { … }`, `tls { … }`), in plain
    /// TCP unless `body` says otherwise: for the tests of tokens, nkeys and credentials.
    ///
    /// # Panics
    /// If `nats-server` is missing or does not listen within 60 s.
    pub fn nats_with_config(body: &str) -> Self {
        let port = free_port();
        let dir = ScratchDir::new("nats-conf");
        let conf = dir.0.join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\n{body}\n",
                dir.0.join("js").display()
            ),
        )
        .expect("write nats.conf");
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("nats-server is needed for the NATS auth tests: {e}"));
        Self::started("nats-server", port, child, None, Some(dir))
    }

    /// A throwaway Postgres cluster (`initdb`, trust authentication for user `postgres`,
    /// database `postgres`) with `ssl = on`, server certificate from `pki`, listening on
    /// 127.0.0.1 only. Run as the `postgres` system user when this process is root
    /// (Postgres refuses to run as root). The binaries are found with `pg_config
    /// --bindir`, else under `/usr/lib/postgresql/*/bin`.
    ///
    /// # Panics
    /// If Postgres is missing, `initdb` fails, or the server does not listen within 60 s.
    pub fn postgres(pki: &Pki) -> Self {
        Self::postgres_cluster(Some(pki))
    }

    /// A throwaway Postgres cluster as [`postgres`](Self::postgres), with `ssl = off`
    /// (plaintext only): a client that requires TLS must be refused by it.
    ///
    /// # Panics
    /// As [`postgres`](Self::postgres).
    pub fn postgres_without_tls() -> Self {
        Self::postgres_cluster(None)
    }

    fn postgres_cluster(pki: Option<&Pki>) -> Self {
        let bin = postgres_bindir();
        let port = free_port();
        let dir = ScratchDir::new("pg");
        let data = dir.0.join("data");
        // The server's key must belong to the server's user and be private.
        let key = dir.0.join("server.key");
        let cert = dir.0.join("server.pem");
        if let Some(pki) = pki {
            std::fs::copy(&pki.server_key, &key).expect("copy the server key");
            std::fs::copy(&pki.server_cert, &cert).expect("copy the server certificate");
            set_mode(&key, 0o600);
        }
        let as_root = running_as_root();
        if as_root {
            chown(&dir.0, "postgres:");
        }
        let run = |program: &Path| {
            if as_root {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(program);
                c
            } else {
                Command::new(program)
            }
        };
        let out = run(&bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap_or_else(|e| panic!("initdb: {e}"));
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ssl = if pki.is_some() {
            format!(
                "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                cert.display(),
                key.display()
            )
        } else {
            "ssl = off\n".to_owned()
        };
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {port}\n{ssl}\
             unix_socket_directories = '{}'\nfsync = off\n",
            dir.0.display()
        );
        let mut pg_conf =
            std::fs::read_to_string(data.join("postgresql.conf")).expect("read postgresql.conf");
        pg_conf.push_str(&conf);
        std::fs::write(data.join("postgresql.conf"), pg_conf).expect("write postgresql.conf");
        // With TLS, only TLS connections over TCP: a plaintext one is refused.
        let hba = if pki.is_some() { "hostssl" } else { "host" };
        std::fs::write(
            data.join("pg_hba.conf"),
            format!("local all all trust\n{hba} all all 127.0.0.1/32 trust\n"),
        )
        .expect("write pg_hba.conf");
        let child = run(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("postgres: {e}"));
        let mut stop = run(&bin.join("pg_ctl"));
        stop.args(["stop", "-m", "immediate", "-D"]).arg(&data);
        stop.stdout(Stdio::null()).stderr(Stdio::null());
        let server = Self::started("postgres", port, child, Some(stop), Some(dir));
        // Listening is not ready: a server still starting up answers a connection with
        // SQLSTATE 57P03. Ready is what `pg_isready` says (within the same minute).
        let deadline = Instant::now() + Duration::from_secs(60);
        while !Command::new(bin.join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string(), "-t", "2"])
            .status()
            .is_ok_and(|s| s.success())
        {
            assert!(
                Instant::now() < deadline,
                "postgres on port {port} was not ready within 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// A second RabbitMQ node (`rabbitmq-server`, its own node name, data directory and
    /// distribution port, no plugins) whose only listener is AMQP over TLS
    /// (`listeners.tcp = none`), server certificate from `pki`, client certificates not
    /// required; user `guest`/`guest` from loopback. Run through the packaged
    /// `rabbitmq-server` script, which switches to the `rabbitmq` user when this process
    /// is root: its files are then given to that user.
    ///
    /// # Panics
    /// If `rabbitmq-server` is missing or the node does not listen within 60 s.
    pub fn rabbitmq(pki: &Pki) -> Self {
        Self::rabbitmq_node(Some(pki))
    }

    /// A private RabbitMQ node as [`rabbitmq`](Self::rabbitmq), with a plaintext AMQP
    /// listener only: for a test that changes the node itself (a memory alarm raised with
    /// `rabbitmqctl -n` [`node`](Self::node)), which would block every other test's
    /// publishers on the shared node.
    ///
    /// # Panics
    /// As [`rabbitmq`](Self::rabbitmq).
    pub fn rabbitmq_without_tls() -> Self {
        Self::rabbitmq_node(None)
    }

    /// The Erlang node name of a RabbitMQ node started here (for `rabbitmqctl -n`); `None`
    /// for the other servers.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    fn rabbitmq_node(pki: Option<&Pki>) -> Self {
        let port = free_port();
        let dist = free_port();
        let dir = ScratchDir::new("rabbitmq");
        let file = |name: &str| dir.0.join(name);
        let conf = match pki {
            Some(pki) => {
                for (from, to) in [
                    (&pki.ca, "ca.pem"),
                    (&pki.server_cert, "server.pem"),
                    (&pki.server_key, "server.key"),
                ] {
                    std::fs::copy(from, file(to)).unwrap_or_else(|e| panic!("copy {to}: {e}"));
                }
                format!(
                    "listeners.tcp = none\nlisteners.ssl.default = {port}\n\
                     ssl_options.cacertfile = {}\nssl_options.certfile = {}\n\
                     ssl_options.keyfile = {}\nssl_options.verify = verify_none\n\
                     ssl_options.fail_if_no_peer_cert = false\n",
                    file("ca.pem").display(),
                    file("server.pem").display(),
                    file("server.key").display()
                )
            }
            None => format!("listeners.tcp.default = 127.0.0.1:{port}\n"),
        };
        std::fs::write(file("rabbitmq.conf"), conf).expect("write rabbitmq.conf");
        std::fs::write(file("plugins"), "[].\n").expect("write the plugins file");
        if running_as_root() {
            chown(&dir.0, "rabbitmq:");
        }
        let pid = file("node.pid");
        let node = format!("idem-test-{port}@localhost");
        let child = Command::new("rabbitmq-server")
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_CONFIG_FILE", file("rabbitmq"))
            .env("RABBITMQ_MNESIA_BASE", file("mnesia"))
            .env("RABBITMQ_LOG_BASE", file("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", file("plugins"))
            .env("RABBITMQ_PID_FILE", &pid)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("rabbitmq-server is needed for this test: {e}"));
        // The node runs under the script (and `su` when root): stop it by its pid file.
        let mut stop = Command::new("sh");
        stop.arg("-c")
            .arg(format!("kill -9 $(cat '{}') 2>/dev/null", pid.display()));
        stop.stdout(Stdio::null()).stderr(Stdio::null());
        let mut server = Self::started("rabbitmq-server", port, child, Some(stop), Some(dir));
        server.node = Some(node);
        server
    }

    fn started(
        what: &str,
        port: u16,
        mut child: Child,
        stop: Option<Command>,
        dir: Option<ScratchDir>,
    ) -> Self {
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("{what} exited before listening on port {port}: {status}");
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{what} did not listen on port {port} within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            port,
            child: Some(child),
            stop,
            node: None,
            _dir: dir,
        }
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        if let Some(mut stop) = self.stop.take() {
            let _ = stop.status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn postgres_bindir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() && dir.join("postgres").exists() {
            return dir;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .filter(|b| b.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .expect("Postgres server binaries (initdb, postgres) are needed for the TLS tests")
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn chown(dir: &Path, owner: &str) {
    let status = Command::new("chown")
        .arg("-R")
        .arg(owner)
        .arg(dir)
        .status()
        .expect("chown");
    assert!(status.success(), "chown {owner} {}", dir.display());
}
