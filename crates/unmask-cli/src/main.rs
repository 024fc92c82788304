//! `unmask`: run diffusion language models (LLaDA, Dream) on the GPU from the command line.

mod bench;
mod bench_report;
mod cache_flags;
mod chart;
mod chat;
mod dgemma;
mod error;
mod eval;
mod generate;
mod info;
mod live;
mod logits;
mod options;
mod output;
mod profile;
mod quantize;
mod sampling_flags;
mod score;
mod selfcheck;
mod serve;
mod synth;
mod tokenize;
mod trace;
mod values;

use std::io::Write;

use clap::{CommandFactory, Parser, Subcommand};
use clap_complete::Shell;

use error::CliError;

/// The command line: a command and its flags.
#[derive(Parser, Debug)]
#[command(
    name = "unmask",
    version,
    about = "WebGPU inference for diffusion language models (LLaDA, Dream)",
    help_template = "{name} {version}: {about}\n\n{usage-heading} {usage}\n\n{all-args}{after-help}",
    after_help = "Flags take a value as `--flag value` or `--flag=value`. \
                  See `unmask <command> --help` for each command's flags.",
    // Each flag's help names the values it takes.
    hide_possible_values = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

/// Every command. A new one (such as `serve`) is a variant holding its `#[derive(Args)]`
/// struct, which sets the command's `about` (its line in `unmask help`), `override_usage` and
/// `after_help`, and an arm in `Command::run`.
#[derive(Subcommand, Debug)]
enum Command {
    Generate(generate::GenerateArgs),
    Chat(chat::ChatArgs),
    Eval(eval::EvalArgs),
    Profile(profile::ProfileArgs),
    Logits(logits::LogitsArgs),
    Score(score::ScoreArgs),
    Quantize(quantize::QuantizeArgs),
    Info(info::InfoArgs),
    Bench(bench::BenchArgs),
    BenchReport(bench_report::BenchReportArgs),
    Selfcheck(selfcheck::SelfcheckArgs),
    Synth(synth::SynthArgs),
    Trace(trace::TraceArgs),
    Serve(serve::ServeArgs),
    Tokenize(tokenize::TokenizeArgs),
    #[command(
        about = "Print a shell completion script, e.g. `unmask completions bash > unmask.bash`."
    )]
    Completions {
        /// bash, elvish, fish, powershell or zsh
        #[arg(value_name = "SHELL")]
        shell: Shell,
    },
    #[command(hide = true, about = "Print the version (as `unmask --version` does).")]
    Version,
}

impl Command {
    fn run(&self) -> Result<(), CliError> {
        match self {
            Command::Generate(args) => generate::run(args),
            Command::Chat(args) => chat::run(args),
            Command::Eval(args) => eval::run(args),
            Command::Profile(args) => profile::run(args),
            Command::Logits(args) => logits::run(args),
            Command::Score(args) => score::run(args),
            Command::Quantize(args) => quantize::run(args),
            Command::Info(args) => info::run(args),
            Command::Bench(args) => bench::run(args),
            Command::BenchReport(args) => bench_report::run(args),
            Command::Selfcheck(args) => selfcheck::run(args),
            Command::Synth(args) => synth::run(args),
            Command::Trace(args) => trace::run(args),
            Command::Serve(args) => serve::run(args),
            Command::Tokenize(args) => tokenize::run(args),
            Command::Completions { shell } => completions(*shell),
            Command::Version => output::line(&format!("unmask {}", env!("CARGO_PKG_VERSION"))),
        }
    }
}

fn completions(shell: Shell) -> Result<(), CliError> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "unmask", &mut script);
    output::partial(&String::from_utf8_lossy(&script))
}

fn main() {
    // Help, version and command-line errors are printed by clap, which exits with 0 or 2.
    let cli = Cli::parse();
    let result = match cli.command {
        Some(command) => command.run(),
        None => {
            eprint!("{}", Cli::command().render_help());
            Err(CliError::usage("no command given"))
        }
    };
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("{}", e.report());
            e.exit_code()
        }
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        // clap's own checks: unique flags, known ids in groups, conflicts and `mut_arg`.
        Cli::command().debug_assert();
    }
}
