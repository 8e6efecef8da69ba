//! Builds every Wasm guest from source for `wasm32-wasip2`: the reference
//! plugins under `plugins/` and the test guests under `tests/guests/`. No
//! `.wasm` is committed. `OUT_DIR/guests.rs` gets one path constant per guest.

use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";

/// Package names of the crates directly under `dir`.
fn crates_under(dir: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(found) };
    for entry in entries {
        let path = entry?.path();
        let manifest = path.join("Cargo.toml");
        if !manifest.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&manifest)?;
        let name = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name = ").map(|n| n.trim_matches('"').to_string()))
            .with_context(|| format!("{} has no package name", manifest.display()))?;
        found.push((name, path));
    }
    found.sort();
    Ok(found)
}

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.parent().context("tests/ has a parent")?.to_path_buf();
    let mut guests = crates_under(&root.join("plugins"))?;
    guests.extend(crates_under(&manifest_dir.join("guests"))?);

    for dir in ["wit", "plugin-sdk/src", "plugin-sdk/Cargo.toml", "plugins", "tests/guests"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    for (_, path) in &guests {
        println!("cargo:rerun-if-changed={}", path.display());
    }

    let target_dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("wasm-guests"),
        None => root.join("target").join("wasm-guests"),
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(&root).args(["build", "--release", "--target", TARGET, "--target-dir"]).arg(&target_dir);
    for (name, _) in &guests {
        command.args(["-p", name]);
    }
    // The outer build's settings (clippy's wrapper, host rustflags) are not the guests'.
    // Guests need no debug info; it triples their size and their compile time in the host.
    command.env("CARGO_PROFILE_RELEASE_DEBUG", "false").env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    for var in [
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
    ] {
        command.env_remove(var);
    }
    let status = command.status().context("running cargo for the Wasm guests")?;
    if !status.success() {
        bail!("building the Wasm guests failed (is the target installed? `rustup target add {TARGET}`)");
    }

    let mut consts = String::new();
    for (name, _) in &guests {
        let file = target_dir.join(TARGET).join("release").join(format!("{}.wasm", name.replace('-', "_")));
        if !file.exists() {
            bail!("expected {} after building the guests", file.display());
        }
        let ident =
            name.trim_start_matches("guest-").trim_start_matches("levee-plugin-").replace('-', "_").to_uppercase();
        consts.push_str(&format!(
            "/// `{name}`, built for {TARGET}.\npub const {ident}: &str = {:?};\n",
            file.display().to_string()
        ));
    }
    std::fs::write(PathBuf::from(std::env::var("OUT_DIR")?).join("guests.rs"), consts)?;
    Ok(())
}
