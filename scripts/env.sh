# Sourced by the scripts here, from the repository root: installs what a run needs
# (scripts/setup.sh: lavapipe) and gives Mesa a private runtime directory.
scripts/setup.sh
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
chmod 700 "$XDG_RUNTIME_DIR"
