//! `mlxcel-server`: `mlxcel serve` under llama-server's command-line shape,
//! for scripts and unit files that run `llama-server ARGS`.

#[path = "../progress.rs"]
mod progress;

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = mlxcel_server::cli::parse(std::env::args().skip(1)).and_then(|args| mlxcel_server::run(args, Box::new(progress::ServeModels)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
