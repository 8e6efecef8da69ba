//! `levee`: the server binary.

fn main() -> anyhow::Result<()> {
    levee::cli::main()
}
