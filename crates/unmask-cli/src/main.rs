//! `unmask`: run LLaDA diffusion language models on the GPU from the command line.

mod args;
mod bench;
mod bench_report;
mod chart;
mod chat;
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
mod selfcheck;
mod synth;
mod trace;

use std::io::Write;

use args::{CommandSpec, Matches, Parsed};
use error::CliError;

type Runner = fn(&Matches) -> Result<(), CliError>;

fn commands() -> Vec<(CommandSpec, Runner)> {
    vec![
        (generate::spec(), generate::run as Runner),
        (chat::spec(), chat::run),
        (eval::spec(), eval::run),
        (profile::spec(), profile::run),
        (logits::spec(), logits::run),
        (quantize::spec(), quantize::run),
        (info::spec(), info::run),
        (bench::spec(), bench::run),
        (bench_report::spec(), bench_report::run),
        (selfcheck::spec(), selfcheck::run),
        (synth::spec(), synth::run),
        (trace::spec(), trace::run),
    ]
}

fn overview(commands: &[(CommandSpec, Runner)]) -> String {
    let mut out = format!(
        "unmask {}: WebGPU inference for diffusion language models (LLaDA)\n\n\
         Usage: unmask <command> [flags]\n\nCommands:\n",
        env!("CARGO_PKG_VERSION")
    );
    for (spec, _) in commands {
        out.push_str(&format!("  {:<10} {}\n", spec.name, spec.summary));
    }
    out.push_str(&format!(
        "  {:<10} {}\n",
        "help", "show this help, or a command's: unmask help <command>"
    ));
    out.push_str(
        "\nFlags take a value as `--flag value` or `--flag=value`. \
         See `unmask <command> --help` for each command's flags.\n",
    );
    out
}

fn run(argv: &[String]) -> Result<(), CliError> {
    let commands = commands();
    let Some(first) = argv.first() else {
        eprint!("{}", overview(&commands));
        return Err(CliError::usage("no command given"));
    };
    let find = |name: &str| commands.iter().find(|(spec, _)| spec.name == name);
    match first.as_str() {
        "help" | "--help" | "-h" => {
            return match argv.get(1) {
                None => output::partial(&overview(&commands)),
                Some(name) => match find(name) {
                    Some((spec, _)) => output::partial(&spec.help()),
                    None => Err(unknown_command(&commands, name)),
                },
            };
        }
        "version" | "--version" | "-V" => {
            return output::line(&format!("unmask {}", env!("CARGO_PKG_VERSION")));
        }
        _ => {}
    }
    let Some((spec, runner)) = find(first) else {
        return Err(unknown_command(&commands, first));
    };
    match args::parse(spec, &argv[1..])? {
        Parsed::Help => output::partial(&spec.help()),
        Parsed::Run(matches) => runner(&matches),
    }
}

fn unknown_command(commands: &[(CommandSpec, Runner)], name: &str) -> CliError {
    let names: Vec<&str> = commands.iter().map(|(spec, _)| spec.name).collect();
    CliError::usage(format!(
        "unknown command `{name}`: expected one of {}, help",
        names.join(", ")
    ))
}

fn main() {
    let argv: Result<Vec<String>, _> = std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect();
    let result = match argv {
        Ok(argv) => run(&argv),
        Err(bad) => Err(CliError::usage(format!(
            "argument {bad:?} is not valid UTF-8"
        ))),
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
