//! The consumer programs of the README and of the guides (`docs/consumers.md`,
//! `docs/kafka.md`) are complete programs: their texts are the files of
//! `tests/readme/`, compiled here (the crate depends on itself with every
//! broker feature), and the documents print exactly those.

// Compiled (type-checked), not run: each consumes until Ctrl-C.
#[path = "../readme/redis_streams_consumer.rs"]
#[allow(dead_code)]
mod redis_streams;

#[path = "../readme/nats_consumer.rs"]
#[allow(dead_code)]
mod nats;

#[path = "../readme/rabbitmq_consumer.rs"]
#[allow(dead_code)]
mod rabbitmq;

#[path = "../readme/kafka_consumer.rs"]
#[allow(dead_code)]
mod kafka;

#[path = "../readme/sqs_consumer.rs"]
#[allow(dead_code)]
mod sqs;

// The guides' opening programs (docs/steps.md, docs/postgres.md, docs/http.md).
#[path = "../readme/steps_checkout.rs"]
#[allow(dead_code)]
mod steps;

#[path = "../readme/postgres_order.rs"]
#[allow(dead_code)]
mod postgres;

#[path = "../readme/http_server.rs"]
#[allow(dead_code)]
mod http;

/// The documents that print consumer programs.
const DOCS: [(&str, &str); 7] = [
    ("README.md", include_str!("../../README.md")),
    ("docs/consumers.md", include_str!("../../docs/consumers.md")),
    ("docs/kafka.md", include_str!("../../docs/kafka.md")),
    ("docs/steps.md", include_str!("../../docs/steps.md")),
    ("docs/postgres.md", include_str!("../../docs/postgres.md")),
    ("docs/http.md", include_str!("../../docs/http.md")),
    ("docs/outbox.md", include_str!("../../docs/outbox.md")),
];

/// Fails unless a document holds `program` as a whole ```rust block.
fn assert_readme_prints(file: &str, program: &str) {
    let block = format!("```rust\n{program}```");
    assert!(
        DOCS.iter().any(|(_, text)| text.contains(&block)),
        "no document among {:?} prints tests/readme/{file} as it is: copy the file \
         into its guide's code block (or the other way round)",
        DOCS.map(|(name, _)| name)
    );
}

#[test]
fn the_readme_prints_the_redis_streams_program_compiled_here() {
    assert_readme_prints(
        "redis_streams_consumer.rs",
        include_str!("../readme/redis_streams_consumer.rs"),
    );
}

#[test]
fn the_readme_prints_the_nats_program_compiled_here() {
    assert_readme_prints(
        "nats_consumer.rs",
        include_str!("../readme/nats_consumer.rs"),
    );
}

#[test]
fn the_readme_prints_the_rabbitmq_program_compiled_here() {
    assert_readme_prints(
        "rabbitmq_consumer.rs",
        include_str!("../readme/rabbitmq_consumer.rs"),
    );
}

#[test]
fn the_readme_prints_the_kafka_program_compiled_here() {
    assert_readme_prints(
        "kafka_consumer.rs",
        include_str!("../readme/kafka_consumer.rs"),
    );
}

#[test]
fn the_consumers_guide_prints_the_sqs_program_compiled_here() {
    assert_readme_prints("sqs_consumer.rs", include_str!("../readme/sqs_consumer.rs"));
}

#[test]
fn the_steps_guide_opens_with_the_program_compiled_here() {
    assert_readme_prints(
        "steps_checkout.rs",
        include_str!("../readme/steps_checkout.rs"),
    );
}

#[test]
fn the_postgres_guide_opens_with_the_program_compiled_here() {
    assert_readme_prints(
        "postgres_order.rs",
        include_str!("../readme/postgres_order.rs"),
    );
}

#[test]
fn the_http_guide_opens_with_the_program_compiled_here() {
    assert_readme_prints("http_server.rs", include_str!("../readme/http_server.rs"));
}

#[path = "../readme/outbox_orders.rs"]
#[allow(dead_code)]
mod outbox;

#[test]
fn the_outbox_guide_prints_its_program_compiled_here() {
    assert_readme_prints(
        "outbox_orders.rs",
        include_str!("../readme/outbox_orders.rs"),
    );
}

#[path = "../readme/outbox_redis_orders.rs"]
#[allow(dead_code)]
mod outbox_redis;

#[test]
fn the_outbox_guide_prints_its_redis_program_compiled_here() {
    assert_readme_prints(
        "outbox_redis_orders.rs",
        include_str!("../readme/outbox_redis_orders.rs"),
    );
}

#[path = "../readme/outbox_custom_sink.rs"]
#[allow(dead_code)]
mod outbox_custom_sink;

#[test]
fn the_outbox_guide_prints_its_custom_sink_compiled_here() {
    assert_readme_prints(
        "outbox_custom_sink.rs",
        include_str!("../readme/outbox_custom_sink.rs"),
    );
}
