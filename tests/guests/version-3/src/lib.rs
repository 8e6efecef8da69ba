//! Answers `admit` with priority 3, so a test can tell which version served a call.

const VERSION: i32 = 3;

include!("../../version-1/src/versioned.rs");
