//! Answers `admit` with priority 2, so a test can tell which version served a call.

const VERSION: i32 = 2;

include!("../../version-1/src/versioned.rs");
