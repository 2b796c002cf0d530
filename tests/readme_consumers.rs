//! The README's broker consumers are complete programs: their texts are the
//! files of `tests/readme/`, compiled here (the crate depends on itself with
//! every broker feature), and the README prints exactly those.

// Compiled (type-checked), not run: each consumes until Ctrl-C.
#[path = "readme/redis_streams_consumer.rs"]
#[allow(dead_code)]
mod redis_streams;

#[path = "readme/nats_consumer.rs"]
#[allow(dead_code)]
mod nats;

#[path = "readme/rabbitmq_consumer.rs"]
#[allow(dead_code)]
mod rabbitmq;

#[path = "readme/kafka_consumer.rs"]
#[allow(dead_code)]
mod kafka;

const README: &str = include_str!("../README.md");

/// Fails unless the README holds `program` as a whole ```rust block.
fn assert_readme_prints(file: &str, program: &str) {
    assert!(
        README.contains(&format!("```rust\n{program}```")),
        "a README consumer snippet differs from tests/readme/{file}: \
         copy the file into the README's code block (or the other way round)"
    );
}

#[test]
fn the_readme_prints_the_redis_streams_program_compiled_here() {
    assert_readme_prints(
        "redis_streams_consumer.rs",
        include_str!("readme/redis_streams_consumer.rs"),
    );
}

#[test]
fn the_readme_prints_the_nats_program_compiled_here() {
    assert_readme_prints("nats_consumer.rs", include_str!("readme/nats_consumer.rs"));
}

#[test]
fn the_readme_prints_the_rabbitmq_program_compiled_here() {
    assert_readme_prints(
        "rabbitmq_consumer.rs",
        include_str!("readme/rabbitmq_consumer.rs"),
    );
}

#[test]
fn the_readme_prints_the_kafka_program_compiled_here() {
    assert_readme_prints(
        "kafka_consumer.rs",
        include_str!("readme/kafka_consumer.rs"),
    );
}
