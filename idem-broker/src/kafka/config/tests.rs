use super::*;

fn read(query: &str) -> Result<KafkaConfig, BrokerError> {
    KafkaConfig::from_url(&BrokerUrl::parse(&format!("kafka://h:9092{query}"))?, "t")
}

#[test]
fn defaults_and_every_setting() {
    let d = read("").unwrap();
    assert_eq!((d.brokers.as_str(), d.name.as_str()), ("h:9092", "t"));
    assert_eq!(d.group, "idem");
    assert_eq!(d.partitions, 4);
    assert_eq!(d.replication, None);
    assert_eq!(d.session_timeout, Duration::from_secs(10));
    assert_eq!(d.max_poll_interval, Duration::from_secs(300));
    assert_eq!(d.assignment, Assignment::CooperativeSticky);
    assert_eq!(d.batch_messages, None);
    assert_eq!(d.queued_kbytes, 4096);
    let c = read(
        "?group=g&partitions=2&replication=3&session_timeout=6s&max_poll_interval=1m\
         &assignment=range&batch_messages=1&queued_kbytes=512",
    )
    .unwrap();
    assert_eq!(c.group, "g");
    assert_eq!(c.partitions, 2);
    assert_eq!(c.replication, Some(3));
    assert_eq!(c.session_timeout, Duration::from_secs(6));
    assert_eq!(c.max_poll_interval, Duration::from_secs(60));
    assert_eq!(c.assignment, Assignment::Range);
    assert_eq!(c.batch_messages, Some(1));
    assert_eq!(c.queued_kbytes, 512);
    assert_eq!(
        read("?assignment=roundrobin").unwrap().assignment,
        Assignment::RoundRobin
    );
    assert_eq!(
        read("?assignment=cooperative-sticky").unwrap().assignment,
        Assignment::CooperativeSticky
    );
}

#[test]
fn bad_values_name_their_parameter() {
    for (query, param, reason) in [
        ("?group=", "group", "not be empty"),
        ("?partitions=many", "partitions", "whole number from 1"),
        ("?partitions=0", "partitions", "whole number from 1"),
        ("?replication=0", "replication", "from 1 to 32767"),
        ("?session_timeout=500ms", "session_timeout", "from 1s to 1h"),
        (
            "?session_timeout=soon",
            "session_timeout",
            "invalid duration",
        ),
        ("?max_poll_interval=2d", "max_poll_interval", "to 1d"),
        (
            "?max_poll_interval=5s",
            "max_poll_interval",
            "at least session_timeout (10s)",
        ),
        (
            "?session_timeout=30m",
            "max_poll_interval",
            "at least session_timeout (30m)",
        ),
        (
            "?assignment=sticky",
            "assignment",
            "cooperative-sticky, range or roundrobin",
        ),
        ("?batch_messages=0", "batch_messages", "from 1 to 1000000"),
        ("?queued_kbytes=0", "queued_kbytes", "from 1 to 2097151"),
        ("?group=a&group=b", "group", "more than once"),
        ("?acks=all", "acks", "unknown parameter"),
    ] {
        crate::setting::assert_refused(read(query), query, param, reason);
    }
    assert!(matches!(
        BrokerUrl::parse("kafka://"),
        Err(BrokerError::InvalidUrl(_))
    ));
    assert!(matches!(
        KafkaConfig::new("h:9092", "t").with_assignment("sticky"),
        Err(BrokerError::InvalidParam { .. })
    ));
}

/// The configuration of `url` for topic `t`.
fn of(url: &str) -> Result<KafkaConfig, BrokerError> {
    KafkaConfig::from_url(&BrokerUrl::parse(url)?, "t")
}

