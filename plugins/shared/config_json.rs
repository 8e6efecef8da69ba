//! Configuration parsing shared by the reference plugins (each includes this
//! file with `#[path]`): the JSON of a plugin's `[plugins.config]` table into
//! its typed `Config`, with errors that name the offending field.

use serde::de::DeserializeOwned;

/// Parses `text` (the host's JSON; empty or `null` means no settings) into
/// `T`. Errors start with `plugin` and name the field whose value was
/// refused, which serde_json alone does not say for a mistyped value.
pub fn parse<T: DeserializeOwned>(plugin: &str, text: &str) -> Result<T, String> {
    let trimmed = text.trim();
    let text = if trimmed.is_empty() || trimmed == "null" { "{}" } else { text };
    serde_json::from_str(text).map_err(|error| {
        let message = error.to_string();
        // Unknown and missing fields are already named; a mistyped value is not.
        let field = message.starts_with("invalid").then(|| field_before(text, error.line(), error.column())).flatten();
        match field {
            Some(field) => format!("{plugin} configuration: field `{field}`: {message}"),
            None => format!("{plugin} configuration: {message}"),
        }
    })
}

/// The last object key that starts before `line`:`column` (1-based) of `text`.
fn field_before(text: &str, line: usize, column: usize) -> Option<String> {
    let offset: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    let end = (offset + column).min(text.len());
    let prefix = text.get(..end)?;
    // A key is a string literal followed by `:`; scan back for the last one.
    let colon = prefix.rfind(':')?;
    let before = prefix[..colon].trim_end().strip_suffix('"')?;
    let start = before.rfind('"')?;
    Some(before[start + 1..].to_string())
}

/// An error naming `field`, the rule it broke and the value it had.
pub fn invalid(plugin: &str, field: &str, rule: &str, value: impl std::fmt::Display) -> String {
    format!("{plugin} configuration: `{field}` must be {rule}, got {value}")
}
