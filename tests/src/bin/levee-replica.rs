//! The `levee` binary, built inside this crate so that its tests can start
//! real server processes (`CARGO_BIN_EXE_levee-replica`) as replicas.

fn main() -> anyhow::Result<()> {
    levee::cli::main()
}
