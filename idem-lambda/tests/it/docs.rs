//! docs/aws.md prints the examples compiled with the workspace
//! (`idem-lambda/examples/`) as they are: the guide's programs build.

const GUIDE: &str = include_str!("../../../docs/aws.md");

fn assert_guide_prints(file: &str, program: &str) {
    assert!(
        GUIDE.contains(&format!("```rust\n{program}```")),
        "docs/aws.md does not print idem-lambda/examples/{file} as it is: copy the file into \
         its code block (or the other way round)"
    );
}

/// The guide opens with the SQS function.
#[test]
fn the_guide_opens_with_the_sqs_function_compiled_here() {
    let program = include_str!("../../examples/sqs_orders.rs");
    assert_guide_prints("sqs_orders.rs", program);
    let first = GUIDE.find("```rust\n").unwrap();
    assert!(GUIDE[first..].starts_with(&format!("```rust\n{program}")));
}

/// The HTTP function.
#[test]
fn the_guide_prints_the_http_function_compiled_here() {
    assert_guide_prints(
        "http_payments.rs",
        include_str!("../../examples/http_payments.rs"),
    );
}
