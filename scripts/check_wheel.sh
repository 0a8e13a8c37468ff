#!/usr/bin/env bash
# make wheel-check: the wheel is what is tested. Builds the sdist and the wheel (python -m build: the wheel from the
# sdist), checks them (check-wheel-contents, twine check --strict), installs the wheel with the README's install
# line into a fresh venv outside the repository (CPU torch 2.13.0 first, from disk), and from an empty folder runs
# attnreg-train on the built-in task (tiny budget), its head view, attnreg-analyze on the model the run saved, an
# import of every public name (scripts/check_public_names.py), and two commands whose extra the install lacks (they
# must stop with the pip line). Nothing here reads the repository but this script's own files: the configs, the head
# view's JS and CSS and the task's data come from the installed package. About 3-4 minutes on 2 cores.
#
#   scripts/check_wheel.sh            # PYTHON: the interpreter with build, twine, check-wheel-contents (.venv's)
#   KEEP=1 scripts/check_wheel.sh     # keep the work folder (printed) to look at the run
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/attnreg-wheel.XXXXXX")
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
step() { printf '== %s (%ss)\n' "$1" "$((SECONDS - start))"; }
quiet() {  # run "$@" with its output in a log, shown only when it fails
    local log="$WORK/log.txt"
    "$@" >"$log" 2>&1 || { cat "$log"; echo "failed: $*" >&2; exit 1; }
}
fail() { echo "check_wheel: $*" >&2; exit 1; }

# The README's install line, `pip install "attnreg[EXTRAS]"`: the install tested below is that one.
extras=$(grep -m1 -oE 'pip install "attnreg\[[a-z0-9,_-]+\]"' "$ROOT/README.md" | sed -E 's/.*\[(.*)\].*/\1/') ||
    fail 'README.md has no install line of the form pip install "attnreg[EXTRAS]"'

step "build the sdist and the wheel"
quiet "$PYTHON" -m build --outdir "$WORK/dist" "$ROOT"
wheel=$(ls "$WORK"/dist/*.whl)
"$(dirname "$PYTHON")/check-wheel-contents" "$wheel"
"$PYTHON" -m twine check --strict "$WORK"/dist/*
"$PYTHON" -m zipfile -l "$wheel" >"$WORK/contents.txt"
for needed in attnreg/py.typed attnreg/app/configs/train.yaml attnreg/app/configs/data/agreement.yaml \
    attnreg/analysis/head_view.js attnreg/analysis/head_view.css; do
    grep -qE "^$needed " "$WORK/contents.txt" || fail "$needed is not in $(basename "$wheel")"
done

step "a fresh venv outside the repository: torch==2.13.0, then $(basename "$wheel")[$extras]"
python3 -m venv "$WORK/venv"
VENV="$WORK/venv/bin"
quiet "$VENV/python" -m pip install torch==2.13.0  # the CPU build on disk; another spec pulls a CUDA build
quiet "$VENV/python" -m pip install "$wheel[$extras]"

mkdir "$WORK/empty"
cd "$WORK/empty"
unset PYTHONPATH
export PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1

step "attnreg-train on the built-in task"
tiny=(data.train=64 data.val=32 data.test=16 data.hard=16 trainer.max_epochs=1 trainer.enable_progress_bar=false)
"$VENV/attnreg-train" "${tiny[@]}" hydra.run.dir=run >train.out 2>&1 || { cat train.out; fail "attnreg-train"; }
grep -E '^(attnreg-train|accuracy|model):' train.out
[ -f run/model/config.json ] || fail "the run saved no model/ (run/model/config.json)"

step "its head view"
"$VENV/python" -m attnreg.app.view run --sentences 8
grep -q "attnreg head view: draws the data" run/head_view.html || fail "the head view's HTML lacks the package's JS"

step "attnreg-analyze on the run's model"
"$VENV/python" - <<'EOF'  # held-out sentences of the built-in task, with their gold trees, as CoNLL-U
from attnreg.app.task import generate

rows = []
for example in generate(32, seed=7):
    s = example.sentence
    rows += [f"# sent_id = {s.sent_id}", f"# text = {s.text}"]
    rows += [f"{i}\t{w}\t_\t_\t_\t_\t{h}\t{r}\t_\t_" for i, (w, h, r) in enumerate(zip(s.words, s.heads, s.relations), 1)]
    rows.append("")
open("dev.conllu", "w").write("\n".join(rows) + "\n")
EOF
plots=()
"$VENV/python" -c "import matplotlib" 2>/dev/null || plots=(--no-plots)  # the plots extra is not in every install
"$VENV/attnreg-analyze" run/model dev.conllu --out report --html report/heads.html "${plots[@]}"
[ -f report/statistics.csv ] && [ -f report/heads.html ] || fail "attnreg-analyze wrote no report"

step "every public name"
"$VENV/python" - <"$ROOT/scripts/check_public_names.py"  # from stdin: sys.path holds the empty folder, not scripts/

step "a missing extra stops with the pip line"
stops() {  # stops EXTRA COMMAND...: COMMAND exits 1, its last line the pip line of EXTRA, without a traceback
    local extra=$1 status=0
    shift
    "$@" >stop.out 2>&1 || status=$?
    if [ "$status" != 1 ] || grep -q Traceback stop.out || [ "$(tail -n1 stop.out | grep -o 'pip install.*')" != "pip install \"attnreg[$extra]\"" ]; then
        cat stop.out
        fail "$* did not stop with pip install \"attnreg[$extra]\""
    fi
    tail -n1 stop.out
}
if ! "$VENV/python" -c "import matplotlib" 2>/dev/null; then
    stops plots "$VENV/attnreg-analyze" run/model dev.conllu --out report2
fi
if ! "$VENV/python" -c "import mlflow" 2>/dev/null; then
    stops mlflow "$VENV/attnreg-train" "${tiny[@]}" logger=mlflow hydra.run.dir=run2
fi

step "done: $(basename "$wheel") installed as README.md says (attnreg[$extras]) and run from an empty folder"
