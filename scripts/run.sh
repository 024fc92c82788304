#!/usr/bin/env bash
# The run command: sets up a fresh machine, then generates text with the bundled model.
# Extra arguments go to `unmask generate` (e.g. --prompt "..." --model DIR --json).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
case " $* " in
*" --prompt"* | *" --system"* | *" --model"*) ;;
*)
  # Without a prompt of its own: a question about the bundled system prompt (a table of
  # members); the bundled model answers "#### Bella city : Lima". Block-wise decoding: 8
  # blocks of 4, 16 steps. Other arguments (e.g. --cache prefix-arm) follow it.
  set -- --system "$(cat data/tasks/demo-system.txt)" --prompt "What is the city of Bella?" \
    --gen-length 32 --steps 16 --block-length 4 "$@"
  ;;
esac
exec cargo run --release --quiet -p unmask-cli -- generate "$@"