/// Every client the adapter makes: metadata/admin, producer, consumer.
fn every_client(c: &KafkaConfig) -> [(&'static str, ClientConfig); 3] {
    [
        ("client", c.client_config()),
        ("producer", c.producer_config()),
        ("consumer", c.consumer_config()),
    ]
}

#[test]
fn every_security_setting_reaches_every_client_as_asked() {
    let c = of("kafka://b1:9093,b2:9093?security.protocol=sasl_ssl\
                &sasl.mechanism=SCRAM-SHA-256&sasl.username=idem&sasl.password=s%26cret\
                &ssl.ca.location=/etc/idem/ca.pem&ssl.certificate.location=/etc/idem/c.pem\
                &ssl.key.location=/etc/idem/c.key&ssl.key.password=k3y\
                &ssl.endpoint.identification.algorithm=none&group=g")
    .unwrap();
    assert_eq!(c.brokers, "b1:9093,b2:9093");
    for (what, cc) in every_client(&c) {
        for (key, value) in [
            ("bootstrap.servers", "b1:9093,b2:9093"),
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-256"),
            ("sasl.username", "idem"),
            ("sasl.password", "s&cret"),
            ("ssl.ca.location", "/etc/idem/ca.pem"),
            ("ssl.certificate.location", "/etc/idem/c.pem"),
            ("ssl.key.location", "/etc/idem/c.key"),
            ("ssl.key.password", "k3y"),
            ("ssl.endpoint.identification.algorithm", "none"),
        ] {
            assert_eq!(cc.get(key), Some(value), "{what}: {key}");
        }
    }
    // the consumer keeps its own settings; the producer its own
    assert_eq!(c.consumer_config().get("group.id"), Some("g"));
    assert_eq!(c.producer_config().get("acks"), Some("all"));
    assert_eq!(c.producer_config().get("compression.type"), None);
    // the librdkafka clients take every one of them (nothing connects here)
    let producer: Result<rdkafka::producer::BaseProducer, _> =
        of("kafka://127.0.0.1:1?security.protocol=sasl_plaintext\
         &sasl.mechanism=SCRAM-SHA-512&sasl.username=u&sasl.password=p")
        .unwrap()
        .producer_config()
        .create();
    assert!(producer.is_ok(), "{:?}", producer.err());
}

#[test]
fn plain_tcp_unless_asked_and_kafkas_is_tls() {
    let plain = of("kafka://h:9092").unwrap();
    assert_eq!(plain.security, KafkaSecurity::default());
    for (_, cc) in every_client(&plain) {
        assert_eq!(cc.get("security.protocol"), Some("plaintext"));
        assert_eq!(cc.get("sasl.mechanism"), None);
        assert_eq!(cc.get("ssl.ca.location"), None);
    }
    let tls = of("kafkas://h:9093,h2:9093?ssl.ca.location=/ca.pem").unwrap();
    assert_eq!(tls.brokers, "h:9093,h2:9093");
    assert_eq!(tls.security.protocol, SecurityProtocol::Ssl);
    assert_eq!(tls.client_config().get("ssl.ca.location"), Some("/ca.pem"));
    // credentials in the userinfo (percent-decoded), SASL over TLS, PLAIN by default
    let sasl = of("kafkas://alice:p%40ss%3Aw0rd@h1:9093,h2:9093?group=g").unwrap();
    assert_eq!(sasl.brokers, "h1:9093,h2:9093");
    assert_eq!(sasl.security.protocol, SecurityProtocol::SaslSsl);
    assert_eq!(sasl.security.sasl_mechanism, SaslMechanism::Plain);
    let cc = sasl.client_config();
    assert_eq!(cc.get("sasl.username"), Some("alice"));
    assert_eq!(cc.get("sasl.password"), Some("p@ss:w0rd"));
    assert_eq!(cc.get("sasl.mechanism"), Some("PLAIN"));
    // SASL over plain TCP only when said so; names in any case
    let clear = of("kafka://u:p@h:9092?security.protocol=SASL_PLAINTEXT\
                    &sasl.mechanism=scram-sha-512")
    .unwrap();
    assert_eq!(clear.security.protocol, SecurityProtocol::SaslPlaintext);
    assert_eq!(
        clear.client_config().get("sasl.mechanism"),
        Some("SCRAM-SHA-512")
    );
    // TLS on kafka:// when said so
    let ssl = of("kafka://h:9093?security.protocol=ssl").unwrap();
    assert_eq!(ssl.client_config().get("security.protocol"), Some("ssl"));
    assert_eq!(
        KafkaSecurity::sasl(true, SaslMechanism::ScramSha256, "u", "p")
            .with_ca_location("/ca.pem")
            .protocol,
        SecurityProtocol::SaslSsl
    );
}

#[test]
fn userinfo_escapes_are_decoded_and_malformed_ones_kept() {
    // `%XX` decoded; a `%` without two hex digits kept as written; bytes that are not
    // UTF-8 each become U+FFFD.
    let c = of("kafkas://a%zz%4:%FF%41%e2%82%ac%@h:9093").unwrap();
    let cc = c.client_config();
    assert_eq!(cc.get("sasl.username"), Some("a%zz%4"));
    assert_eq!(cc.get("sasl.password"), Some("\u{fffd}A\u{20ac}%"));
    // A user that decodes to nothing is none.
    let none = of("kafka://:p@h:9092?security.protocol=sasl_plaintext&sasl.username=u").unwrap();
    assert_eq!(none.client_config().get("sasl.username"), Some("u"));
}

#[test]
fn compression_reaches_the_producers_only() {
    for z in ["none", "gzip", "lz4", "snappy", "zstd", "ZSTD"] {
        let c = of(&format!("kafka://h:9092?compression.type={z}")).unwrap();
        let want = z.to_ascii_lowercase();
        assert_eq!(c.producer_config().get("compression.type"), Some(&*want));
        assert_eq!(c.consumer_config().get("compression.type"), None);
        let made: Result<rdkafka::producer::BaseProducer, _> = c.producer_config().create();
        assert!(made.is_ok(), "{z}: {:?}", made.err());
    }
    let c = KafkaConfig::new("h:9092", "t").with_compression(Compression::Zstd);
    assert_eq!(c.producer_config().get("compression.type"), Some("zstd"));
}

#[test]
fn bad_or_contradictory_security_is_refused_by_name() {
    for (query, param, reason) in [
        (
            "kafka://h?security.protocol=tls",
            "security.protocol",
            "plaintext, ssl, sasl_plaintext, sasl_ssl",
        ),
        (
            "kafka://h?security.protocol=sasl_ssl&sasl.mechanism=GSSAPI&sasl.username=u&sasl.password=p",
            "sasl.mechanism",
            "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512",
        ),
        (
            "kafkas://h?ssl.endpoint.identification.algorithm=strict",
            "ssl.endpoint.identification.algorithm",
            "https, none",
        ),
        (
            "kafka://h?compression.type=brotli",
            "compression.type",
            "none, gzip, lz4, snappy, zstd",
        ),
        (
            "kafkas://h?security.protocol=plaintext",
            "security.protocol",
            "kafkas:// is TLS",
        ),
        (
            "kafkas://h?security.protocol=sasl_plaintext",
            "security.protocol",
            "kafkas:// is TLS",
        ),
        // credentials never go over plain TCP unless said so
        ("kafka://u:p@h", "security.protocol", "sasl_plaintext to send them"),
        ("kafka://h?sasl.username=u&sasl.password=p", "security.protocol", "kafkas://"),
        (
            "kafka://h?security.protocol=ssl&sasl.mechanism=PLAIN",
            "sasl.mechanism",
            "needs security.protocol sasl_plaintext or sasl_ssl, not ssl",
        ),
        (
            "kafkas://h?security.protocol=ssl&sasl.password=p",
            "sasl.password",
            "not ssl",
        ),
        (
            "kafka://h?ssl.ca.location=/ca.pem",
            "ssl.ca.location",
            "needs security.protocol ssl or sasl_ssl (or kafkas://), not plaintext",
        ),
        (
            "kafka://u:p@h?security.protocol=sasl_plaintext&ssl.key.password=k",
            "ssl.key.password",
            "not sasl_plaintext",
        ),
        ("kafka://h?security.protocol=sasl_ssl", "sasl.username", "needs a user"),
        (
            "kafkas://u@h?sasl.mechanism=SCRAM-SHA-256",
            "sasl.password",
            "sasl_ssl with SCRAM-SHA-256 needs a password",
        ),
        (
            "kafkas://u:p@h?sasl.username=v",
            "sasl.username",
            "given twice",
        ),
        (
            "kafkas://u:p@h?sasl.password=q",
            "sasl.password",
            "given twice",
        ),
        ("kafkas://h?sasl.username=&sasl.password=p", "sasl.username", "not be empty"),
        (
            "kafkas://h?ssl.certificate.location=/c.pem",
            "ssl.certificate.location",
            "needs its key",
        ),
        (
            "kafkas://h?ssl.key.location=/c.key",
            "ssl.key.location",
            "needs its certificate",
        ),
        (
            "kafkas://h?ssl.key.password=k",
            "ssl.key.password",
            "needs the key",
        ),
        ("kafka://h?ssl.cipher.suites=x", "ssl.cipher.suites", "unknown parameter"),
        ("kafka://h?sasl.jaas.config=x", "sasl.jaas.config", "unknown parameter"),
    ] {
        crate::setting::assert_refused(of(query), query, param, reason);
    }
}

#[test]
fn secrets_never_show() {
    let secrets = ["hunter2", "k3ypass", "s3cret"];
    let hidden = |what: &str, text: &str| {
        for s in secrets {
            assert!(!text.contains(s), "{what} shows {s}: {text}");
        }
    };
    let url = "kafkas://alice:s3cret@h1:9093,h2:9093?sasl.mechanism=SCRAM-SHA-512\
               &ssl.certificate.location=/c.pem&ssl.key.location=/c.key\
               &ssl.key.password=k3ypass&group=g";
    let parsed = BrokerUrl::parse(url).unwrap();
    hidden("BrokerUrl Display", &parsed.to_string());
    hidden("BrokerUrl Debug", &format!("{parsed:?}"));
    let c = KafkaConfig::from_url(&parsed, "t").unwrap();
    let debug = format!("{c:?}");
    hidden("KafkaConfig Debug", &debug);
    assert!(debug.contains("sasl_password: Some(\"***\")"), "{debug}");
    assert!(debug.contains("ssl_key_password: Some(\"***\")"), "{debug}");
    assert!(debug.contains("alice"), "{debug}");
    let query = BrokerUrl::parse(
        "kafka://h:9092?security.protocol=sasl_plaintext&sasl.username=u\
         &sasl.password=hunter2",
    )
    .unwrap();
    hidden("BrokerUrl Debug", &format!("{query:?}"));
    hidden(
        "KafkaConfig Debug",
        &format!("{:?}", KafkaConfig::from_url(&query, "t").unwrap()),
    );
    // refusals: Display and Debug of the error, whichever rule refused it
    for bad in [
        "kafka://h?sasl.password=hunter2",
        "kafka://h?security.protocol=ssl&sasl.password=hunter2",
        "kafkas://u:s3cret@h?sasl.password=hunter2",
        "kafka://h?sasl.password=hunter2&sasl.password=hunter2",
        "kafka://h?ssl.key.password=k3ypass",
        "kafkas://h?ssl.key.password=k3ypass",
        "kafka://u:s3cret@h?acks=all",
        "kafka://u:s3cret@h?security.protocol=bogus",
        "kafka://u:s3cret@h1:9092,h2:bad",
    ] {
        let e = BrokerUrl::parse(bad)
            .and_then(|u| KafkaConfig::from_url(&u, "t"))
            .unwrap_err();
        hidden(bad, &e.to_string());
        hidden(bad, &format!("{e:?}"));
    }
    // librdkafka's own refusal (an unreadable key) names no passphrase
    let c = KafkaConfig::new("127.0.0.1:1", "t").with_security(
        KafkaSecurity::ssl().with_client_certificate(
            "/nonexistent/c.pem",
            "/nonexistent/c.key",
            Some("k3ypass".to_owned()),
        ),
    );
    hidden("KafkaSecurity Debug", &format!("{:?}", c.security));
    let made: Result<rdkafka::producer::BaseProducer, _> = c.producer_config().create();
    let Err(made) = made else {
        panic!("a client with an unreadable key")
    };
    let e = BrokerError::connect(super::super::BROKER, made);
    let mut chain = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        chain += &format!(": {s}");
        source = s.source();
    }
    assert!(chain.contains("ssl."), "{chain}");
    hidden("librdkafka's error", &chain);
    hidden("librdkafka's error", &format!("{e:?}"));
}
