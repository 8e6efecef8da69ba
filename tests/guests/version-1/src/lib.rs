//! Answers `admit` with priority 1, so a test can tell which version served a call.

const VERSION: i32 = 1;

include!("../../version-1/src/versioned.rs");
